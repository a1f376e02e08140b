"""Which of aggressive decoding and the regular greedy step decodes a batch (speed only)."""
from typing import Dict, Optional

AGGRESSIVE, PLAIN = "aggressive", "plain"


class SpeedChooser:
    """Per batch size, whichever of aggressive decoding and the regular greedy step is
    faster here, measured on the batches themselves (the output is the same either way).

    Whether drafting pays depends on the batch (a block pass over many rows costs more
    than the tokens it saves when drafts are short), the model and the machine.  The
    process's first batch runs the regular step and is not measured: it pays one-time
    costs whichever mode runs it (lazy imports such as the sympy that torch's first
    ``F.multi_head_attention_forward`` pulls in, first allocations), which would
    otherwise count against the mode that happened to go first.  Then each batch-size
    class (powers of two) alternates the two modes until each has produced
    ``WARMUP_TOKENS`` tokens, and from then on decodes with the one of fewer seconds per
    output token (decayed sums of seconds and of tokens: robust to sentences of
    different lengths), trying the other again every ``EXPLORE_EVERY`` batches
    (``EXPLORE_RARELY`` once one mode is more than ``CLEAR_GAP`` times faster).  A
    class not warmed up yet follows a warm neighbouring class (half or twice its size:
    e.g. the smaller last batch of a run), else measures on its own.
    """

    WARMUP_TOKENS = 64  # per mode and class: one batch of 32, about three single sentences
    EXPLORE_EVERY = 8  # batches, while the modes are within CLEAR_GAP of each other
    EXPLORE_RARELY = 32  # batches, once one mode is clearly faster
    CLEAR_GAP = 1.25
    DECAY = 0.8  # weight of the past in the decayed sums, per batch of that mode

    def __init__(self):
        # class -> {"n": batches, mode: [batches, decayed seconds, decayed tokens, tokens]}
        self.classes: Dict[int, dict] = {}
        self.cold = True  # no batch decoded in this process yet

    @staticmethod
    def _key(bsz: int) -> int:
        return 1 << max(0, (bsz - 1).bit_length())

    def _class(self, bsz: int) -> dict:
        return self.classes.setdefault(
            self._key(bsz), {"n": 0, AGGRESSIVE: [0, 0.0, 0.0, 0], PLAIN: [0, 0.0, 0.0, 0]})

    @classmethod
    def _warm(cls, c: dict) -> bool:
        return min(c[AGGRESSIVE][3], c[PLAIN][3]) >= cls.WARMUP_TOKENS

    @staticmethod
    def _rate(entry) -> float:
        return entry[1] / max(entry[2], 1e-9)

    def choose(self, bsz: int) -> str:
        if self.cold:
            return PLAIN
        c = self._class(bsz)
        c["n"] += 1
        if not self._warm(c):
            near = self._nearest_warm(bsz)
            if near is None:  # measure both, alternating
                return AGGRESSIVE if c[AGGRESSIVE][3] <= c[PLAIN][3] else PLAIN
            c = dict(near, n=c["n"])
        best, other = ((AGGRESSIVE, PLAIN) if self._rate(c[AGGRESSIVE]) <= self._rate(c[PLAIN])
                       else (PLAIN, AGGRESSIVE))
        return other if c["n"] % self.explore_every(c) == 0 else best

    def explore_every(self, c: dict) -> int:
        """How often (in batches) a warm class tries its slower mode again: often while
        the two are close, rarely once one is clearly faster (each try costs the gap)."""
        fast, slow = sorted((self._rate(c[AGGRESSIVE]), self._rate(c[PLAIN])))
        return self.EXPLORE_RARELY if slow > self.CLEAR_GAP * fast else self.EXPLORE_EVERY

    def _nearest_warm(self, bsz: int) -> Optional[dict]:
        own = self._key(bsz).bit_length()
        done = [(abs(k.bit_length() - own), k) for k, c in self.classes.items()
                if self._warm(c) and 0 < abs(k.bit_length() - own) <= 1]
        return self.classes[min(done)[1]] if done else None

    def record(self, mode: str, bsz: int, seconds: float, tokens: int) -> None:
        if self.cold:  # the process's first batch: one-time costs, not a measurement
            self.cold = False
            return
        entry = self._class(bsz)[mode]
        entry[0] += 1
        entry[1] = self.DECAY * entry[1] + seconds
        entry[2] = self.DECAY * entry[2] + tokens
        entry[3] += tokens
