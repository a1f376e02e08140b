"""Continuous batching: a stream of fairseq batches decoded with every slot kept busy.

fairseq-generate decodes one batch at a time, and a batch's last steps run over the few
sentences still going.  Here up to ``capacity`` sentences are in flight: when one
finishes, the next sentence of the data takes its slot at the next step.  A batch is
still encoded whole (its encoder output, hence each sentence's source states, are
stock's), and every sentence keeps what stock decodes it with in its own batch: the length
limit of that batch (``max_len_a * src_width + max_len_b`` of the batch's padded width, or
``--match-source-len``'s), its prefix tokens, min length, n-gram ban and unk penalty,
each at its own step.  Batches come out whole and in input order.

Batches the engine does not serve (a prefix that contains eos: stock then copies beams
across the batch) are decoded by the generator's batch-at-a-time path, in order.

On oneDNN's GEMMs (``--fastgen-tune gemm=auto``/``onednn``) the margin guard (:mod:`.margins`)
marks each sentence whose beam compared candidates too close to call; such a sentence
leaves its slot at that step (whatever its later steps, it is decoded again), and those
are decoded again by a second engine on MKL, from their batch's encoder output (computed
on MKL), once enough are gathered to fill it or nothing else is in flight, and their
batch waits.

The input is an iterable of batches, or a feed (:class:`Feed`) that may have no batch
yet: a decoding worker's task queue (tasks/stream_worker.py), which must not be waited on
while sentences are in flight.
"""
import logging
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ...models.slot_decoder import SlotDecoder
from ..step_rules import StepAt, StepRules
from . import margins
from .beams import SlotBeams
from .inputs import Batch, Feed, Pending, by_batch
from .serving import auto_rows, engine_onednn, unsupported  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

# margin guard: done sentences held back (in slots' worth) before the ones to decode
# again are decoded, however few (their batches' encoder output waits with them)
HOLD_SLOTS = 16


class ContinuousBeamSearch:
    """Beam search over a stream of batches with refilled slots (see the module doc).

    generator: a :class:`~fairseq_fastgen.search.fast_sequence_generator.FastSequenceGenerator`
    whose fast path serves these batches; ``capacity``: sentences in flight at most (0:
    the largest batch seen so far, at most ``--fastgen-tune continuous_rows`` rows);
    ``regular(sample, prefix_tokens)``: the batch-at-a-time decoding of a batch the engine does not serve.  With ``auto`` on
    CPU, while no batch has had more than one sentence, batches go to ``regular``
    (nothing to refill; measured 4% faster there, docs/continuous-batching.md).
    """

    def __init__(self, generator, capacity: int = 0,
                 regular: Optional[Callable[[Dict[str, Any], Optional[Tensor]], list]] = None,
                 onednn: Optional[bool] = None):
        """onednn: the decoders' GEMM kernel (None: as ``--fastgen-tune gemm`` resolves it).
        On oneDNN with ``--fastgen-tune margin_guard`` > 0, a sentence whose decoding compared
        candidates closer than the margin is decoded again on MKL (:mod:`.margins`)."""
        self.gen = generator
        self.capacity = capacity
        self.regular = regular
        self.beam = generator.beam_size
        self.onednn = engine_onednn(generator) if onednn is None else onednn
        self.margin = generator.fastgen.margin_guard if self.onednn else 0.0
        rows = generator.fastgen.continuous_rows or auto_rows(generator, self.onednn)
        self.max_slots = max(1, rows // self.beam) if rows else None
        self.rules = StepRules.of(generator)
        self.singles_regular = regular is not None and generator.fastgen.continuous == "auto" \
            and not next(generator.model.parameters()).is_cuda
        # the generator's own layer stacks, on this engine's kernel: one copy of the weights
        self.decoders = []
        for d in generator._decoders():
            stack = d.stack.with_gemm(self.onednn)
            native = d.native_for_slots()
            self.decoders.append(SlotDecoder(
                stack, self.beam, native=native.for_stack(stack) if native is not None else None))
        self._reference: Optional["ContinuousBeamSearch"] = None
        if self.margin > 0:
            logger.info("fairseq-fastgen: continuous batching on oneDNN GEMMs; a sentence "
                        "whose beam compared candidates closer than %g is decoded again on "
                        "MKL (--fastgen-tune margin_guard)", self.margin)

    def reference(self) -> "ContinuousBeamSearch":
        """The engine on MKL, stock's kernel (the margin guard's second decoding)."""
        if self._reference is None:
            self._reference = ContinuousBeamSearch(self.gen, onednn=False)
            self._reference.prepare()
        return self._reference

    def prepare(self) -> None:
        for d in self.decoders:
            d.prepare()

    # ---- the stream ---------------------------------------------------------------------

    def run(self, batches) -> Iterator[Tuple[Dict[str, Any], list]]:
        """(sample, prefix_tokens) in (an iterable, or a :class:`Feed`), (sample, hypos)
        out in the same order; hypos as ``SequenceGenerator.generate`` returns them."""
        feed = batches if hasattr(batches, "take") else Feed(batches)
        with torch.no_grad():
            yield from _Run(self, feed).loop()


class _Run:
    """The state of one :meth:`ContinuousBeamSearch.run`."""

    def __init__(self, eng: ContinuousBeamSearch, feed: Feed):
        self.eng = eng
        self.feed = feed
        self.exhausted = False
        self.order: Deque[Batch] = deque()  # batches not yet handed out, input order
        self.pending: Deque[Pending] = deque()
        self.capacity = eng.capacity
        self.beams: Optional[SlotBeams] = None
        # per slot (host): its sentence, step, length limit
        self.slot_of: List[Optional[Pending]] = []  # None: free
        self._prefix: Optional[Tensor] = None  # (slots, P) prefix tokens of each slot
        self.steps: List[int] = []
        self.limits: List[int] = []
        self.guard: Optional[margins.MarginGuard] = None  # with a margin, from the first admit
        self.sentences = self.redone = 0
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
        if self.eng.margin > 0 and self.sentences:
            logger.info("fairseq-fastgen: margin guard: %d of %d sentences decoded again on "
                        "MKL", self.redone, self.sentences)

    # ---- input -------------------------------------------------------------------------

    def _pull(self) -> bool:
        """Encode the next batch into the pending sentences; False at the end, when the
        feed has none yet, or when the batch was decoded batch-at-a-time (it is then
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
            if self.eng.capacity == 0:  # the largest batch seen (fairseq's batches <= --batch-size)
                self.capacity = max(self.capacity, min(bsz, self.eng.max_slots or bsz))
            indices = list(again[0]) if again else list(range(bsz))
            b = Batch(sample, [None] * bsz, len(indices), prefix)
            self.order.append(b)
            if bsz == 0:
                continue
            single = bsz == 1 and self.capacity <= 1 and self.eng.singles_regular
            if single or prefix is not None and bool(prefix.eq(self.eng.rules.eos).any()):
                b.hypos = self.eng.regular(sample, prefix)
                b.remaining = 0
                return False  # out before the next batch is read
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
            guarded = self.eng.margin > 0
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
                                   native=g.fastgen.native_candidates and not g.fastgen.bitwise)
        self.beams.ensure(len(self.slot_of), max(self.limits) + 1)
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        self.beams.start(slot_t, eng.gen.eos)  # stock's start token (bos_token=None)
        if eng.margin > 0:
            if self.guard is None:
                g = eng.gen
                self.guard = margins.MarginGuard(
                    eng.margin, g.len_penalty if g.normalize_scores else None, dev)
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
        steps = torch.tensor(self.steps, dtype=torch.long, device=dev)
        limits = torch.tensor(self.limits, dtype=torch.long, device=dev)
        row_steps = steps.repeat_interleave(k)
        n = s * k
        t_max = max(self.steps)
        last = beams.tokens[:n].gather(1, row_steps.unsqueeze(1)).squeeze(1)
        lprobs, finite = self._forward(last, row_steps, t_max)
        rules = eng.rules
        rows = torch.arange(s, device=dev).repeat_interleave(k) if self._prefix is not None else None
        at = StepAt(min(self.steps), t_max, row_steps, rows, limits.repeat_interleave(k))
        rules.mask_step(lprobs, at, max(self.limits), finite, self._prefix, beam=k)
        lprobs = rules.ban_repeats(lprobs, at, beams.tokens[:n], s, k)
        src_len = torch.stack([p.batch.src_len[p.index] for p in self.slot_of]) if (
            rules.match_source_len) else steps
        at_limit = steps.ge(limits)
        order = beams.step(lprobs, steps, steps.eq(0), src_len, eng.margin, at_limit)
        if self.guard is not None:
            self.guard.step(beams.tight)
        stuck = at_limit & ~beams.had_eos
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

    def _forward(self, last: Tensor, row_steps: Tensor, t_max: int):
        """Ensemble step combined as fairseq's ``EnsembleModel.forward_decoder``."""
        import math

        temp = self.eng.gen.temperature
        outs = [d.step(last, row_steps, t_max, temp) for d in self.eng.decoders]
        if len(outs) == 1:
            return outs[0]
        lp = torch.logsumexp(torch.stack([o[0] for o in outs], dim=0), dim=0) - math.log(len(outs))
        return lp, all(o[1] for o in outs)

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
        for slot, hyps, redo in zip(done, b.hypotheses(done_t), again):
            p = self.slot_of[slot]
            if redo:
                p.batch.redo.append(p.index)
            else:
                p.batch.hypos[p.index] = hyps
            p.batch.remaining -= 1
            if p.batch.remaining == 0:
                p.batch.cross = []  # only a second decoding reads the batch again
                if not p.batch.redo:
                    p.batch.encoder_outs = None
            self.slot_of[slot] = None
        self.sentences += len(done)
        self.redone += sum(again)

    def _compact(self) -> None:
        """Drop the free slots (no sentence is left to take them)."""
        beams, k = self.beams, self.eng.beam
        dev = beams.device
        keep = [i for i, p in enumerate(self.slot_of) if p is not None]
        keep_t = torch.tensor(keep, dtype=torch.long, device=dev)
        rows = (keep_t.unsqueeze(1) * k + torch.arange(k, device=dev)).view(-1)
        n = rows.numel()
        beams.tokens[:n] = beams.tokens.index_select(0, rows)
        beams.scores[:n] = beams.scores.index_select(0, rows)
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
