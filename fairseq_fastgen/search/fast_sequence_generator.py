"""FastSequenceGenerator: a drop-in for fairseq's ``SequenceGenerator``.

Same constructor arguments and the same ``generate()`` result; beam search (and greedy
search) over fairseq transformer models runs on the one engine of the fast paths, the
sentence slots of :mod:`~fairseq_fastgen.search.continuous`: a batch's sentences fill its
slots (refilled from the batch as sentences finish), each step is
:class:`~fairseq_fastgen.models.slot_decoder.SlotDecoder`'s and the beam bookkeeping
:class:`~fairseq_fastgen.search.continuous.beams.SlotBeams`'; stock's per-step masks come
from :mod:`~fairseq_fastgen.search.step_rules`.  Bitwise mode runs stock's loop and
modules (the reference every fast path is checked against).  Greedy search (beam 1) with
``--fastgen-aggressive`` is served by the strategy the generator owns,
:class:`~fairseq_fastgen.search.aggressive.AggressiveDecoding`, when it applies to the
batch.  ``--sampling`` runs the same engine with fairseq's own ``Sampling.step`` over
stock's rows (every sentence in a slot from the start; a batch shrinks as stock's does),
so a seed draws stock's numbers: bitwise mode gives stock's bytes, lossless mode stock's
tokens unless a draw falls within a rounding of a boundary.  Anything the fast path does
not cover (diverse/constrained search, LM fusion, non-transformer decoders,
``--retain-dropout``, a prefix that contains eos, ...) runs fairseq's loop after one log
line.
"""
import logging
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fairseq import search
from fairseq.sequence_generator import SequenceGenerator

from ..config import FastGenConfig
from ..run_config import current
from ..models import gemm_kernel, precision
from ..models.layers import DecoderStack
from ..models.slot_decoder import SlotDecoder
from ..models.support import unsupported_reason
from .continuous.engine import ContinuousBeamSearch
from .aggressive import AggressiveDecoding, Tunables, unsupported as aggressive_unsupported
from .ngram_blocker import build_blocker
from .sampling import TOLERANCE, audited_step
from .step_rules import StepRules

logger = logging.getLogger(__name__)
_logged = set()
# bitwise mode runs stock's loop and modules: the reference, not a fallback
BITWISE = "bitwise mode: stock's loop and modules"


def _log_once(msg: str) -> None:
    if msg not in _logged:
        _logged.add(msg)
        logger.info(msg)


class FastSequenceGenerator(SequenceGenerator):
    """fairseq ``SequenceGenerator`` with the fastgen fast path.

    Extra keyword arguments: ``fastgen`` (a :class:`FastGenConfig`, default: the config of
    the run in progress), ``need_attn`` (keep per-hypothesis attention, default: only if the config
    says so) and ``aggressive_tunables`` (:class:`~fairseq_fastgen.search.aggressive.Tunables`
    of aggressive decoding, default: the defaults).
    """

    def __init__(self, models, tgt_dict, *args, fastgen: Optional[FastGenConfig] = None,
                 need_attn: bool = False, aggressive_tunables: Optional[Tunables] = None,
                 **kwargs):
        no_repeat = kwargs.get("no_repeat_ngram_size", 0)
        super().__init__(models, tgt_dict, *args, **kwargs)
        self.fastgen = fastgen if fastgen is not None else current()
        self.need_attn = need_attn or self.fastgen.attention
        if no_repeat > 0 and self.fastgen.enabled:
            self.repeat_ngram_blocker = build_blocker(no_repeat, self.fastgen.ngram_blocker)
        self._fast_decoders: Optional[List[SlotDecoder]] = None
        self._aggressive_tunables = aggressive_tunables
        self._aggressive: Optional[AggressiveDecoding] = None  # built at its first batch
        self._engine: Optional[ContinuousBeamSearch] = None  # built at its first batch
        self._near = 0  # sampling: the batch's draws near a boundary (a tensor once counted)
        # fairseq's own Sampling.step draws, over stock's rows: the same random stream
        self.sampling = type(self.search) is search.Sampling
        self.sampling_boundary_draws = 0  # lossless sampling: see search/sampling.py
        self.fallback_reason = self._static_fallback_reason()

    # ---- choosing the path --------------------------------------------------------

    def _static_fallback_reason(self) -> Optional[str]:
        cfg = self.fastgen
        if not cfg.enabled:
            return "fastgen disabled"
        if not cfg.fast_decoder:
            return "fast decoder switched off (--fastgen-disable fast_decoder)"
        if self.sampling:
            if not cfg.sampling:
                return "sampling on the fast path switched off (--fastgen-disable sampling)"
        elif type(self.search) is not search.BeamSearch:
            return f"search strategy {type(self.search).__name__}"
        if self.lm_model is not None:
            return "LM fusion (--lm-path)"
        if not self.model.has_incremental_states():
            return "non-incremental decoder"
        for m in self.model.models:
            reason = unsupported_reason(m)
            if reason is not None:
                return reason
        return BITWISE if cfg.bitwise else None

    def _generate(self, sample: Dict[str, Dict[str, Tensor]], prefix_tokens=None,
                  constraints=None, bos_token=None):
        dev = next(self.model.parameters()).device
        with precision.region(self.fastgen.enabled and self.fastgen.bf16, dev), \
                precision.float32_output_projections(self.model.models, dev.type):  # as the step's
            return self._generate_any(sample, prefix_tokens, constraints, bos_token)

    def bf16(self) -> bool:
        """Whether the steps run their GEMMs in bfloat16 (models/precision.py)."""
        dev = next(self.model.parameters()).device
        return self.fastgen.enabled and self.fastgen.bf16 and precision.supported(dev)

    def _generate_any(self, sample, prefix_tokens, constraints, bos_token):
        reason = self.fallback_reason
        if reason is None and (constraints is not None or "src_tokens" not in sample["net_input"]):
            reason = "lexical constraints" if constraints is not None else "non-text source"
        if reason is not None:
            if self.fastgen.log_fallbacks and reason != BITWISE:  # the mode, not a fallback
                _log_once(f"fairseq-fastgen: stock generator loop ({reason})")
            elif self.fastgen.log_fallbacks and self.beam_size == 1 and self.fastgen.aggressive != "off":
                _log_once("fairseq-fastgen: aggressive decoding off (bitwise mode: a block "
                          "pass is not bit-identical); stock's greedy loop")
            return super()._generate(sample, prefix_tokens, constraints, bos_token)
        # no_grad, not inference_mode: callers (fairseq_cli.generate) update the returned
        # score tensors in place, which inference tensors forbid.
        with torch.no_grad():
            rules = StepRules.of(self)
            if self.beam_size == 1 and self.fastgen.aggressive != "off":
                strategy = self._aggressive_for(sample, rules)
                if strategy is not None:
                    return strategy.generate(
                        sample, prefix_tokens, bos_token, rules, encode=self.forward_encoder,
                        regular=lambda: self._fast_generate(sample, prefix_tokens, bos_token, rules))
            return self._fast_generate(sample, prefix_tokens, bos_token, rules)

    def _aggressive_for(self, sample, rules: StepRules) -> Optional[AggressiveDecoding]:
        """The aggressive decoding strategy if it serves this batch, else None (after one
        log line saying why)."""
        reason = "sampling" if self.sampling else aggressive_unsupported(
            self.fastgen, self.model.models, self.need_attn, rules, sample, self.tgt_dict)
        if reason is not None:
            if self.fastgen.log_fallbacks and reason != BITWISE:  # the mode, not a fallback
                _log_once(f"fairseq-fastgen: aggressive decoding off ({reason}); regular greedy")
            return None
        if self._aggressive is None:
            self._aggressive = AggressiveDecoding(self.model.models[0], self.tgt_dict, self.fastgen,
                                                  self._aggressive_tunables)
        return self._aggressive

    @property
    def aggressive_stats(self) -> Optional[dict]:
        """Cumulative acceptance statistics of aggressive decoding (None if unused)."""
        return self._aggressive.stats.as_dict() if self._aggressive is not None else None

    def prepare(self) -> None:
        """Build the fast decoders and their weight copies now (the generate pipeline calls
        this before forking decoding workers, which then share them)."""
        if self.fallback_reason is None:
            for d in self.decoders():
                d.prepare()

    def forward_encoder(self, net_input: Dict[str, Tensor], onednn: bool = False):
        """fairseq's ensemble encoder output; its linears on oneDNN where ``onednn`` says
        (the unguarded engine's choice; :mod:`~fairseq_fastgen.models.gemm_kernel`)."""
        with gemm_kernel.linears(onednn):
            return self.model.forward_encoder(net_input)

    def decoders(self) -> List[SlotDecoder]:
        """Each model's decoder step, on MKL: the engines' decoders are built on their
        stacks (:meth:`SlotDecoder.on_stack`: one copy of the weights; oneDNN is the
        stream's alone, under its margin guard: search/continuous/)."""
        if self._fast_decoders is None:
            cfg = self.fastgen
            # the C++ step, oneDNN and MKL packs: fp32 only (tests/test_half_precision.py)
            fp32 = not self.bf16() and next(self.model.parameters()).dtype == torch.float32
            self._fast_decoders = [
                SlotDecoder(DecoderStack(m, vocab_pad=cfg.vocab_pad,
                                         packed_gemm_mb=cfg.packed_gemm_mb if fp32 else 0),
                            self.beam_size, build_native=cfg.native_step and fp32,
                            fused_cross=cfg.fused_cross_attention)
                for m in self.model.models
            ]
        return self._fast_decoders

    # ---- the fast loop ----------------------------------------------------------------

    def _fast_generate(self, sample, prefix_tokens: Optional[Tensor], bos_token: Optional[int],
                       rules: StepRules):
        """Beam search, greedy search or sampling on the slot engine (search/continuous/),
        the batch decoded on its own: its sentences fill the slots (refilled from the
        batch as sentences finish where the engine bounds its rows; every sentence at
        once, none refilled, where stock's rows are needed: sampling's draws, fairseq's
        own n-gram blocker, attention weights, half precision, whose GEMMs round by the
        rows they are given (refilled, the bundled es->en model at batch 64 in ``--fp16``
        gave 998 of stock's 1,000 best hypotheses, all at once 1,000), ``--fastgen-continuous
        off``)."""
        reason = self._batch_fallback_reason(prefix_tokens)
        if reason is not None:
            return self._stock_generate(sample, prefix_tokens, bos_token, reason)
        cfg = self.fastgen
        half = self.bf16() or next(self.model.parameters()).dtype != torch.float32
        whole = self.sampling or self.need_attn or half or cfg.continuous == "off" or (
            rules.blocker is not None and not hasattr(rules.blocker, "ban_ragged"))
        self._near = 0
        hypos = self._batch_engine().decode(sample, prefix_tokens, bos_token, whole=whole)
        if self.sampling:
            self._count_boundary_draws(int(self._near), sample)
        return hypos

    def _batch_fallback_reason(self, prefix_tokens: Optional[Tensor]) -> Optional[str]:
        """Why this batch runs stock's loop (None: the engine decodes it)."""
        if self.model.models[0].training:
            return "models in training mode (--retain-dropout)"
        if prefix_tokens is not None and bool(prefix_tokens.eq(self.eos).any()):
            return "a prefix that contains eos"
        return None

    def _stock_generate(self, sample, prefix_tokens, bos_token, reason: str):
        if self.fastgen.log_fallbacks:
            _log_once(f"fairseq-fastgen: stock generator loop ({reason})")
        return super()._generate(sample, prefix_tokens, None, bos_token)

    def _batch_engine(self) -> ContinuousBeamSearch:
        """The engine that decodes a batch on its own, on MKL (oneDNN is the stream's
        alone, under its margin guard), built at the first batch."""
        if self._engine is None:
            half = next(self.model.parameters()).dtype != torch.float32
            self._engine = ContinuousBeamSearch(
                self, onednn=False, select=self._sampling_select if self.sampling else None,
                stock_topk=half, need_attn=self.need_attn,
                regular=lambda sample, prefix: self._stock_generate(
                    sample, prefix, None, "a prefix that contains eos"))
        return self._engine

    def _sampling_select(self, step: int, lprobs: Tensor, scores: Tensor):
        """fairseq's ``Sampling.step`` over stock's rows, its draws near a boundary
        counted (search/sampling.py).  lprobs: (bsz, beam, V); scores: (bsz, beam, step)."""
        out = audited_step(self.search, step, lprobs, scores)
        self._near = out[3] + self._near
        return out[:3]

    def _count_boundary_draws(self, near: int, sample) -> None:
        """Count a batch's draws that sat within a rounding of a boundary; logged when the
        count reaches 1, 2, 4, 8, ... (a few lines however long the run)."""
        before = self.sampling_boundary_draws
        self.sampling_boundary_draws += near
        if near and self.sampling_boundary_draws.bit_length() > before.bit_length():
            first = sample["id"][0] if isinstance(sample.get("id"), Tensor) else 0
            logger.warning(
                "fairseq-fastgen: sampling: %d draw(s) so far within %g of a boundary (the "
                "latest in the batch of sentence %d): lossless mode may draw otherwise than "
                "stock there (and, with one random stream, after it); --fastgen-bitwise "
                "draws exactly as stock", self.sampling_boundary_draws, TOLERANCE, int(first))
