"""How often two generation outputs pick the same best hypothesis, and each one's BLEU.

A half-precision run (``--fp16``, ``--bf16``) cannot promise stock's tokens: stock's own
half-precision output changes with the batch size (docs/lossless.md, "Half precision").
Its promise is relative: the plugin agrees with stock in the same precision at least as
often as stock agrees with itself at another batch size (the noise floor), and its BLEU
stays within stock's.  :func:`agreement` counts that from two outputs.
"""
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

_HYPO = re.compile(r"^H-(\d+)\t[^\t]*\t(.*)$", re.M)
_BLEU = re.compile(r"BLEU4? = ([\d.]+)")


@dataclass
class Agreement:
    sentences: int  # sentences both outputs have
    same: int  # of those, how many have the same best hypothesis (tokens)
    only_one: int  # sentences one output has and the other lacks
    bleu_a: Optional[float]
    bleu_b: Optional[float]

    def summary(self, a: str = "stock", b: str = "plugin") -> str:
        bleu = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        s = f"{self.same} of {self.sentences} sentences agree"
        if self.only_one:
            s += f" ({self.only_one} in one output only)"
        return s + f"; BLEU {a} {bleu(self.bleu_a)}, {b} {bleu(self.bleu_b)}"


def best_hypotheses(text: str) -> Dict[int, str]:
    """{sentence id: token text of its first (best) H line} of a fairseq-generate output."""
    best: Dict[int, str] = {}
    for m in _HYPO.finditer(text):
        best.setdefault(int(m.group(1)), m.group(2))
    return best


def bleu(text: str) -> Optional[float]:
    """The BLEU score of fairseq-generate's summary line, None without one."""
    m = _BLEU.search(text)
    return float(m.group(1)) if m else None


def agreement(a: str, b: str) -> Agreement:
    """Agreement of outputs ``a`` and ``b`` (fairseq-generate stdout)."""
    ha, hb = best_hypotheses(a), best_hypotheses(b)
    both = ha.keys() & hb.keys()
    return Agreement(sentences=len(both), same=sum(ha[i] == hb[i] for i in both),
                     only_one=len(ha.keys() ^ hb.keys()), bleu_a=bleu(a), bleu_b=bleu(b))


def unexplained(reference: str, plugin: str, floors: Sequence[str]) -> List[int]:
    """The half-precision contract's failures: [] when ``plugin`` agrees with ``reference``
    at least as often as the least agreeing of ``floors`` (the reference's runs at other
    batch sizes) does; else the sentences whose plugin hypothesis is neither the
    reference's nor one a floor gives (the noise floor explains the others)."""
    ref, got = best_hypotheses(reference), best_hypotheses(plugin)
    seen = [best_hypotheses(f) for f in floors]
    same = sum(ref[i] == got.get(i) for i in ref)
    if floors and same >= min(agreement(reference, f).same for f in floors):
        return []
    return [i for i in ref if ref[i] != got.get(i) and all(s.get(i) != got.get(i) for s in seen)]
