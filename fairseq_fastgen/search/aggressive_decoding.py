"""Lossless aggressive decoding for greedy generation (beam 1), batched, with a KV cache.

Aggressive decoding (Ge et al., arXiv 2205.10350) drafts several tokens (here: copied from
the source, :mod:`~fairseq_fastgen.search.drafts`), verifies all of them in one decoder
pass, keeps the longest prefix greedy search would have produced plus the model's own next
token, and drafts again.  This implementation:

* **batches with the cache**: every row of a batch feeds its last token and its own draft
  in one block pass (:class:`~fairseq_fastgen.models.verify.VerifyDecoder`), rows accept
  different numbers of tokens, the self-attention cache keeps a length per row and a
  rejected draft is rolled back by not advancing that length (masked, then overwritten);
  finished rows leave the batch at once;
* **is greedy-exact**: each verified position gets stock ``SequenceGenerator``'s rules for
  its own step (NaN -> -inf, pad banned, ``--unkpen``, eos banned before ``--min-len``,
  eos forced at the length limit, ``--prefix-size`` forcing, the repeated n-gram ban
  computed on the hypothesis *including the draft tokens before that position*), then
  the top candidate is taken as fairseq's ``BeamSearch`` (beam 1) does.  Scores are
  accumulated in float32 step by step as stock does, and each hypothesis is finalized as
  ``finalize_hypos`` does (same tokens, ``score``, ``positional_scores``,
  ``--match-source-len`` rule);
* **near ties**: a block pass computes logits with other GEMM shapes than stock's one-token
  step, so scores may differ in the last bits (~1e-6).  A verified position whose top-2
  margin is below ``NEAR_TIE`` (1e-4, plus the float32 rounding of the running score) is
  not trusted: the row keeps only the positions before it, and if it is the row's first
  position, the next pass is a plain one-token step for the batch (no drafts), which
  decides it as the regular fast path does (``topk`` over cumulative scores, as stock);
* **adapts**: each row keeps decayed counts of accepted / rejected draft positions
  (prior: the acceptance seen so far in this generator); every pass picks the block
  length that maximizes expected tokens per unit of cost (a pass ~ 1 one-token step,
  plus ~0.03 per row-token and ~0.04 per block position, measured on CPU), so rows whose
  drafts keep failing stop drafting, a batch without useful drafts runs one-token steps
  (plain greedy), and rows that stopped drafting drift back to the prior and try again;
* **drafts** (:mod:`~fairseq_fastgen.search.drafts`): copies of the source after an n-gram
  match with the hypothesis' last 1..3 tokens, with token substitutions learned from
  rejected drafts, or (``--fastgen-draft-model``) a small fairseq model's greedy output.

Acceptance statistics are kept in ``FastSequenceGenerator.aggressive_stats`` (cumulative)
and logged.
"""
import logging
import math
import time
from typing import Dict, List, Optional

import torch
from torch import Tensor

from ..models.fast_decoder import unsupported_reason
from ..models.verify import VerifyDecoder
from .drafts import DraftModelDrafts, SourceDrafts, SubstitutionMemory, load_draft_model
from .ngram_blocker import TorchNGramBlocker

logger = logging.getLogger(__name__)

NEAR_TIE = 1e-4  # top-2 log-prob margin below which a block-pass decision is re-done
ULP_REL = 2.4e-7  # ~2 float32 ulps per unit of |running score|
MAX_DRAFT = 16
# Cost of a block pass relative to a one-token step of one row (measured on CPU for the
# bundled 3-layer models: per pass ~1, per row-token ~0.03, per block position ~0.04).
COST_ROW_TOKEN = 0.03
COST_POSITION = 0.04
COST_DRAFT_STEP = 0.5  # one draft-model pass (small model) per draft position
PRIOR_WEIGHT = 2.0  # pseudo-counts of the acceptance prior of each row
DECAY = 0.7  # acceptance is bursty (copied spans vs rewritten ones): recent passes count more


# ---- when it applies ---------------------------------------------------------------------

def unsupported(gen, sample) -> Optional[str]:
    """Why aggressive decoding cannot serve this generator/sample (None if it can)."""
    cfg = gen.fastgen
    if cfg.bitwise:
        return "bitwise mode (a block pass is not bit-identical)"
    if len(gen.model.models) != 1:
        return "ensemble"
    if gen.need_attn:
        return "attention weights requested"
    if gen.token_indices_to_suppress is not None:
        return "suppressed token indices"
    if gen.repeat_ngram_blocker is not None and not isinstance(gen.repeat_ngram_blocker, TorchNGramBlocker):
        return "stock n-gram blocker"
    model = gen.model.models[0]
    if getattr(model, "encoder", None) is None or "src_tokens" not in sample["net_input"]:
        return "no source to draft from"
    reason = unsupported_reason(model)
    if reason is not None:
        return reason
    src_dict = getattr(model.encoder, "dictionary", None)
    if cfg.aggressive == "auto" and not cfg.draft_model and (src_dict is None or src_dict != gen.tgt_dict):
        return "auto: source and target dictionaries differ"
    return None


def try_aggressive(gen, sample, prefix_tokens, bos_token):
    """Run aggressive greedy decoding for ``gen`` (a beam-1 FastSequenceGenerator), or
    return None (after one log line) when it does not apply."""
    reason = unsupported(gen, sample)
    if reason is not None:
        if gen.fastgen.log_fallbacks:
            from .fast_sequence_generator import _log_once
            _log_once(f"fairseq-fastgen: aggressive decoding off ({reason}); regular greedy")
        return None
    dec = getattr(gen, "_aggressive", None)
    if dec is None:
        dec = gen._aggressive = AggressiveGreedy(gen)
    bsz = sample["net_input"]["src_tokens"].size(0)
    mode = dec.chooser.choose(bsz)
    t0 = time.perf_counter()
    if mode == PLAIN:
        out = gen._fast_generate(sample, prefix_tokens, bos_token)
        dec.stats.plain_batches += 1
    else:
        out = dec.generate(sample, prefix_tokens, bos_token)
    dec.chooser.record(mode, bsz, time.perf_counter() - t0,
                       sum(len(h[0]["tokens"]) for h in out if h))
    return out


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


# ---- acceptance statistics ----------------------------------------------------------------

class AcceptanceStats:
    def __init__(self):
        self.sentences = 0
        self.passes = 0  # decoder block passes
        self.row_steps = 0  # (row, pass) pairs: verification steps
        self.tokens = 0  # tokens produced
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # draft tokens accepted
        self.near_ties = 0  # positions re-done because of a near tie
        self.plain_batches = 0  # batches the regular greedy step decoded (faster there)

    def as_dict(self) -> Dict[str, float]:
        d = dict(self.__dict__)
        d["mean_accepted_per_step"] = self.tokens / max(self.row_steps, 1)
        d["draft_acceptance_rate"] = self.accepted / max(self.drafted, 1)
        d["tokens_per_pass"] = self.tokens / max(self.passes, 1)
        return d

    def __str__(self):
        d = self.as_dict()
        return (f"aggressive decoding: {self.sentences} sentences, {self.tokens} tokens in "
                f"{self.row_steps} verification steps ({d['mean_accepted_per_step']:.2f} tokens/step), "
                f"{self.passes} decoder passes, draft acceptance {d['draft_acceptance_rate']:.1%}, "
                f"near ties {self.near_ties}; {self.plain_batches} batch(es) by the regular "
                f"greedy step (faster for their size)")


# ---- n-gram ban with a step per row ------------------------------------------------------

def ban_repeated_ngrams_ragged(tokens: Tensor, steps: Tensor, lprobs: Tensor, n: int,
                               max_step: Optional[int] = None) -> None:
    """``ngram_blocker.ban_repeated_ngrams`` with its own step per row, in place.

    tokens: (rows, W) hypotheses (column 0 is BOS; columns after a row's step ignored);
    steps: (rows,) int64; lprobs: (rows, vocab); max_step: an upper bound of steps known
    on the host (saves reading it; W > max_step needed)."""
    starts = steps - n + 2
    if max_step is not None:
        ms = max_step - n + 2
    else:
        ms = int(starts.max()) if starts.numel() else 0
    if ms <= 0:
        return
    banned = tokens[:, n - 1 : n - 1 + ms]
    valid = torch.arange(ms, device=tokens.device).unsqueeze(0) < starts.unsqueeze(1)
    if n == 1:
        match = valid
    else:
        windows = tokens.unfold(1, n - 1, 1)[:, :ms]
        last_idx = (starts.unsqueeze(1) + torch.arange(n - 1, device=tokens.device)).clamp(min=0)
        last = tokens.gather(1, last_idx)
        match = (windows == last.unsqueeze(1)).all(dim=-1) & valid
    src = torch.full(banned.shape, math.inf, dtype=lprobs.dtype, device=lprobs.device)
    src.masked_fill_(match, -math.inf)
    lprobs.scatter_reduce_(1, banned, src, reduce="amin")


# ---- the decoder ---------------------------------------------------------------------------

class AggressiveGreedy:
    """Draft-and-verify greedy search for one fairseq encoder-decoder model."""

    def __init__(self, gen):
        self.gen = gen
        self.model = gen.model.models[0]
        self.vd = VerifyDecoder(self.model, vocab_pad=gen.fastgen.vocab_pad)
        self.stats = AcceptanceStats()
        self.chooser = SpeedChooser()
        self._seen_s = self._seen_f = 0.0
        self.substitutions = SubstitutionMemory(len(gen.tgt_dict))
        self.draft_model = None
        if gen.fastgen.draft_model:
            self.draft_model = load_draft_model(gen.fastgen.draft_model, self.model, gen.tgt_dict)
            reason = unsupported_reason(self.draft_model)
            if reason is not None:
                raise ValueError(f"draft model {gen.fastgen.draft_model}: {reason}")
        self._batches = 0
        self._costs: Dict[tuple, Tensor] = {}
        src_dict = getattr(self.model.encoder, "dictionary", None)
        self.id_map = None
        if src_dict is not None and src_dict != gen.tgt_dict:
            # source ids -> target ids by symbol (unknown symbols -> unk: drafts just fail)
            ids = [gen.tgt_dict.index(src_dict[i]) for i in range(len(src_dict))]
            self.id_map = torch.tensor(ids, dtype=torch.long)

    def generate(self, sample, prefix_tokens: Optional[Tensor], bos_token: Optional[int]):
        gen = self.gen
        eos, pad = gen.eos, gen.pad
        net_input = sample["net_input"]
        src_tokens = net_input["src_tokens"]
        if "src_lengths" in net_input:
            src_lengths = net_input["src_lengths"]
        else:
            src_lengths = (src_tokens.ne(eos) & src_tokens.ne(pad)).long().sum(dim=1)
        bsz, src_len = src_tokens.size()[:2]
        dev = src_tokens.device
        if gen.match_source_len:
            max_len = src_lengths.max().item()
        else:
            max_len = min(int(gen.max_len_a * src_len + gen.max_len_b), gen.max_len - 1)
        assert gen.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"

        encoder_outs = gen.model.forward_encoder(net_input)
        max_draft = max(0, min(MAX_DRAFT, max_len))
        W = max_draft + 1  # the widest block
        self.vd.start(encoder_outs[0], bsz, max_len, W)
        del encoder_outs
        id_map = self.id_map.to(dev) if self.id_map is not None else None
        if self.draft_model is not None:
            drafts = DraftModelDrafts(self.draft_model, net_input, bsz, max_len, max_draft, eos,
                                      pad, gen.min_len)
        else:
            drafts = SourceDrafts(src_tokens, pad, id_map, self.substitutions.table(dev),
                                  vocab_size=len(gen.tgt_dict))

        # W spare columns: a pass writes all its L positions; those past a row's emitted
        # tokens are overwritten before anything reads them (reads stop at the row's step)
        tokens = torch.full((bsz, max_len + 2 + W), pad, dtype=torch.long, device=dev)
        tokens[:, 0] = eos if bos_token is None else bos_token
        last_tok = tokens[:, :1].clone()  # (n, 1) each row's last token
        cum_hist = torch.zeros(bsz, max_len + 1 + W, dtype=torch.float, device=dev)
        t = torch.zeros(bsz, dtype=torch.long, device=dev)
        t_lo = t_hi = 0  # bounds of t on the host (conservative after rows leave)
        cum = torch.zeros(bsz, dtype=torch.float, device=dev)
        # per-row acceptance evidence (decayed counts of accepted / rejected draft positions)
        p0 = self._global_rate()
        prior_s, prior_f = (1 - DECAY) * PRIOR_WEIGHT * p0, (1 - DECAY) * PRIOR_WEIGHT * (1 - p0)
        acc_s = torch.full((bsz,), PRIOR_WEIGHT * p0, dtype=torch.float, device=dev)
        acc_f = torch.full((bsz,), PRIOR_WEIGHT * (1 - p0), dtype=torch.float, device=dev)
        full_want = torch.full((bsz,), max_draft, dtype=torch.long, device=dev)
        ks = torch.arange(max_draft + 1, device=dev)
        offs = torch.arange(W, device=dev)
        force_single = False
        orig = torch.arange(bsz, device=dev)
        src_lengths = src_lengths.clone()
        finalized: List[List[Dict[str, Tensor]]] = [[] for _ in range(bsz)]
        st = self.stats
        st.sentences += bsz
        # drafted, accepted, rejected-row counts: summed on the device, read once per batch
        tally = torch.zeros(3, dtype=torch.long, device=dev)

        while orig.numel() > 0:
            n = orig.numel()
            d = None
            L = 1
            if not force_single and max_draft > 0:
                p_acc = acc_s / (acc_s + acc_f)
                want = full_want[:n]
                if self.draft_model is not None:
                    # every draft token costs a draft-model pass: choose k first
                    k = self._block_len(want, p_acc, ks, per_position=COST_DRAFT_STEP) - 1
                    want = want.clamp(max=min(k, max_len - t_lo))
                draft, d, dstart = drafts.propose(tokens, t, want, max_draft)
                d = torch.minimum(d, max_len - t)
                L = self._block_len(d, p_acc, ks)  # <= 1 + max(d)
                d = d.clamp(max=L - 1)
            if L == 1:
                inp, flat, rr, steps = last_tok, None, None, t
            else:
                # past the source's end: any token id (those positions are not read)
                inp = torch.cat([last_tok, draft[:, : L - 1]], dim=1).clamp_(min=0)
                if n == 1:  # d == L - 1: every position is read
                    flat = None
                    rr = torch.zeros(L, dtype=torch.long, device=dev)
                    steps = t + offs[:L]
                else:
                    valid = offs[:L].unsqueeze(0) <= d.unsqueeze(1)
                    flat = valid.view(-1).nonzero().squeeze(1)
                    rr = flat // L
                    steps = t[rr] + flat % L
            lprobs = self.vd.forward(inp, t, flat, bounds=(t_lo, t_hi), log_probs=True,
                                     temperature=gen.temperature)[:, : self.vd.vocab]
            self._apply_rules(lprobs, steps, rr, tokens, inp, t, max_len, prefix_tokens,
                              t_lo, t_hi + L - 1)
            st.passes += 1
            st.row_steps += n

            if L == 1:
                # the regular one-token step: stock's BeamSearch.step at beam 1
                cand = lprobs + cum.unsqueeze(1)
                top_v, top_i = torch.topk(cand, k=min(2, cand.size(1) - 1))
                P, CS = top_i[:, :1], top_v[:, :1]
                emit = torch.ones_like(t)
                near = emit.new_zeros(())
            else:
                top_v, top_i = torch.topk(lprobs, k=2)
                jj = offs[:L] if flat is None else flat % L
                eps = NEAR_TIE + ULP_REL * (cum[rr].abs() + 20.0 * jj)
                sure = (top_v[:, 0] - top_v[:, 1]) > eps
                near = (~sure).sum()
                if flat is None:
                    P, LP = top_i[:, 0].view(n, L), top_v[:, 0].view(n, L)
                    ok = sure.view(n, L)  # (sure is not read after this)
                else:
                    # positions past a row's draft: pad (never compared; written as junk)
                    P = torch.full((n * L,), pad, dtype=torch.long, device=dev)
                    P[flat] = top_i[:, 0]
                    P = P.view(n, L)
                    LP = torch.zeros(n * L, dtype=torch.float, device=dev)
                    LP[flat] = top_v[:, 0]
                    LP = LP.view(n, L)
                    ok = torch.zeros(n * L, dtype=torch.bool, device=dev)
                    ok[flat] = sure
                    ok = ok.view(n, L)
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
                    c, cols = cum, []
                    for j in range(emax):
                        c = c + LP[:, j]
                        cols.append(c)
                    CS = torch.stack(cols, dim=1)
                tokens.scatter_(1, t.unsqueeze(1) + 1 + offs[: P.size(1)], P)
                cum_hist.scatter_(1, t.unsqueeze(1) + offs[:emax], CS)
                cum = torch.where(moved, CS.gather(1, last.unsqueeze(1)).squeeze(1), cum)
                last_tok = torch.where(moved.unsqueeze(1), new_last, last_tok)

            if d is not None:
                # adapt draft lengths; rows that did not draft drift back to the prior, so
                # they try again later
                a = torch.minimum(last, d)
                drafted = d.gt(0) & moved
                rejected = drafted & last.lt(d)
                acc_s = torch.where(drafted, DECAY * acc_s + a, DECAY * acc_s + prior_s)
                acc_f = torch.where(drafted, DECAY * acc_f + rejected, DECAY * acc_f + prior_f)
                tally += torch.stack([d.sum(), a.sum(), rejected.sum()])
                if self.draft_model is None and L > 1:
                    # accepted draft positions, and the first rejected one with the model's token
                    seen = offs[: L - 1].unsqueeze(0) < (a + rejected).unsqueeze(1)
                    self.substitutions.observe(drafts.last_orig[:, : L - 1][seen], P[:, : L - 1][seen])
                drafts.advance(dstart, last, d, moved)
            t = t_new
            if t_hi > max_len and bool(((t > max_len) & ~finished).any()):
                # eos itself banned at the length limit (e.g. --no-repeat-ngram-size 1):
                # stock's loop fails the same way
                raise AssertionError(f"{max_len} < {max_len}")

            if n_fin:
                fin = finished.nonzero().squeeze(1)
                lengths, sents, src_lens = torch.stack(
                    [t[fin], orig[fin], src_lengths[fin].to(t.dtype)]).tolist()
                self._finalize(finalized, tokens.index_select(0, fin), cum_hist.index_select(0, fin),
                               lengths, sents, src_lens)
                st.tokens += sum(lengths)
                if n_fin == n:
                    break
                keep = (~finished).nonzero().squeeze(1)
                tokens, cum_hist, t, cum = tokens[keep], cum_hist[keep], t[keep], cum[keep]
                acc_s, acc_f, orig, last_tok = acc_s[keep], acc_f[keep], orig[keep], last_tok[keep]
                src_lengths = src_lengths[keep]
                if prefix_tokens is not None:
                    prefix_tokens = prefix_tokens[keep]
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

    def _block_len(self, avail: Tensor, p: Tensor, ks: Tensor, per_position: float = 0.0) -> int:
        """The block length L maximizing expected tokens per unit of cost.

        Row r with draft length k and per-position acceptance p_r yields
        (1 - p_r^(k+1)) / (1 - p_r) tokens in expectation; a pass over n rows and L
        positions costs 1 + COST_ROW_TOKEN*n*L + COST_POSITION*L (in one-token steps).
        avail, p: (n,) draft tokens available and acceptance per row; ks: arange(K)."""
        n = avail.numel()
        p = p.clamp(max=0.98).unsqueeze(1)
        k1 = torch.minimum(ks, avail.unsqueeze(1)) + 1  # (n, K)
        gain = ((1 - p.pow(k1)) / (1 - p)).sum(dim=0)
        return int((gain / self._cost(n, ks, per_position)).argmax()) + 1

    def _cost(self, n: int, ks: Tensor, per_position: float) -> Tensor:
        key = (n, ks.numel(), per_position, ks.device)
        cost = self._costs.get(key)
        if cost is None:
            L = (ks + 1).float()
            cost = self._costs[key] = 1.0 + COST_ROW_TOKEN * n * L + (COST_POSITION + per_position) * L
        return cost

    def _apply_rules(self, lprobs: Tensor, steps: Tensor, rr: Optional[Tensor], tokens: Tensor,
                     inp: Tensor, t: Tensor, max_len: int, prefix_tokens: Optional[Tensor],
                     lo: int, hi: int) -> None:
        """Stock SequenceGenerator's per-step masking, each row at its own step, in place.

        lprobs (m, V) rows = positions; steps (m,) their step; rr (m,) their batch row
        (None: position i is row i); lo <= steps <= hi (host bounds: skip what cannot apply)."""
        gen = self.gen
        eos, pad, unk = gen.eos, gen.pad, gen.unk
        if not (self.vd.logits_finite and gen.temperature >= 1.0):
            lprobs.masked_fill_(torch.isnan(lprobs), -math.inf)
        lprobs[:, pad] = -math.inf
        if gen.unk_penalty != 0:  # x - 0.0 == x: stock's subtraction changes nothing then
            lprobs[:, unk] -= gen.unk_penalty
        if hi >= max_len:
            at_max = steps >= max_len
            if bool(at_max.any()):
                idx = at_max.nonzero().squeeze(1)
                keep = lprobs[idx, eos].clone()
                lprobs[idx] = -math.inf
                lprobs[idx, eos] = keep
        in_prefix = None
        if prefix_tokens is not None and lo < prefix_tokens.size(1):
            plen = prefix_tokens.size(1)
            in_prefix = (steps < plen) & (steps < max_len)
            if bool(in_prefix.any()):
                rows = prefix_tokens if rr is None else prefix_tokens.index_select(0, rr)
                ptok = rows.gather(1, steps.clamp(max=plen - 1).unsqueeze(1)).squeeze(1)
                forced = in_prefix & ptok.ne(pad)
                if bool(forced.any()):
                    idx = forced.nonzero().squeeze(1)
                    tok = ptok[idx]
                    keep = lprobs[idx, tok].clone()
                    lprobs[idx] = -math.inf
                    lprobs[idx, tok] = keep
        if lo < gen.min_len:
            ban = steps < gen.min_len
            if in_prefix is not None:
                ban &= ~in_prefix
            if bool(ban.any()):
                lprobs[ban.nonzero().squeeze(1), eos] = -math.inf
        blocker = gen.repeat_ngram_blocker
        if blocker is not None:
            n = blocker.no_repeat_ngram_size
            if hi - n + 2 > 0:
                # the hypothesis including the draft tokens before each position (tokens has
                # room: columns past a row's step are not read)
                L = inp.size(1)
                hist = tokens
                if L > 1:
                    cols = t.unsqueeze(1) + 1 + torch.arange(L - 1, device=t.device)
                    hist = tokens.scatter(1, cols, inp[:, 1:])
                ban_repeated_ngrams_ragged(hist if rr is None else hist.index_select(0, rr),
                                           steps, lprobs, n, max_step=hi)

    def _finalize(self, finalized, tokens: Tensor, cum_hist: Tensor, lengths: List[int],
                  sents: List[int], src_lens: List[int]) -> None:
        """Finished hypotheses, exactly as fairseq's ``finalize_hypos`` builds them.

        tokens: (f, W) their rows (BOS first); cum_hist: (f, W') running scores; lengths:
        tokens of each (eos included); sents: their sentence; src_lens: source lengths."""
        gen = self.gen
        steps = torch.tensor(lengths, device=tokens.device) - 1
        toks = tokens[:, 1:].scatter_(1, steps.unsqueeze(1), gen.eos)
        # positional scores: differences of the running scores (float32, as stock)
        pos = torch.cat([cum_hist[:, :1], cum_hist[:, 1:] - cum_hist[:, :-1]], dim=1)
        scores = cum_hist.gather(1, steps.unsqueeze(1)).squeeze(1)
        for i, (n_tok, sent, src_len) in enumerate(zip(lengths, sents, src_lens)):
            step = n_tok - 1
            score = scores[i]
            if gen.normalize_scores:
                score = score / (step + 1) ** gen.len_penalty
            if gen.match_source_len and step > src_len:
                score = torch.tensor(-math.inf)
            finalized[sent].append({
                "tokens": toks[i, :n_tok],
                "score": score,
                "attention": torch.empty(0),
                "alignment": torch.empty(0),
                "positional_scores": pos[i, :n_tok],
            })
