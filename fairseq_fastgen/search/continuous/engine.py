"""Continuous batching: a stream of fairseq batches decoded with every slot kept busy.

fairseq-generate decodes one batch at a time, and a batch's last steps run over the few
sentences still going.  Here up to ``capacity`` sentences are in flight: when one
finishes, the next sentence of the data takes its slot at the next step.  A batch is
still encoded whole (its encoder output, hence each sentence's source states, are
stock's), and every sentence keeps what stock decodes it with in its own batch: the length
limit of that batch (``max_len_a * src_width + max_len_b`` of the batch's padded width, or
``--match-source-len``'s), its prefix tokens, min length, n-gram ban and unk penalty,
each at its own step.  Batches come out whole and in input order.

The generator decodes a batch on its own with the same engine (:meth:`ContinuousBeamSearch.decode`:
the batch's sentences fill the slots, refilled from the batch, or all at once where
stock's rows are needed).  Batches the engine does not serve (a prefix that contains eos:
stock then copies beams across the batch) are decoded by ``regular``, in order.

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
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..step_rules import StepRules
from . import margins, stream
from .inputs import Feed
from .serving import auto_rows, engine_onednn, unsupported  # noqa: F401 (re-exported)
from .stream import StreamRun

logger = logging.getLogger(__name__)


class ContinuousBeamSearch:
    """Beam search over a stream of batches with refilled slots (see the module doc).

    generator: a :class:`~fairseq_fastgen.search.fast_sequence_generator.FastSequenceGenerator`
    whose fast path serves these batches; ``capacity``: sentences in flight at most (0:
    the largest batch seen so far, at most ``--fastgen-tune continuous_rows`` rows);
    ``regular(sample, prefix_tokens)``: the decoding of a batch the engine does not serve
    (a prefix that contains eos).
    """

    def __init__(self, generator, capacity: int = 0,
                 regular: Optional[Callable[[Dict[str, Any], Optional[Tensor]], list]] = None,
                 onednn: Optional[bool] = None, select: Optional[Callable] = None,
                 stock_topk: bool = False, need_attn: bool = False):
        """onednn: the decoders' GEMM kernel (None: as ``--fastgen-tune gemm`` resolves it).
        On oneDNN with ``--fastgen-tune margin_guard`` > 0, a sentence whose decoding compared
        candidates closer than the margin is decoded again on MKL (:mod:`.margins`).
        select, stock_topk, need_attn: the beams' settings (:class:`.beams.SlotBeams`;
        need_attn: hypotheses keep their attention), for batches decoded on their own
        (:meth:`decode`)."""
        self.gen = generator
        self.capacity = capacity
        self.regular = regular
        self.select = select
        self.stock_topk = stock_topk
        self.need_attn = need_attn
        self.beam = generator.beam_size
        self.onednn = engine_onednn(generator) if onednn is None else onednn
        # the margin guard's multiple of the score moves measured on the first batch, and
        # its margin (None: not measured yet; 0: no guard)
        self.multiple = generator.fastgen.margin_guard if self.onednn else 0.0
        self.margin: Optional[float] = None if self.multiple > 0 else 0.0
        rows = generator.fastgen.continuous_rows or auto_rows(generator, self.onednn)
        self.max_slots = max(1, rows // self.beam) if rows else None
        self.rules = StepRules.of(generator)
        # the generator's own layer stacks, on this engine's kernel: one copy of the weights
        self.decoders = [d.on_stack(d.stack.with_gemm(self.onednn)) for d in generator.decoders()]
        self._reference: Optional["ContinuousBeamSearch"] = None
        if self.multiple > 0:
            logger.info("fairseq-fastgen: continuous batching on oneDNN GEMMs; a sentence "
                        "whose beam compared candidates closer than %g x the score moves "
                        "measured on the first batch is decoded again on MKL "
                        "(--fastgen-tune margin_guard)", self.multiple)

    @classmethod
    def for_task(cls, task, generator, constraints: bool = False
                 ) -> Tuple[Optional["ContinuousBeamSearch"], Optional[str]]:
        """(the engine over ``generator``'s batches of ``task``, None), or (None, why it
        does not serve them); batches it passes on go to ``task.inference_step``."""
        reason = unsupported(generator, task, constraints=constraints)
        if reason is not None:
            return None, reason

        def regular(sample, prefix_tokens):
            return task.inference_step(generator, generator.model.models, sample,
                                       prefix_tokens=prefix_tokens)

        return cls(generator, regular=regular), None

    def reference(self) -> "ContinuousBeamSearch":
        """The engine on MKL, stock's kernel (the margin guard's second decoding)."""
        if self._reference is None:
            self._reference = ContinuousBeamSearch(self.gen, onednn=False)
            self._reference.prepare()
        return self._reference

    def prepare(self) -> None:
        for d in self.decoders:
            d.prepare()

    def goes_regular(self, prefix: Optional[Tensor]) -> bool:
        """Whether a batch goes to ``regular``: a prefix that contains eos (stock then
        copies a sentence's first beam over the others)."""
        return prefix is not None and bool(prefix.eq(self.rules.eos).any())

    def decode(self, sample: Dict[str, Any], prefix: Optional[Tensor], bos: Optional[int] = None,
               whole: bool = False) -> list:
        """One batch, decoded on its own: ``SequenceGenerator._generate``'s result.
        bos: the hypotheses' first token (None: eos); whole: every sentence takes a slot
        at once and none is refilled (every slot at one step: stock's rows, which
        sampling's draws, fairseq's own n-gram blocker and attention need), else at most
        the engine's capacity in flight."""
        bsz = sample["net_input"]["src_tokens"].size(0)
        self.rules = StepRules.of(self.gen)  # read per batch, as stock's loop reads them
        capacity = bsz if whole else min(bsz, self.max_slots or bsz)
        run = StreamRun(self, Feed([(sample, prefix)]), self.margin or 0.0, bos=bos,
                        capacity=max(capacity, 1))
        with torch.no_grad():
            (_, hypos), = list(run.loop())
        return hypos

    # ---- the stream ---------------------------------------------------------------------

    def run(self, batches) -> Iterator[Tuple[Dict[str, Any], list]]:
        """(sample, prefix_tokens) in (an iterable, or a :class:`Feed`), (sample, hypos)
        out in the same order; hypos as ``SequenceGenerator.generate`` returns them."""
        feed = batches if hasattr(batches, "take") else Feed(batches)
        counts = [0, 0]  # sentences, of which decoded again on MKL (margin guard)
        with torch.no_grad():
            while self.margin is None:
                try:
                    item = feed.take(wait=True)
                except StopIteration:
                    return
                yield self._calibrate(item, counts)
            run = StreamRun(self, feed, self.margin)
            yield from run.loop()
        if self.multiple > 0 and counts[0] + run.sentences:
            logger.info("fairseq-fastgen: margin guard: %d of %d sentences decoded again on "
                        "MKL (%d of them measuring the margin: the first batch and every %d-th)",
                        counts[1] + run.redone, counts[0] + run.sentences,
                        counts[1] + run.rechecked, stream.RECHECK_EVERY)

    def _calibrate(self, item, counts: List[int]):
        """The first batch decoded on both kernels from one (MKL) encoder output: its
        output is MKL's, and the largest score move between the two sets the margin
        (:func:`.margins.calibrated`).  A batch that gave no evidence (decoded
        by ``regular``, or empty) leaves the margin to the next one."""
        sample, prefix = item[0], item[1]
        bsz = sample["net_input"]["src_tokens"].size(0)
        if bsz == 0 or self.goes_regular(prefix):
            return sample, self.regular(sample, prefix) if bsz else []
        again = (sample, prefix, list(range(bsz)), self.gen.forward_encoder(sample["net_input"]))
        (_, reference), = list(self.reference().run([again]))
        run = StreamRun(self, Feed([again]), 0.0)
        (_, other), = list(run.loop())
        if run.sentences:
            self.margin = margins.calibrated(reference, other, self.multiple)
            counts[0] += bsz
            counts[1] += bsz
        return sample, reference
