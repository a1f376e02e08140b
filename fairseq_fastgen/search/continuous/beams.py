"""The beam-search state of every sentence slot, stepped at once: candidates, finished
hypotheses and the next hypotheses of ``slots x beam`` rows whose sentences stand at
different steps.

Each statement is fairseq ``SequenceGenerator._generate``'s, applied per slot: a slot's
candidates are its own ``2*beam`` best ``lprob + score`` (step 0: of its first beam only,
as ``BeamSearch.step`` does), its eos candidates among the first ``beam`` are finalized in
candidate order until it has ``beam`` (``finalize_hypos``: positional scores, length
normalization with the slot's own step, ``--match-source-len``), and its next hypotheses
are the first ``beam`` non-eos candidates (the ``active_mask`` top-k).  Nothing couples
two slots, so a sentence's hypotheses are those stock computes for it in its own batch,
given the same log-probabilities (which differ only by GEMM rounding: lossless mode).

Finished hypotheses are kept in tensors (``(slots, beam, L)``), so a step finalizes every
slot's eos candidates with a few tensor operations and one host read; hypotheses become
fairseq's dicts only when their sentence is done.

Three settings serve what a batch decoded on its own asks for (every slot at one step,
:mod:`.stream`): ``select``, another candidate choice in ``BeamSearch.step``'s call
signature (fairseq's sampling draws, over stock's rows); ``stock_topk``, stock's one
top-k over each sentence's ``beam * V`` sums (half precision ties often, and the order
among exact ties is then ``torch.topk``'s, as stock's); ``attention``, each hypothesis's
cross-attention history (``--print-alignment``), kept and finalized as stock keeps it.
"""
import logging
import math
from typing import Callable, Dict, List, NamedTuple, Optional

import torch
from torch import Tensor

from ...models import native_step
from ..candidates import full_topk, top_candidates
from . import margins

logger = logging.getLogger(__name__)
_said = []


class BeamStep(NamedTuple):
    """What a step of every slot decided.  order: (slots*beam,) int64, the row each next
    hypothesis continues (the caches follow it); had_eos: (slots,) bool, slots that had an
    eos candidate to finalize; tight: (slots,) bool, slots that compared two candidates of
    different roles closer than the margin (None without one: :mod:`.margins`)."""
    order: Tensor
    had_eos: Tensor
    tight: Optional[Tensor]


class SlotBeams:
    """Tokens, scores and finished hypotheses of ``slots`` sentences of ``beam`` rows.

    tokens: (rows, L+2) int64 (BOS at 0, step t's word at t+1); scores: (rows, L+1)
    cumulative scores; ignore: (slots, beam) bool, stock's ``cands_to_ignore``.
    Finished: fin_tokens (slots, beam, L+1), fin_pos (slots, beam, L+1) positional scores,
    fin_score (slots, beam), fin_len (slots, beam) int64, fin_count (slots,) int64.
    """

    def __init__(self, beam: int, eos: int, pad: int, normalize: bool, len_penalty: float,
                 match_source_len: bool, device, native: bool = False,
                 select: Optional[Callable] = None, stock_topk: bool = False,
                 attention: bool = False):
        """native: on CPU float32, candidates by the C++ extension's ``beam_candidates``
        (see :mod:`~fairseq_fastgen.search.candidates`) and the rest of :meth:`step` by
        its ``slot_beams_step`` (``csrc/slot_beams.cpp``, same bits; 11% of a batch-8
        run, its header says); select, stock_topk,
        attention: see the module doc (attention runs the Python statements)."""
        self.beam = beam
        if native and native_step.load() is None and not _said:
            _said.append(True)
            logger.info("fairseq-fastgen: native candidates off (C++ extension unavailable "
                        "(%s)); Python candidates", native_step.load_error())
        self._native = native_step.load() if native and not attention else None
        self._native_candidates = native_step.load() if native and not stock_topk else None
        self.select = select
        self.stock_topk = stock_topk
        self.attention = attention
        self.eos = eos
        self.pad = pad
        self.normalize = normalize
        self.len_penalty = len_penalty
        self.match_source_len = match_source_len
        self.device = device
        self.width = 0  # L
        self.slots = 0
        z = torch.zeros(0, dtype=torch.long, device=device)
        self.tokens = self.scores = self.ignore = z
        self.attn = self.fin_attn = z  # attention: (rows, S, L+2), (slots, beam, S, L+1)
        self.fin_tokens = self.fin_pos = self.fin_score = self.fin_len = self.fin_count = z

    # ---- room --------------------------------------------------------------------

    def ensure(self, slots: int, width: int) -> None:
        """Room for ``slots`` slots and hypotheses of ``width`` steps (new room empty)."""
        if slots <= self.slots and width <= self.width:
            return
        s2, w2 = max(slots, self.slots), max(width, self.width)
        k, dev = self.beam, self.device

        def grown(old: Tensor, shape, fill, dtype):
            new = torch.full(shape, fill, dtype=dtype, device=dev)
            if old.numel():
                new[tuple(slice(0, d) for d in old.shape)] = old
            return new

        self.tokens = grown(self.tokens, (s2 * k, w2 + 2), self.pad, torch.long)
        self.scores = grown(self.scores, (s2 * k, w2 + 1), 0.0, torch.float)
        self.ignore = grown(self.ignore, (s2, k), False, torch.bool)
        self.fin_tokens = grown(self.fin_tokens, (s2, k, w2 + 1), self.pad, torch.long)
        self.fin_pos = grown(self.fin_pos, (s2, k, w2 + 1), 0.0, torch.float)
        self.fin_score = grown(self.fin_score, (s2, k), 0.0, torch.float)
        self.fin_len = grown(self.fin_len, (s2, k), 0, torch.long)
        self.fin_count = grown(self.fin_count, (s2,), 0, torch.long)
        if self.attn.numel():
            a = self.attn.size(1)
            self.attn = grown(self.attn, (s2 * k, a, w2 + 2), 0.0, torch.float)
            self.fin_attn = grown(self.fin_attn, (s2, k, a, w2 + 1), 0.0, torch.float)
        self.slots, self.width = s2, w2

    def ensure_attention(self, width: int) -> None:
        """Room for attention over sources of ``width`` positions (attention only)."""
        if self.attn.numel() and self.attn.size(1) >= width:
            return
        r, k, w = self.slots * self.beam, self.beam, self.width
        attn = torch.zeros(r, width, w + 2, device=self.device)
        fin_attn = torch.zeros(self.slots, k, width, w + 1, device=self.device)
        if self.attn.numel():  # a wider source joined: the history so far kept
            attn[:, : self.attn.size(1)] = self.attn
            fin_attn[:, :, : self.fin_attn.size(2)] = self.fin_attn
        self.attn, self.fin_attn = attn, fin_attn

    def start(self, slots: Tensor, bos: int) -> None:
        """Slots (m,) begin new sentences: BOS, no score, nothing finished."""
        rows = (slots.unsqueeze(1) * self.beam + torch.arange(self.beam, device=self.device)).view(-1)
        self.tokens[rows] = self.pad
        self.tokens[rows, 0] = bos
        self.scores[rows] = 0.0
        self.ignore[slots] = False
        self.fin_count[slots] = 0

    def keep(self, slots: Tensor) -> None:
        """Only slots (s_new,) stay, in that order, with their rows."""
        k = self.beam
        rows = (slots.unsqueeze(1) * k + torch.arange(k, device=self.device)).view(-1)
        n = rows.numel()
        with_attn = bool(self.attn.numel())
        for name in ("tokens", "scores") + (("attn",) if with_attn else ()):
            buf = getattr(self, name)
            buf[:n] = buf.index_select(0, rows)
            setattr(self, name, buf[:n])
        names = ("ignore", "fin_tokens", "fin_pos", "fin_score", "fin_len", "fin_count")
        for name in names + (("fin_attn",) if with_attn else ()):
            setattr(self, name, getattr(self, name).index_select(0, slots))
        self.slots = slots.numel()

    # ---- one step ------------------------------------------------------------------

    def step(self, lprobs: Tensor, steps: Tensor, first: Tensor, src_len: Tensor,
             margin: float = 0.0, at_limit: Optional[Tensor] = None,
             uniform: Optional[int] = None, attn: Optional[Tensor] = None) -> BeamStep:
        """Candidates, finalization and the next hypotheses of every slot.

        lprobs: (slots*beam, V) masked log-probabilities; steps: (slots,) int64 step of
        each slot; first: (slots,) bool, slot at step 0; src_len: (slots,) source lengths;
        margin > 0: the margin guard's (:mod:`.margins`), with at_limit (slots,) bool the
        slots at their length limit; uniform: every slot's step, when they share one
        (``select`` needs it); attn: (slots*beam, S) the step's attention (``attention``).
        fin_count then says which slots have ``beam`` hypotheses.
        """
        k, s = self.beam, steps.numel()
        lp = lprobs.view(s, k, -1)
        row_steps = steps.repeat_interleave(k)
        if attn is not None:  # stock: attn[:, :, step + 1] before the finalization
            self.ensure_attention(attn.size(1))
            r = torch.arange(s * k, device=self.device)
            self.attn[r, : attn.size(1), row_steps + 1] = attn.to(self.attn.dtype)
        decide = 2 * k
        wanted = margins.candidates_wanted(k, lp.size(-1)) if margin > 0 else decide
        if self.select is not None:
            assert uniform is not None, "select: every slot at one step"
            cand = self.select(uniform, lp, self.scores[: s * k].view(s, k, -1)[:, :, :uniform])
        else:
            cand = self._candidates(lp, row_steps, first, wanted)
        ignored = self.ignore[:s].any(1) if margin > 0 else None  # before this step
        order, had_eos, roles = self._decide(*(t[:, :decide] for t in cand), steps, src_len,
                                             roles=margin > 0)
        tight = None
        if margin > 0:
            goes_on = self.fin_count[:s].lt(k) & ~at_limit
            tight = margins.tight_slots(roles, cand[0], ignored, goes_on, margin)
        return BeamStep(order, had_eos, tight)

    def _decide(self, cand_scores: Tensor, cand_words: Tensor, cand_beams: Tensor,
                steps: Tensor, src_len: Tensor, roles: bool = True):
        """stock's step after its candidates (s, 2k): finalization, next hypotheses.
        Returns (order, had_eos, roles): roles (s, 2k) int8, each candidate's role as
        bits, 1 finalized, 2 taken as a next hypothesis (:mod:`.margins`); the Python
        statements skip them unless ``roles`` (the C++ pass always has them)."""
        k, s = self.beam, steps.numel()
        n = s * k
        if self._native is not None and cand_scores.device.type == "cpu" and \
                cand_scores.dtype == torch.float32:
            # the statements below in one C++ pass (csrc/slot_beams.cpp), same bits
            return self._native.slot_beams_step(
                cand_scores, cand_words, cand_beams, steps, src_len, self.tokens, self.scores,
                self.ignore, self.fin_tokens, self.fin_pos, self.fin_score, self.fin_len,
                self.fin_count, self.eos, self.normalize, self.len_penalty,
                self.match_source_len)
        cand_bbsz = cand_beams + (torch.arange(s, device=self.device) * k).unsqueeze(1)
        eos_mask = cand_words.eq(self.eos) & cand_scores.ne(-math.inf)
        eos_mask[:, :k][self.ignore[:s]] = False
        had_eos = eos_mask[:, :k].any(1)
        accepted = self._finalize(eos_mask[:, :k], cand_bbsz, cand_scores, steps, src_len)

        # stock's choice of the next hypotheses: the first beam non-eos candidates
        cand_size = 2 * k
        offsets = torch.arange(cand_scores.size(1), device=self.device)
        eos_mask[:, :k] = ~((~self.ignore[:s]) & (~eos_mask[:, :k]))
        active_mask = eos_mask.long() * cand_size + offsets
        new_ignore, active = torch.topk(active_mask, k=k, dim=1, largest=False)
        self.ignore[:s] = new_ignore.ge(cand_size)[:, :k]
        order = torch.gather(cand_bbsz, 1, active).view(-1)
        self.tokens[:n] = self.tokens.index_select(0, order)
        self.scores[:n] = self.scores.index_select(0, order)
        r = torch.arange(n, device=self.device)
        row_steps = steps.repeat_interleave(k)
        self.tokens[r, row_steps + 1] = torch.gather(cand_words, 1, active).view(-1)
        self.scores[r, row_steps] = torch.gather(cand_scores, 1, active).view(-1).type_as(self.scores)
        if self.attn.numel():
            self.attn[:n] = self.attn.index_select(0, order)
        if not roles:
            return order, had_eos, None
        role = torch.zeros(cand_scores.shape, dtype=torch.int8, device=self.device)
        role[:, :k] = accepted.to(torch.int8)
        role.scatter_add_(1, active, torch.full_like(active, 2, dtype=torch.int8))
        return order, had_eos, role

    def _candidates(self, lp: Tensor, row_steps: Tensor, first: Tensor, wanted: int):
        """(slots, wanted) scores, words and beams, best first, as ``BeamSearch.step``
        selects its 2*beam."""
        s, k, _ = lp.shape
        cum = self.scores[: s * k].gather(1, (row_steps - 1).clamp(min=0).unsqueeze(1)).view(s, k)
        if self._native_candidates is not None and lp.dtype == torch.float32 and \
                lp.device.type == "cpu" and lp.stride(-1) == 1:
            return self._native_candidates.beam_candidates(lp, cum, wanted, first)
        top = full_topk if self.stock_topk else top_candidates
        n_first = int(first.sum())
        if n_first == 0:
            return top(lp, cum, wanted)
        if n_first == s:
            return top(lp[:, :1], None, wanted)
        fi, di = first.nonzero().squeeze(1), (~first).nonzero().squeeze(1)
        a = top(lp.index_select(0, fi)[:, :1], None, wanted)
        b = top(lp.index_select(0, di), cum.index_select(0, di), wanted)
        out = []
        for x, y in zip(a, b):
            z = x.new_empty((s,) + x.shape[1:])
            z[fi] = x
            z[di] = y
            out.append(z)
        return out

    def _finalize(self, eos: Tensor, cand_bbsz: Tensor, cand_scores: Tensor, steps: Tensor,
                  src_len: Tensor) -> Tensor:
        """stock's ``finalize_hypos`` for every slot: eos (slots, beam) bool.  Returns
        (slots, beam) bool, the candidates finalized."""
        k = self.beam
        pos = self.fin_count[: eos.size(0)].unsqueeze(1) + eos.long().cumsum(1) - 1
        accept = eos & pos.lt(k)
        idx = accept.nonzero()  # the step's one host read
        if idx.numel() == 0:
            return accept
        slot, j = idx[:, 0], idx[:, 1]
        bb = cand_bbsz[slot, j]
        eos_scores = cand_scores[slot, j]
        st = steps.index_select(0, slot)
        e = torch.arange(slot.numel(), device=self.device)
        toks = self.tokens.index_select(0, bb)[:, 1:]
        toks[e, st] = self.eos
        ps = self.scores.index_select(0, bb).clone()
        ps[e, st] = eos_scores.type_as(ps)
        ps[:, 1:] = ps[:, 1:] - ps[:, :-1]
        if self.normalize:
            # stock divides by the Python float (step + 1) ** len_penalty
            denom = (st.double() + 1).pow(self.len_penalty).to(eos_scores.dtype)
            eos_scores = eos_scores / denom
        if self.match_source_len:
            eos_scores = torch.where(st > src_len.index_select(0, slot),
                                     torch.tensor(-math.inf).to(eos_scores), eos_scores)
        p = pos[slot, j]
        self.fin_tokens[slot, p] = toks
        self.fin_pos[slot, p] = ps
        self.fin_score[slot, p] = eos_scores.type_as(self.fin_score)
        self.fin_len[slot, p] = st + 1
        if self.attn.numel():  # stock: attn[bbsz, :, 1 : step + 2] (hypotheses read :step+1)
            self.fin_attn[slot, p] = self.attn.index_select(0, bb)[:, :, 1:]
        self.fin_count.index_add_(0, slot, torch.ones_like(slot))
        return accept

    def hypotheses(self, slots: Tensor, widths: Optional[List[int]] = None
                   ) -> List[List[Dict[str, Tensor]]]:
        """fairseq's finalized hypotheses of each slot in ``slots``, best first; widths:
        each slot's source width (its attention's rows; with ``attention``)."""
        out = []
        counts = self.fin_count.index_select(0, slots).tolist()
        lens = self.fin_len.index_select(0, slots).tolist()
        for i, s in enumerate(slots.tolist()):
            hyps = []
            for p in range(counts[i]):
                n = lens[i][p]
                hyps.append({
                    "tokens": self.fin_tokens[s, p, :n].clone(),
                    "score": self.fin_score[s, p].clone(),
                    "attention": self.fin_attn[s, p, : widths[i], :n].clone()
                    if self.attention and self.fin_attn.numel() else torch.empty(0),
                    "alignment": torch.empty(0),
                    "positional_scores": self.fin_pos[s, p, :n].clone(),
                })
            scores = torch.tensor([float(h["score"].item()) for h in hyps])
            _, order = torch.sort(scores, descending=True)
            out.append([hyps[o] for o in order])
        return out
