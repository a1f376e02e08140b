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

The input is an iterable of batches, or a feed (:class:`Feed`) that may have no batch
yet: a decoding worker's task queue (tasks/stream_worker.py), which must not be waited on
while sentences are in flight.
"""
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ...models.slot_decoder import SlotDecoder
from ..step_rules import StepAt, StepRules
from .beams import SlotBeams

logger = logging.getLogger(__name__)

# --fastgen-continuous-rows 0 on CPU: rows in flight at most.  Measured (Xeon, es->en,
# beam 5, docs/continuous-batching.md): 16-32 sentences beat 64, 1 and 2 threads alike;
# a step's (rows, vocab) logits then stay in the core's cache.  With oneDNN's GEMMs
# (models/gemm_kernel.py), which gain more from rows than MKL's, 256 rows took a
# batch-64 run 9.9-10.0 s -> 8.2-8.8 s (AMD EPYC; benchmarks/results/NOTES.md).
AUTO_CPU_ROWS = 128
AUTO_CPU_ROWS_ONEDNN = 256


def _auto_rows(generator) -> int:
    """Rows in flight at most by default (0: no bound)."""
    if next(generator.model.parameters()).is_cuda:
        return 0
    return AUTO_CPU_ROWS_ONEDNN if generator.onednn_gemms() else AUTO_CPU_ROWS


def unsupported(generator, task=None, constraints: bool = False) -> Optional[str]:
    """Why these batches are decoded one at a time (None: the engine serves them)."""
    from fairseq.tasks import FairseqTask

    cfg = getattr(generator, "fastgen", None)
    if cfg is None or not hasattr(generator, "_decoders"):
        return "not the fastgen generator"
    if cfg.continuous == "off":
        return "switched off (--fastgen-continuous off)"
    if cfg.bitwise:
        return "bitwise mode keeps stock's batches and GEMM shapes"
    if generator._fallback_reason is not None:
        return generator._fallback_reason
    if getattr(generator, "_sampling", False):
        return "sampling draws stock's random numbers over stock's batches"
    if generator.need_attn:
        return "attention weights are kept (--print-alignment or --fastgen-attention)"
    if constraints:
        return "lexical constraints"
    if generator.beam_size == 1 and cfg.aggressive != "off":
        return "aggressive decoding serves greedy search"
    blocker = generator.repeat_ngram_blocker
    if blocker is not None and not hasattr(blocker, "ban_ragged"):
        return "fairseq's own n-gram blocker (--fastgen-ngram-blocker stock)"
    if generator.model.models[0].training:
        return "models in training mode (--retain-dropout)"
    if task is not None and type(task).inference_step is not FairseqTask.inference_step:
        return f"task {type(task).__name__} has its own inference_step"
    if cfg.continuous == "auto" and not next(generator.model.parameters()).is_cuda and \
            any(d.native_for_slots() is None for d in generator._decoders()):
        # measured: docs/continuous-batching.md (the Python slot step is slower on CPU)
        return ("auto on CPU without the C++ slot step (it needs the native step, "
                "ancestor-indexed caches and fp32; --fastgen-continuous on forces it)")
    return None


class Feed:
    """The engine's input: ``take(wait)`` gives the next ``(sample, prefix_tokens)``,
    None when there is none yet (only with ``wait`` False: the engine then steps the
    sentences in flight and asks again), and raises StopIteration at the end.  The engine
    waits only when nothing is in flight."""

    def __init__(self, batches: Iterable[Tuple[Dict[str, Any], Optional[Tensor]]]):
        self._it = iter(batches)

    def take(self, wait: bool) -> Optional[Tuple[Dict[str, Any], Optional[Tensor]]]:
        return next(self._it)


@dataclass
class _Batch:
    """One input batch in flight: its sample and its sentences' results."""
    sample: Dict[str, Any]
    hypos: List[Optional[list]]
    remaining: int
    prefix: Optional[Tensor] = None  # (bsz, P) int64
    cross: list = field(default_factory=list)  # per model: per layer projected keys/values
    max_len: int = 0
    src_len: Optional[Tensor] = None  # (bsz,)


@dataclass
class _Pending:
    batch: _Batch
    index: int  # sentence within its batch


class ContinuousBeamSearch:
    """Beam search over a stream of batches with refilled slots (see the module doc).

    generator: a :class:`~fairseq_fastgen.search.fast_sequence_generator.FastSequenceGenerator`
    whose fast path serves these batches; ``capacity``: sentences in flight at most (0:
    the largest batch seen so far, at most ``--fastgen-continuous-rows`` rows);
    ``regular(sample, prefix_tokens)``: the batch-at-a-time decoding of a batch the engine does not serve.  With ``auto`` on
    CPU, while no batch has had more than one sentence, batches go to ``regular``
    (nothing to refill; measured 4% faster there, docs/continuous-batching.md).
    """

    def __init__(self, generator, capacity: int = 0,
                 regular: Optional[Callable[[Dict[str, Any], Optional[Tensor]], list]] = None):
        self.gen = generator
        self.capacity = capacity
        self.regular = regular
        self.beam = generator.beam_size
        rows = generator.fastgen.continuous_rows or _auto_rows(generator)
        self.max_slots = max(1, rows // self.beam) if rows else None
        self.rules = StepRules.of(generator)
        self.singles_regular = regular is not None and generator.fastgen.continuous == "auto" \
            and not next(generator.model.parameters()).is_cuda
        # the generator's own layer stacks: one copy of the weights
        self.decoders = [SlotDecoder(d.stack, self.beam, native=d.native_for_slots())
                         for d in generator._decoders()]

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
        self.order: Deque[_Batch] = deque()  # batches not yet handed out, input order
        self.pending: Deque[_Pending] = deque()
        self.capacity = eng.capacity
        self.beams: Optional[SlotBeams] = None
        # per slot (host): its sentence, step, length limit
        self.slot_of: List[Optional[_Pending]] = []  # None: free
        self._prefix: Optional[Tensor] = None  # (slots, P) prefix tokens of each slot
        self.steps: List[int] = []
        self.limits: List[int] = []
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
        assert not self.order, "continuous batching: a batch was left unfinished"

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
            sample, prefix = got
            bsz = sample["net_input"]["src_tokens"].size(0)
            if self.eng.capacity == 0:  # the largest batch seen (fairseq's batches <= --batch-size)
                self.capacity = max(self.capacity, min(bsz, self.eng.max_slots or bsz))
            b = _Batch(sample, [None] * bsz, bsz, prefix)
            self.order.append(b)
            if bsz == 0:
                continue
            single = bsz == 1 and self.capacity <= 1 and self.eng.singles_regular
            if single or prefix is not None and bool(prefix.eq(self.eng.rules.eos).any()):
                b.hypos = self.eng.regular(sample, prefix)
                b.remaining = 0
                return False  # out before the next batch is read
            self._encode(b)
            self.pending.extend(_Pending(b, i) for i in range(bsz))
            return True

    def _encode(self, b: _Batch) -> None:
        net_input = b.sample["net_input"]
        rules = self.eng.rules
        b.src_len = rules.source_lengths(net_input)
        b.max_len = rules.max_len(net_input["src_tokens"], b.src_len)
        encoder_outs = self.eng.gen.forward_encoder(net_input)
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

    def _admit(self, take: List[_Pending], slots: List[int]) -> None:
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
        rows = len(self.slot_of) * eng.beam
        for b, (idx, group) in _by_batch(take, slots):
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
        order = beams.step(lprobs, steps, steps.eq(0), src_len)
        at_limit = steps.ge(limits)
        stuck = at_limit & ~beams.had_eos
        if bool(stuck.any()):
            # stock finishes a sentence at its length limit only through an eos candidate;
            # one whose every candidate scores -inf (e.g. the n-gram ban left no word) fails
            # its batch with this assertion, and so does the stream
            i = int(stuck.nonzero()[0])
            raise AssertionError(f"{self.steps[i]} < {self.limits[i]}")
        done_t = beams.fin_count[:s].ge(k) | at_limit
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
        for slot, hyps in zip(done, self.beams.hypotheses(torch.tensor(done, device=dev))):
            p = self.slot_of[slot]
            p.batch.hypos[p.index] = hyps
            p.batch.remaining -= 1
            self.slot_of[slot] = None

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
        self.steps = [self.steps[i] for i in keep]
        self.limits = [self.limits[i] for i in keep]
        if self._prefix is not None:
            self._prefix = self._prefix.index_select(0, keep_t)

    def _ready(self):
        while self.order and self.order[0].remaining == 0:
            b = self.order.popleft()
            b.cross = []
            yield b.sample, b.hypos


def _by_batch(take: List[_Pending], slots: List[int]):
    """Group admitted sentences by batch: (batch, (indices, slots))."""
    groups: Dict[int, Tuple[_Batch, Tuple[List[int], List[int]]]] = {}
    for p, s in zip(take, slots):
        g = groups.setdefault(id(p.batch), (p.batch, ([], [])))
        g[1][0].append(p.index)
        g[1][1].append(s)
    return list(groups.values())
