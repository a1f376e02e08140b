"""FastSequenceGenerator: a drop-in for fairseq's ``SequenceGenerator``.

Same constructor arguments and the same ``generate()`` result; beam search over fairseq
transformer models runs on :class:`~fairseq_fastgen.models.slot_decoder.SlotDecoder`, the
one decoder step of the fast paths (a batch's sentences fill its slots once: beam-shared
encoder states, caches kept in place, attention weights only when needed), and the step
bookkeeping skips work nobody reads; stock's per-step masks come from
:mod:`~fairseq_fastgen.search.step_rules`.  Bitwise mode runs stock's loop and modules
(the reference every fast path is checked against).  Greedy search (beam 1) with
``--fastgen-aggressive`` is served by the strategy the generator owns,
:class:`~fairseq_fastgen.search.aggressive.AggressiveDecoding`, when it applies to the
batch.  ``--sampling`` runs the same loop with fairseq's own ``Sampling.step`` over
stock's rows (a batch shrinks as stock's does), so a seed draws stock's numbers: bitwise
mode gives stock's bytes, lossless mode stock's tokens unless a draw falls within a
rounding of a boundary.  Anything the fast path does not cover (diverse/constrained
search, LM fusion, non-transformer decoders, ...) runs fairseq's loop after one log line.
"""
import logging
import math
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
from .aggressive import AggressiveDecoding, Tunables, unsupported as aggressive_unsupported
from .candidates import beam_search_step
from .ngram_blocker import build_blocker
from .sampling import TOLERANCE, audited_step
from .step_rules import StepAt, StepRules

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
        """Each model's decoder step for the batch-at-a-time loop, on MKL (oneDNN is
        continuous batching's alone, under its margin guard: search/continuous/)."""
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
        """Beam search; each statement mirrors fairseq's ``_generate`` so that choices,
        ties and finalization order are the same."""
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        src_lengths = rules.source_lengths(net_input)
        bsz = src_tokens.size(0)
        beam_size = self.beam_size
        self.search.init_constraints(None, beam_size)
        max_len = rules.max_len(src_tokens, src_lengths)

        decoders = self.decoders()
        encoder_outs = self.forward_encoder(net_input)
        for i, d in enumerate(decoders):
            d.start(encoder_outs[i] if encoder_outs is not None else None, bsz, max_len + 1)
        del encoder_outs

        n = bsz * beam_size
        scores = torch.zeros(n, max_len + 1, device=src_tokens.device, dtype=torch.float)
        tokens = torch.full((n, max_len + 2), self.pad, device=src_tokens.device, dtype=torch.long)
        tokens[:, 0] = self.eos if bos_token is None else bos_token
        attn: Optional[Tensor] = None
        need_attn = self.need_attn

        cands_to_ignore = torch.zeros(bsz, beam_size, device=src_tokens.device, dtype=torch.bool)
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        finished = [False for _ in range(bsz)]
        num_remaining_sent = bsz
        cand_size = 2 * beam_size
        bbsz_offsets = (torch.arange(0, bsz) * beam_size).unsqueeze(1).type_as(tokens).to(src_tokens.device)
        cand_offsets = torch.arange(0, cand_size).type_as(tokens).to(src_tokens.device)

        # the same candidates as fairseq's BeamSearch.step without a top-k over every
        # (hypothesis, word) pair, or stock's draws with their boundary draws counted
        near = [0]  # boundary draws of the batch (a device tensor once counted)
        # half-precision logits tie often: stock's top-k, whose order among ties is stock's
        if next(self.model.parameters()).dtype != torch.float32:
            select = self.search.step
        elif self.sampling:
            def select(step, lp, sc, *_):
                out = audited_step(self.search, step, lp, sc)
                near[0] = out[3] + near[0]
                return out[:3]
        else:
            def select(step, lp, sc, *_):
                return beam_search_step(step, lp, sc, beam_size, self.fastgen.native_candidates)

        reorder_state: Optional[Tensor] = None
        batch_idxs: Optional[Tensor] = None
        if "id" in sample and isinstance(sample["id"], Tensor):
            original_batch_idxs = sample["id"]
        else:
            original_batch_idxs = torch.arange(0, bsz).type_as(tokens)

        for step in range(max_len + 1):
            if reorder_state is not None:
                if batch_idxs is not None:
                    corr = batch_idxs - torch.arange(batch_idxs.numel()).type_as(batch_idxs)
                    reorder_state.view(-1, beam_size).add_(corr.unsqueeze(-1) * beam_size)
                    original_batch_idxs = original_batch_idxs[batch_idxs]
                for d in decoders:
                    d.reorder(reorder_state, batch_idxs, step)

            lprobs, avg_attn_scores, finite = self._forward_decoders(
                decoders, tokens[:, step], step, need_attn)

            # stock's masks; its NaN scan skipped when every model's logits were proven
            # finite (then log_softmax has no NaN; cheap bound check on CPU, see DecoderStack)
            at = StepAt.uniform(step)
            rules.mask_step(lprobs, at, max_len, finite, prefix_tokens, beam=beam_size)
            if prefix_tokens is not None and step < prefix_tokens.size(1) and step < max_len:
                lprobs, tokens, scores = self._replicate_eos_prefix(
                    step, lprobs, scores, tokens, prefix_tokens, beam_size)

            if avg_attn_scores is not None:
                if attn is None:
                    attn = torch.empty(n, avg_attn_scores.size(1), max_len + 2).to(scores)
                attn[:, :, step + 1].copy_(avg_attn_scores)

            scores = scores.type_as(lprobs)
            lprobs = rules.ban_repeats(lprobs, at, tokens, bsz, beam_size)

            cand_scores, cand_indices, cand_beams = select(
                step,
                lprobs.view(bsz, -1, self.vocab_size),
                scores.view(bsz, beam_size, -1)[:, :, :step],
                tokens[:, : step + 1],
                original_batch_idxs,
            )
            cand_bbsz_idx = cand_beams.add(bbsz_offsets)
            eos_mask = cand_indices.eq(self.eos) & cand_scores.ne(-math.inf)
            eos_mask[:, :beam_size][cands_to_ignore] = False
            eos_bbsz_idx = torch.masked_select(cand_bbsz_idx[:, :beam_size], mask=eos_mask[:, :beam_size])

            finalized_sents: List[int] = []
            if eos_bbsz_idx.numel() > 0:
                eos_scores = torch.masked_select(cand_scores[:, :beam_size], mask=eos_mask[:, :beam_size])
                finalized_sents = self.finalize_hypos(
                    step, eos_bbsz_idx, eos_scores, tokens, scores, finalized, finished,
                    beam_size, attn, src_lengths, max_len)
                num_remaining_sent -= len(finalized_sents)

            assert num_remaining_sent >= 0
            if num_remaining_sent == 0:
                break
            if self.search.stop_on_max_len and step >= max_len:
                break
            assert step < max_len, f"{step} < {max_len}"

            if len(finalized_sents) > 0:
                new_bsz = bsz - len(finalized_sents)
                batch_mask = torch.ones(bsz, dtype=torch.bool, device=cand_indices.device)
                batch_mask[finalized_sents] = False
                batch_idxs = torch.arange(bsz, device=cand_indices.device).masked_select(batch_mask)
                self.search.prune_sentences(batch_idxs)
                eos_mask = eos_mask[batch_idxs]
                cand_beams = cand_beams[batch_idxs]
                bbsz_offsets.resize_(new_bsz, 1)
                cand_bbsz_idx = cand_beams.add(bbsz_offsets)
                cand_scores = cand_scores[batch_idxs]
                cand_indices = cand_indices[batch_idxs]
                if prefix_tokens is not None:
                    prefix_tokens = prefix_tokens[batch_idxs]
                src_lengths = src_lengths[batch_idxs]
                cands_to_ignore = cands_to_ignore[batch_idxs]
                scores = scores.view(bsz, -1)[batch_idxs].view(new_bsz * beam_size, -1)
                tokens = tokens.view(bsz, -1)[batch_idxs].view(new_bsz * beam_size, -1)
                if attn is not None:
                    attn = attn.view(bsz, -1)[batch_idxs].view(new_bsz * beam_size, attn.size(1), -1)
                bsz = new_bsz
                n = bsz * beam_size
            else:
                batch_idxs = None

            eos_mask[:, :beam_size] = ~((~cands_to_ignore) & (~eos_mask[:, :beam_size]))
            active_mask = torch.add(eos_mask.type_as(cand_offsets) * cand_size,
                                    cand_offsets[: eos_mask.size(1)])
            new_cands_to_ignore, active_hypos = torch.topk(active_mask, k=beam_size, dim=1, largest=False)
            cands_to_ignore = new_cands_to_ignore.ge(cand_size)[:, :beam_size]
            assert (~cands_to_ignore).any(dim=1).all()

            active_bbsz_idx = torch.gather(cand_bbsz_idx, dim=1, index=active_hypos).view(-1)
            tokens[:, : step + 1] = torch.index_select(tokens[:, : step + 1], dim=0, index=active_bbsz_idx)
            tokens.view(bsz, beam_size, -1)[:, :, step + 1] = torch.gather(cand_indices, dim=1, index=active_hypos)
            if step > 0:
                scores[:, :step] = torch.index_select(scores[:, :step], dim=0, index=active_bbsz_idx)
            scores.view(bsz, beam_size, -1)[:, :, step] = torch.gather(cand_scores, dim=1, index=active_hypos)
            self.search.update_constraints(active_hypos)
            if attn is not None:
                attn[:, :, : step + 2] = torch.index_select(attn[:, :, : step + 2], dim=0, index=active_bbsz_idx)
            reorder_state = active_bbsz_idx

        if self.sampling:
            self._count_boundary_draws(int(near[0]), sample)
        for sent in range(len(finalized)):
            sent_scores = torch.tensor([float(elem["score"].item()) for elem in finalized[sent]])
            _, order = torch.sort(sent_scores, descending=True)
            finalized[sent] = [finalized[sent][ssi] for ssi in order]
        return finalized

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

    def _replicate_eos_prefix(self, step: int, lprobs: Tensor, scores: Tensor, tokens: Tensor,
                              prefix_tokens: Tensor, beam_size: int):
        """The rest of stock's ``_prefix_tokens`` once the masks are applied: a prefix that
        includes eos makes every beam of its sentence the first one (tokens, scores and
        lprobs).  lprobs: (n, V); scores: (n, max_len+1); tokens: (n, max_len+2)."""
        prefix_toks = prefix_tokens[:, step].unsqueeze(-1).repeat(1, beam_size).view(-1)
        eos_mask = prefix_toks.eq(self.eos)
        if eos_mask.any():
            # validate that the first beam matches the prefix
            first_beam = tokens[eos_mask].view(-1, beam_size, tokens.size(-1))[:, 0, 1: step + 1]
            eos_mask_batch_dim = eos_mask.view(-1, beam_size)[:, 0]
            target_prefix = prefix_tokens[eos_mask_batch_dim][:, :step]
            assert (first_beam == target_prefix).all()
            tokens = self.replicate_first_beam(tokens, eos_mask_batch_dim, beam_size)
            scores = self.replicate_first_beam(scores, eos_mask_batch_dim, beam_size)
            lprobs = self.replicate_first_beam(lprobs, eos_mask_batch_dim, beam_size)
        return lprobs, tokens, scores

    def _forward_decoders(self, decoders: List[SlotDecoder], last: Tensor, step: int,
                          need_attn: bool):
        """Ensemble step, combined exactly as fairseq's ``EnsembleModel.forward_decoder``.

        last: (n,) int64 each hypothesis's latest token, at ``step``. Returns lprobs (n, V)
        float32, attention (n, S) or None, and whether every model's logits were proven
        finite.
        """
        log_probs = []
        avg_attn: Optional[Tensor] = None
        finite = True
        for d in decoders:
            probs, attn, d_finite = d.step(last, None, step, self.temperature, need_attn)
            finite = finite and d_finite
            if len(decoders) == 1:
                return probs, attn, finite
            log_probs.append(probs)
            if attn is not None:
                avg_attn = attn if avg_attn is None else avg_attn.add_(attn)
        avg_probs = torch.logsumexp(torch.stack(log_probs, dim=0), dim=0) - math.log(len(decoders))
        if avg_attn is not None:
            avg_attn.div_(len(decoders))
        return avg_probs, avg_attn, finite
