"""The aggressive decoding strategy: draft, verify a block per row, keep what greedy keeps."""
import logging
import time
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

from ...config import FastGenConfig
from ...models.support import unsupported_reason
from ...models.layers import DecoderStack
from ...models.slot_decoder import SlotDecoder
from ..drafts import DraftModelDrafts, SourceDrafts, SubstitutionMemory, load_draft_model
from ..ngram_blocker import NGramBlocker
from ..step_rules import StepAt, StepRules
from .block_cost import BlockCost
from .finalize import finalize_rows
from .rows import Rows
from .speed_chooser import PLAIN, SpeedChooser
from .stats import AcceptanceStats
from .tunables import Tunables

logger = logging.getLogger(__name__)

Hypotheses = List[List[Dict[str, Tensor]]]


def unsupported(cfg: FastGenConfig, models: list, need_attn: bool, rules: StepRules,
                sample: dict, tgt_dict) -> Optional[str]:
    """Why aggressive decoding cannot serve this generator/sample (None if it can)."""
    if len(models) != 1:
        return "ensemble"
    if need_attn:
        return "attention weights requested"
    if rules.suppress is not None:
        return "suppressed token indices"
    if rules.blocker is not None and not isinstance(rules.blocker, NGramBlocker):
        return "stock n-gram blocker"
    model = models[0]
    if getattr(model, "encoder", None) is None or "src_tokens" not in sample["net_input"]:
        return "no source to draft from"
    reason = unsupported_reason(model)
    if reason is not None:
        return reason
    src_dict = getattr(model.encoder, "dictionary", None)
    if cfg.aggressive == "auto" and not cfg.draft_model and (src_dict is None or src_dict != tgt_dict):
        return "auto: source and target dictionaries differ"
    return None


class AggressiveDecoding:
    """Draft-and-verify greedy search for one fairseq encoder-decoder model; the
    generator builds one (when :func:`unsupported` says it applies) and calls
    :meth:`generate`."""

    def __init__(self, model, tgt_dict, cfg: FastGenConfig, tunables: Optional[Tunables] = None):
        self.model = model
        self.tunables = tunables or Tunables()
        # one row per sentence (beam 1), blocks through the reference step (Python layers)
        self.vd = SlotDecoder(DecoderStack(model, vocab_pad=cfg.vocab_pad,
                                           packed_gemm_mb=cfg.packed_gemm_mb), 1)
        self.stats = AcceptanceStats()
        self.chooser = SpeedChooser()
        self.block_cost = BlockCost(self.tunables)
        self._seen_s = self._seen_f = 0.0
        self._batches = 0
        self.vocab_size = len(tgt_dict)
        self.substitutions = SubstitutionMemory(len(tgt_dict))
        self.draft_vd: Optional[SlotDecoder] = None
        if cfg.draft_model:
            draft_model = load_draft_model(cfg.draft_model, model, tgt_dict)
            reason = unsupported_reason(draft_model)
            if reason is not None:
                raise ValueError(f"draft model {cfg.draft_model}: {reason}")
            self.draft_vd = SlotDecoder(DecoderStack(draft_model), 1)
        src_dict = getattr(model.encoder, "dictionary", None)
        self.id_map = None
        if src_dict is not None and src_dict != tgt_dict:
            # source ids -> target ids by symbol (unknown symbols -> unk: drafts just fail)
            ids = [tgt_dict.index(src_dict[i]) for i in range(len(src_dict))]
            self.id_map = torch.tensor(ids, dtype=torch.long)

    def generate(self, sample: dict, prefix_tokens: Optional[Tensor], bos_token: Optional[int],
                 rules: StepRules, encode: Callable[[dict], list],
                 regular: Callable[[], Hypotheses]) -> Hypotheses:
        """Finalized hypotheses of the batch (as ``SequenceGenerator._generate``).

        encode: the generator's ``forward_encoder``; regular: decodes the batch with the
        regular greedy step (used when the speed chooser finds it faster)."""
        bsz = sample["net_input"]["src_tokens"].size(0)
        mode = self.chooser.choose(bsz)
        t0 = time.perf_counter()
        if mode == PLAIN:
            out = regular()
            self.stats.plain_batches += 1
        else:
            out = self._decode(sample, prefix_tokens, bos_token, rules, encode)
        self.chooser.record(mode, bsz, time.perf_counter() - t0,
                            sum(len(h[0]["tokens"]) for h in out if h))
        return out

    def _drafts(self, net_input: dict, bsz: int, max_len: int, max_draft: int, rules: StepRules):
        if self.draft_vd is not None:
            return DraftModelDrafts(self.draft_vd, net_input, bsz, max_len, max_draft, rules.eos,
                                    rules.pad, rules.min_len)
        src_tokens = net_input["src_tokens"]
        dev = src_tokens.device
        id_map = self.id_map.to(dev) if self.id_map is not None else None
        return SourceDrafts(src_tokens, rules.pad, id_map, self.substitutions.table(dev),
                            vocab_size=self.vocab_size)

    def _decode(self, sample, prefix_tokens: Optional[Tensor], bos_token: Optional[int],
                rules: StepRules, encode) -> Hypotheses:
        tn = self.tunables
        eos, pad = rules.eos, rules.pad
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        src_lengths = rules.source_lengths(net_input)
        bsz = src_tokens.size(0)
        dev = src_tokens.device
        max_len = rules.max_len(src_tokens, src_lengths)

        encoder_outs = encode(net_input)
        max_draft = max(0, min(tn.max_draft, max_len))
        W = max_draft + 1  # the widest block
        self.vd.start(encoder_outs[0], bsz, max_len + 1, room=W)
        del encoder_outs
        drafts = self._drafts(net_input, bsz, max_len, max_draft, rules)

        # W spare columns: a pass writes all its L positions; those past a row's emitted
        # tokens are overwritten before anything reads them (reads stop at the row's step)
        tokens = torch.full((bsz, max_len + 2 + W), pad, dtype=torch.long, device=dev)
        tokens[:, 0] = eos if bos_token is None else bos_token
        # per-row acceptance evidence (decayed counts of accepted / rejected draft positions)
        p0 = self._global_rate()
        prior_s = (1 - tn.decay) * tn.prior_weight * p0
        prior_f = (1 - tn.decay) * tn.prior_weight * (1 - p0)
        rows = Rows(
            tokens=tokens, last_tok=tokens[:, :1].clone(),
            cum_hist=torch.zeros(bsz, max_len + 1 + W, dtype=torch.float, device=dev),
            t=torch.zeros(bsz, dtype=torch.long, device=dev),
            cum=torch.zeros(bsz, dtype=torch.float, device=dev),
            acc_s=torch.full((bsz,), tn.prior_weight * p0, dtype=torch.float, device=dev),
            acc_f=torch.full((bsz,), tn.prior_weight * (1 - p0), dtype=torch.float, device=dev),
            orig=torch.arange(bsz, device=dev), src_lengths=src_lengths.clone(),
            prefix_tokens=prefix_tokens)
        t_lo = t_hi = 0  # bounds of t on the host (conservative after rows leave)
        full_want = torch.full((bsz,), max_draft, dtype=torch.long, device=dev)
        ks = torch.arange(max_draft + 1, device=dev)
        offs = torch.arange(W, device=dev)
        force_single = False
        finalized: Hypotheses = [[] for _ in range(bsz)]
        st = self.stats
        st.sentences += bsz
        # drafted, accepted, rejected-row counts: summed on the device, read once per batch
        tally = torch.zeros(3, dtype=torch.long, device=dev)

        while rows.orig.numel() > 0:
            n = rows.orig.numel()
            t = rows.t
            d = None
            L = 1
            if not force_single and max_draft > 0:
                p_acc = rows.acc_s / (rows.acc_s + rows.acc_f)
                want = full_want[:n]
                if self.draft_vd is not None:
                    # every draft token costs a draft-model pass: choose k first
                    k = self.block_cost.best_len(want, p_acc, ks, per_position=tn.cost_draft_step) - 1
                    want = want.clamp(max=min(k, max_len - t_lo))
                prop = drafts.propose(rows.tokens, t, want, max_draft)
                d = torch.minimum(prop.length, max_len - t)
                L = self.block_cost.best_len(d, p_acc, ks)  # <= 1 + max(d)
                d = d.clamp(max=L - 1)
            if L == 1:
                inp, flat, rr, steps = rows.last_tok, None, None, t
            else:
                # past the source's end: any token id (those positions are not read)
                inp = torch.cat([rows.last_tok, prop.draft[:, : L - 1]], dim=1).clamp_(min=0)
                if n == 1:  # d == L - 1: every position is read
                    flat = None
                    rr = torch.zeros(L, dtype=torch.long, device=dev)
                    steps = t + offs[:L]
                else:
                    valid = offs[:L].unsqueeze(0) <= d.unsqueeze(1)
                    flat = valid.view(-1).nonzero().squeeze(1)
                    rr = flat // L
                    steps = t[rr] + flat % L
            out = self.vd.block(inp, t, flat, bounds=(t_lo, t_hi), log_probs=True,
                                temperature=rules.temperature)
            lprobs = out.scores[:, : self.vd.vocab]
            at = StepAt(t_lo, t_hi + L - 1, steps, rr)
            rules.mask_step(lprobs, at, max_len, out.logits_finite, rows.prefix_tokens)
            if rules.ngram_ban_applies(at.hi):
                rules.ban_repeats(lprobs, at, self._history(rows.tokens, inp, t, rr))
            st.passes += 1
            st.row_steps += n

            if L == 1:
                # the regular one-token step: stock's BeamSearch.step at beam 1
                cand = lprobs + rows.cum.unsqueeze(1)
                top_v, top_i = torch.topk(cand, k=min(2, cand.size(1) - 1))
                P, CS = top_i[:, :1], top_v[:, :1]
                emit = torch.ones_like(t)
                near = emit.new_zeros(())
            else:
                top_v, top_i = torch.topk(lprobs, k=2)
                jj = offs[:L] if flat is None else flat % L
                eps = tn.near_tie + tn.ulp_rel * (rows.cum[rr].abs() + 20.0 * jj)
                sure = (top_v[:, 0] - top_v[:, 1]) > eps
                near = (~sure).sum()
                P, LP, ok = self._block_grid(top_i[:, 0], top_v[:, 0], sure, flat, n, L, pad)
                ok[:, 1:] &= (P[:, :-1] == inp[:, 1:]) & (P[:, :-1] != eos)
                emit = ok.long().cumprod(dim=1).sum(dim=1)
            last = (emit - 1).clamp(min=0)
            moved = emit.gt(0)
            new_last = P.gather(1, last.unsqueeze(1))
            finished = moved & new_last.squeeze(1).eq(eos)
            t_new = t + emit
            # one host read per pass
            emax, n_stuck, n_fin, t_hi, t_lo, n_near = torch.stack(
                [emit.max(), emit.eq(0).sum(), finished.sum(), t_new.max(), t_new.min(), near]
            ).tolist()
            st.near_ties += n_near
            force_single = n_stuck > 0

            if emax > 0:
                if L > 1:
                    # running scores, one float32 add per step as stock does
                    c, cols = rows.cum, []
                    for j in range(emax):
                        c = c + LP[:, j]
                        cols.append(c)
                    CS = torch.stack(cols, dim=1)
                rows.tokens.scatter_(1, t.unsqueeze(1) + 1 + offs[: P.size(1)], P)
                rows.cum_hist.scatter_(1, t.unsqueeze(1) + offs[:emax], CS)
                rows.cum = torch.where(moved, CS.gather(1, last.unsqueeze(1)).squeeze(1), rows.cum)
                rows.last_tok = torch.where(moved.unsqueeze(1), new_last, rows.last_tok)

            if d is not None:
                # adapt draft lengths; rows that did not draft drift back to the prior, so
                # they try again later
                a = torch.minimum(last, d)
                drafted = d.gt(0) & moved
                rejected = drafted & last.lt(d)
                rows.acc_s = torch.where(drafted, tn.decay * rows.acc_s + a, tn.decay * rows.acc_s + prior_s)
                rows.acc_f = torch.where(drafted, tn.decay * rows.acc_f + rejected,
                                         tn.decay * rows.acc_f + prior_f)
                tally += torch.stack([d.sum(), a.sum(), rejected.sum()])
                if self.draft_vd is None and L > 1:
                    # accepted draft positions, and the first rejected one with the model's token
                    seen = offs[: L - 1].unsqueeze(0) < (a + rejected).unsqueeze(1)
                    self.substitutions.observe(prop.orig[:, : L - 1][seen], P[:, : L - 1][seen])
                drafts.advance(prop.start, last, d, moved)
            rows.t = t_new
            if t_hi > max_len and bool(((t_new > max_len) & ~finished).any()):
                # eos itself banned at the length limit (e.g. --no-repeat-ngram-size 1):
                # stock's loop fails the same way
                raise AssertionError(f"{max_len} < {max_len}")

            if n_fin:
                fin = finished.nonzero().squeeze(1)
                lengths, sents, src_lens = torch.stack(
                    [t_new[fin], rows.orig[fin], rows.src_lengths[fin].to(t_new.dtype)]).tolist()
                finalize_rows(finalized, rules, rows.tokens.index_select(0, fin),
                              rows.cum_hist.index_select(0, fin), lengths, sents, src_lens)
                st.tokens += sum(lengths)
                if n_fin == n:
                    break
                keep = (~finished).nonzero().squeeze(1)
                rows = rows.keep(keep)
                drafts.select(keep)
                self.vd.select(keep)

        drafted, accepted, rejected = tally.tolist()
        st.drafted += drafted
        st.accepted += accepted
        self._seen_s += accepted
        self._seen_f += rejected
        self._batches += 1
        if self._batches == 1 or self._batches % 100 == 0:
            logger.info("fairseq-fastgen: %s", st)
        return finalized

    # ---- pieces -----------------------------------------------------------------------

    def _global_rate(self) -> float:
        """Acceptance rate of draft positions so far (prior of every new row)."""
        s, f = self._seen_s + 1.0, self._seen_f + 1.0
        return min(max(s / (s + f), 0.05), 0.95)

    @staticmethod
    def _block_grid(top_tok: Tensor, top_lp: Tensor, sure: Tensor, flat: Optional[Tensor],
                    n: int, L: int, pad: int):
        """The verified positions' best token, its log-prob and whether it is sure, on
        the (n, L) grid of the block (top_*: (m,) per verified position; flat: their
        indices into n*L, None: all)."""
        if flat is None:
            return top_tok.view(n, L), top_lp.view(n, L), sure.view(n, L)
        dev = top_tok.device
        # positions past a row's draft: pad (never compared; written as junk)
        P = torch.full((n * L,), pad, dtype=torch.long, device=dev)
        P[flat] = top_tok
        LP = torch.zeros(n * L, dtype=torch.float, device=dev)
        LP[flat] = top_lp
        ok = torch.zeros(n * L, dtype=torch.bool, device=dev)
        ok[flat] = sure
        return P.view(n, L), LP.view(n, L), ok.view(n, L)

    @staticmethod
    def _history(tokens: Tensor, inp: Tensor, t: Tensor, rr: Optional[Tensor]) -> Tensor:
        """Each verified position's hypothesis including the draft tokens before it (tokens
        has room: columns past a row's step are not read).  tokens: (n, W); inp: (n, L)
        the block; t: (n,); rr: (m,) row of each position (None: position i is row i)."""
        L = inp.size(1)
        hist = tokens
        if L > 1:
            cols = t.unsqueeze(1) + 1 + torch.arange(L - 1, device=t.device)
            hist = tokens.scatter(1, cols, inp[:, 1:])
        return hist if rr is None else hist.index_select(0, rr)
