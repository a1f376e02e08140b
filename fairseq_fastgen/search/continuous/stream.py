"""One run of the continuous-batching engine (:mod:`.engine`): its slots, their beams and
decoder caches, the batches in flight and the margin guard's record.

Each step decodes every slot, applies stock's per-step rules at each slot's own step,
retires finished sentences to their batch and refills the freed slots; batches go out
whole, in input order, once their sentences (and any the guard sends back, decoded again
on MKL) are done.
"""
import math
from collections import deque
from typing import Deque, List, Optional

import torch
from torch import Tensor

from ..step_rules import StepAt
from . import margins
from .beams import SlotBeams
from .inputs import Batch, Feed, Pending, by_batch

# margin guard: done sentences held back (in slots' worth) before the ones to decode
# again are decoded, however few (their batches' encoder output waits with them)
HOLD_SLOTS = 16
# margin guard: every RECHECK_EVERY-th batch of a run is decoded on both kernels, and the
# margin grows if that batch's score moves ask for more (about 1/64 more MKL decoding)
RECHECK_EVERY = 64


class StreamRun:
    """The state of one :meth:`ContinuousBeamSearch.run`: slots, beams, batches in flight."""

    def __init__(self, eng, feed: Feed, margin: float, bos: Optional[int] = None,
                 capacity: Optional[int] = None):
        """eng: the :class:`~.engine.ContinuousBeamSearch` running; margin: the guard's;
        bos: the first token of every hypothesis (None: eos, stock's default); capacity:
        slots, fixed (None: the engine's)."""
        self.eng = eng
        self.feed = feed
        self.margin = margin
        self.bos = eng.gen.eos if bos is None else bos
        self.exhausted = False
        self.order: Deque[Batch] = deque()  # batches not yet handed out, input order
        self.pending: Deque[Pending] = deque()
        self.fixed = capacity is not None
        self.capacity = eng.capacity if capacity is None else capacity
        self.beams: Optional[SlotBeams] = None
        # per slot (host): its sentence, step, length limit
        self.slot_of: List[Optional[Pending]] = []  # None: free
        self._prefix: Optional[Tensor] = None  # (slots, P) prefix tokens of each slot
        self.steps: List[int] = []
        self.limits: List[int] = []
        self.guard: Optional[margins.MarginGuard] = None  # with a margin, from the first admit
        self.sentences = self.redone = self.batches = self.rechecked = 0
        for d in eng.decoders:
            d.reset()

    def loop(self):
        self._fill()
        yield from self._ready()
        while self.slot_of or not self.exhausted:
            if self.slot_of:
                self._retire(self._step())
            self._fill()
            yield from self._ready()
        yield from self._ready(flush=True)
        assert not self.order, "continuous batching: a batch was left unfinished"

    # ---- input -------------------------------------------------------------------------

    def _pull(self) -> bool:
        """Encode the next batch into the pending sentences; False at the end, when the
        feed has none yet, or when the batch was decoded by ``regular`` (it is then
        ready to go out)."""
        while True:
            try:
                got = self.feed.take(wait=not self.slot_of and not self.pending)
            except StopIteration:
                self.exhausted = True
                return False
            if got is None:
                return False
            # a second decoding (margin guard) also names its sentences and encoder output
            sample, prefix, *again = got
            bsz = sample["net_input"]["src_tokens"].size(0)
            if self.eng.capacity == 0 and not self.fixed:  # the largest batch seen (fairseq's batches <= --batch-size)
                self.capacity = max(self.capacity, min(bsz, self.eng.max_slots or bsz))
            indices = list(again[0]) if again else list(range(bsz))
            b = Batch(sample, [None] * bsz, len(indices), prefix)
            self.order.append(b)
            if bsz == 0:
                continue
            if self.eng.goes_regular(prefix):
                b.hypos = self.eng.regular(sample, prefix)
                b.remaining = 0
                return False  # out before the next batch is read
            self.batches += 1
            if self.margin > 0 and not again and self.batches % RECHECK_EVERY == 0:
                b.other = [None] * bsz
            self._encode(b, again[1] if again else None)
            self.pending.extend(Pending(b, i) for i in indices)
            return True

    def _encode(self, b: Batch, encoder_outs: Optional[list] = None) -> None:
        """The batch's source lengths, length limit and encoder-decoder keys/values (of
        ``encoder_outs`` if given).  Under the margin guard the encoder runs on MKL, as
        stock's, and its output is kept for a second decoding."""
        net_input = b.sample["net_input"]
        rules = self.eng.rules
        b.src_len = rules.source_lengths(net_input)
        b.max_len = rules.max_len(net_input["src_tokens"], b.src_len)
        if encoder_outs is None:
            guarded = self.margin > 0
            encoder_outs = self.eng.gen.forward_encoder(
                net_input, onednn=self.eng.onednn and not guarded)
            if guarded:
                b.encoder_outs = encoder_outs
        b.cross = [d.batch_cross(encoder_outs[i] if encoder_outs is not None else None)
                   for i, d in enumerate(self.eng.decoders)]

    def _fill(self) -> None:
        """Free slots take pending sentences (new batches encoded as needed): first the
        slots of finished sentences, in place, then new slots up to the capacity; slots
        left empty (the data is used up) are compacted away."""
        while True:
            free = [i for i, p in enumerate(self.slot_of) if p is None]
            room = len(free) + max(0, self.capacity - len(self.slot_of))
            if len(self.pending) >= max(room, 1) or self.exhausted or not self._pull():
                break
        free = [i for i, p in enumerate(self.slot_of) if p is None]
        room = len(free) + max(0, self.capacity - len(self.slot_of))
        take = [self.pending.popleft() for _ in range(min(room, len(self.pending)))]
        if take:
            n_new = max(0, len(take) - len(free))
            slots = free[: len(take)] + list(range(len(self.slot_of), len(self.slot_of) + n_new))
            self.slot_of.extend([None] * n_new)
            self.steps.extend([0] * n_new)
            self.limits.extend([0] * n_new)
            self._admit(take, slots)
        if any(p is None for p in self.slot_of):
            self._compact()

    def _admit(self, take: List[Pending], slots: List[int]) -> None:
        eng = self.eng
        for p, s in zip(take, slots):
            self.slot_of[s] = p
            self.steps[s] = 0
            self.limits[s] = p.batch.max_len
        dev = take[0].batch.sample["net_input"]["src_tokens"].device
        if self.beams is None:
            g = eng.gen
            self.beams = SlotBeams(eng.beam, g.eos, g.pad, g.normalize_scores, g.len_penalty,
                                   g.match_source_len, dev,
                                   native=g.fastgen.native_candidates and not g.fastgen.bitwise,
                                   select=eng.select, stock_topk=eng.stock_topk,
                                   attention=eng.need_attn)
        self.beams.ensure(len(self.slot_of), max(self.limits) + 1)
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        self.beams.start(slot_t, self.bos)
        if self.margin > 0:
            if self.guard is None:
                g = eng.gen
                self.guard = margins.MarginGuard(
                    self.margin, g.len_penalty if g.normalize_scores else None, dev)
            self.guard.admit(slot_t, len(self.slot_of))
        rows = len(self.slot_of) * eng.beam
        for b, (idx, group) in by_batch(take, slots):
            s_t = torch.tensor(group, dtype=torch.long, device=dev)
            i_t = torch.tensor(idx, dtype=torch.long, device=dev)
            for d, cross in zip(eng.decoders, b.cross):
                d.admit(s_t, cross, i_t, rows, max(self.limits) + 1)
        self._set_prefix(take, slots, dev)

    def _set_prefix(self, take, slots, dev) -> None:
        need = any(p.batch.prefix is not None for p in take) or self._prefix is not None
        if not need:
            return
        width = max([p.batch.prefix.size(1) for p in take if p.batch.prefix is not None]
                    + [self._prefix.size(1) if self._prefix is not None else 0])
        n = len(self.slot_of)
        pre = torch.full((n, width), self.eng.gen.pad, dtype=torch.long, device=dev)
        if self._prefix is not None:
            pre[: self._prefix.size(0), : self._prefix.size(1)] = self._prefix
        for p, s in zip(take, slots):
            row = p.batch.prefix[p.index] if p.batch.prefix is not None else None
            pre[s] = self.eng.gen.pad
            if row is not None:
                pre[s, : row.numel()] = row
        self._prefix = pre

    # ---- the step ----------------------------------------------------------------------

    def _step(self) -> List[int]:
        """One decoder step of every slot; returns the slots whose sentence is done."""
        eng, beams, k = self.eng, self.beams, self.eng.beam
        s = len(self.slot_of)
        dev = beams.device
        n = s * k
        lo, t_max = min(self.steps), max(self.steps)
        # every slot at one step, of one length limit (a batch decoded on its own): stock's
        # uniform step and rules (any n-gram blocker; sampling's draws)
        uniform = lo == t_max and min(self.limits) == max(self.limits)
        steps = torch.tensor(self.steps, dtype=torch.long, device=dev)
        limits = torch.tensor(self.limits, dtype=torch.long, device=dev)
        row_steps = steps.repeat_interleave(k)
        if uniform:
            last = beams.tokens[:n, lo]
            lprobs, finite, attn = self._forward(last, None, t_max)
            at = StepAt.uniform(lo)
        else:
            last = beams.tokens[:n].gather(1, row_steps.unsqueeze(1)).squeeze(1)
            lprobs, finite, attn = self._forward(last, row_steps, t_max)
            rows = torch.arange(s, device=dev).repeat_interleave(k) if (
                self._prefix is not None) else None
            at = StepAt(lo, t_max, row_steps, rows, limits.repeat_interleave(k))
        rules = eng.rules
        rules.mask_step(lprobs, at, max(self.limits), finite, self._prefix, beam=k)
        lprobs = rules.ban_repeats(lprobs, at, beams.tokens[:n], s, k)
        src_len = torch.stack([p.batch.src_len[p.index] for p in self.slot_of]) if (
            rules.match_source_len) else steps
        at_limit = steps.ge(limits)
        order, had_eos, tight = beams.step(lprobs, steps, steps.eq(0), src_len, self.margin,
                                           at_limit, uniform=lo if uniform else None, attn=attn)
        if self.guard is not None:
            self.guard.step(tight)
        stuck = at_limit & ~had_eos
        if bool(stuck.any()):
            # stock finishes a sentence at its length limit only through an eos candidate;
            # one whose every candidate scores -inf (e.g. the n-gram ban left no word) fails
            # its batch with this assertion, and so does the stream
            i = int(stuck.nonzero()[0])
            raise AssertionError(f"{self.steps[i]} < {self.limits[i]}")
        done_t = beams.fin_count[:s].ge(k) | at_limit
        if self.guard is not None:
            # a flagged sentence is decoded again whatever its later steps: out now, so
            # that its slot takes the next sentence and its second decoding comes sooner
            done_t |= self.guard.tight[:s]
        done = done_t.nonzero().squeeze(1).tolist()
        for d in eng.decoders:
            d.reorder(order, None, t_max + 1)
        for i in range(s):
            self.steps[i] += 1
        return done

    def _forward(self, last: Tensor, row_steps: Optional[Tensor], t_max: int):
        """Ensemble step combined as fairseq's ``EnsembleModel.forward_decoder``: lprobs
        (n, V), whether the logits were proven finite, and the attention (n, S) averaged
        over the models (None unless the engine keeps it; S: the widest source in
        flight)."""
        temp, need_attn = self.eng.gen.temperature, self.eng.need_attn
        outs = [d.step(last, row_steps, t_max, temp, need_attn) for d in self.eng.decoders]
        attn = None
        if need_attn and outs[0].attn is not None:
            width = max(p.batch.sample["net_input"]["src_tokens"].size(1) for p in self.slot_of)
            attn = outs[0].attn[:, :width]
            if len(outs) > 1:  # stock's order: added model by model, then divided
                attn = attn.clone()
                for o in outs[1:]:
                    attn.add_(o.attn[:, :width])
                attn.div_(len(outs))
        if len(outs) == 1:
            return outs[0].lprobs, outs[0].logits_finite, attn
        lp = torch.logsumexp(torch.stack([o.lprobs for o in outs], dim=0), dim=0) - math.log(len(outs))
        return lp, all(o.logits_finite for o in outs), attn

    # ---- output ------------------------------------------------------------------------

    def _retire(self, done: List[int]) -> None:
        """Done slots hand their hypotheses to their batch and become free."""
        if not done:
            return
        dev = self.beams.device
        done_t = torch.tensor(done, device=dev)
        b = self.beams
        again = self.guard.finished(done_t, b.fin_score, b.fin_len, b.fin_count) \
            if self.guard is not None else [False] * len(done)
        widths = [self.slot_of[i].batch.sample["net_input"]["src_tokens"].size(1)
                  for i in done] if self.eng.need_attn else None
        for slot, hyps, redo in zip(done, b.hypotheses(done_t, widths), again):
            p = self.slot_of[slot]
            if p.batch.other is not None:  # re-checking the margin: decoded on MKL too
                p.batch.other[p.index] = hyps
                redo = True
            if redo:
                p.batch.redo.append(p.index)
                self.redone += 1
            else:
                p.batch.hypos[p.index] = hyps
            p.batch.remaining -= 1
            if p.batch.remaining == 0:
                p.batch.cross = []  # only a second decoding reads the batch again
                if not p.batch.redo:
                    p.batch.encoder_outs = None
            self.slot_of[slot] = None
        self.sentences += len(done)

    def _compact(self) -> None:
        """Drop the free slots (no sentence is left to take them)."""
        beams, k = self.beams, self.eng.beam
        dev = beams.device
        keep = [i for i, p in enumerate(self.slot_of) if p is not None]
        keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
        rows = (keep_t.unsqueeze(1) * k + torch.arange(k, device=dev)).view(-1)
        beams.keep(keep_t)
        t = max(self.steps) + 1
        for d in self.eng.decoders:
            d.reorder(rows, keep_t, t)
        self.slot_of = [self.slot_of[i] for i in keep]
        if self.guard is not None:
            self.guard.compact(keep_t)
        self.steps = [self.steps[i] for i in keep]
        self.limits = [self.limits[i] for i in keep]
        if self._prefix is not None:
            self._prefix = self._prefix.index_select(0, keep_t)

    def _ready(self, flush: bool = False):
        """Hand out the done batches at the head of the input order.  A batch with
        sentences to decode again waits until enough of them are gathered to fill the
        reference engine (:meth:`_again_due`), or ``flush``."""
        while self.order and self.order[0].remaining == 0:
            if self.order[0].redo:
                if not (flush or self._again_due()):
                    return
                self._decode_again()
            b = self.order.popleft()
            b.cross, b.encoder_outs = [], None
            yield b.sample, b.hypos

    def _again_due(self) -> bool:
        """Whether to decode the gathered sentences again now: as many as the engine has
        slots, nothing in flight (the input may wait for this output), or many done
        sentences held back."""
        if not self.slot_of and not self.pending:
            return True
        done = [b for b in self.order if b.remaining == 0]
        want = max(self.capacity, 1)
        return sum(len(b.redo) for b in done) >= want or \
            sum(len(b.hypos) for b in done) >= HOLD_SLOTS * want

    def _decode_again(self) -> None:
        """The margin guard's sentences of every done batch, decoded on MKL together."""
        batches = [b for b in self.order if b.remaining == 0 and b.redo]
        items = [(b.sample, b.prefix, b.redo, b.encoder_outs) for b in batches]
        for b, (_, hypos) in zip(batches, self.eng.reference().run(items)):
            for i in b.redo:
                b.hypos[i] = hypos[i]
            b.redo = []
            if b.other is not None:
                self._recheck(b)

    def _recheck(self, b: Batch) -> None:
        """A re-check batch, decoded on both kernels: the margin grows to what its score
        moves ask for (:func:`.margins.rechecked`), never shrinks."""
        margin = margins.rechecked(b.hypos, b.other, self.eng.multiple, self.margin)
        self.rechecked += len(b.other)
        b.other = None
        if margin > self.margin:
            self.margin = self.eng.margin = self.guard.margin = margin
