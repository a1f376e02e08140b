"""fairseq ``SequenceGenerator``'s length limits and per-step masks, in one place.

Beam search (:mod:`~fairseq_fastgen.search.fast_sequence_generator`) and greedy block
verification (:mod:`~fairseq_fastgen.search.aggressive`) both apply stock's rules to the
next-token log-probabilities: NaN -> -inf, pad banned, ``--unkpen``, only eos at the length
limit, ``--prefix-size`` forcing, eos banned before ``--min-len``, suppressed tokens, and the
repeated n-gram ban.  A beam step is the case where every row is at the same step
(:meth:`StepAt.uniform`: host-side slices, no host sync, exactly stock's operations); a
verification pass has one step per row (:class:`StepAt` with ``steps``).  Every rule only
assigns -inf or copies values, except the unk penalty, which is stock's subtraction, so the
two forms give the same bits.
"""
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor, nn


class StepAt(NamedTuple):
    """Where the rows of an ``lprobs`` matrix stand.

    lo <= steps <= hi are host bounds (hi may be an upper bound: it only enables rules);
    steps: (m,) int64 step of each row, None when every row is at step ``lo`` (== hi);
    rows: (m,) int64 row of ``prefix_tokens`` of each lprobs row (None: row i is row i);
    limits: (m,) int64 length limit (``max_len``) of each row, None: the caller's one
    ``max_len`` (continuous batching mixes sentences of batches with other limits).
    """
    lo: int
    hi: int
    steps: Optional[Tensor] = None
    rows: Optional[Tensor] = None
    limits: Optional[Tensor] = None

    @classmethod
    def uniform(cls, step: int) -> "StepAt":
        return cls(step, step)


@dataclass(frozen=True)
class StepRules:
    """The options of one ``SequenceGenerator`` that decide lengths, masks and scores."""
    eos: int
    pad: int
    unk: int
    unk_penalty: float
    min_len: int
    max_len_a: float
    max_len_b: int
    max_len_cap: int  # SequenceGenerator.max_len (the models' limit)
    match_source_len: bool
    temperature: float
    suppress: Optional[Tensor]  # (k,) int64 token_indices_to_suppress
    blocker: Optional[nn.Module]  # the repeat_ngram_blocker (fairseq's call signature)
    normalize_scores: bool
    len_penalty: float

    @classmethod
    def of(cls, gen) -> "StepRules":
        """The rules of a fairseq ``SequenceGenerator`` (read once per batch)."""
        return cls(eos=gen.eos, pad=gen.pad, unk=gen.unk, unk_penalty=gen.unk_penalty,
                   min_len=gen.min_len, max_len_a=gen.max_len_a, max_len_b=gen.max_len_b,
                   max_len_cap=gen.max_len, match_source_len=gen.match_source_len,
                   temperature=gen.temperature, suppress=gen.token_indices_to_suppress,
                   blocker=gen.repeat_ngram_blocker, normalize_scores=gen.normalize_scores,
                   len_penalty=gen.len_penalty)

    # ---- length limits --------------------------------------------------------------

    def source_lengths(self, net_input: dict) -> Tensor:
        """(bsz,) int64 source lengths, as stock's ``_generate`` takes them."""
        if "src_lengths" in net_input:
            return net_input["src_lengths"]
        src_tokens = net_input["src_tokens"]
        return (src_tokens.ne(self.eos) & src_tokens.ne(self.pad)).long().sum(dim=1)

    def max_len(self, src_tokens: Tensor, src_lengths: Tensor) -> int:
        """The batch's last step (stock's ``max_len``); src_tokens: (bsz, S)."""
        if self.match_source_len:
            max_len = src_lengths.max().item()
        else:
            src_len = src_tokens.size(1)
            max_len = min(int(self.max_len_a * src_len + self.max_len_b), self.max_len_cap - 1)
        assert self.min_len <= max_len, "min_len cannot be larger than max_len, please adjust these!"
        return max_len

    # ---- per-step masks --------------------------------------------------------------

    def mask_step(self, lprobs: Tensor, at: StepAt, max_len: int, logits_finite: bool,
                  prefix_tokens: Optional[Tensor] = None, beam: int = 1) -> Tensor:
        """Every rule but the n-gram ban, in stock's order, in place.

        lprobs: (m, V) float; prefix_tokens: (bsz, P) int64 (uniform: m = bsz*beam rows,
        beam consecutive rows per sentence); logits_finite: every logit was proven finite
        (then the NaN scan is skipped, see FastDecoder).  Returns lprobs.
        """
        if not (logits_finite and self.temperature >= 1.0):
            lprobs.masked_fill_(torch.isnan(lprobs), -math.inf)
        lprobs[:, self.pad] = -math.inf
        if self.unk_penalty != 0:  # x - 0.0 == x: stock's subtraction changes nothing then
            lprobs[:, self.unk] -= self.unk_penalty
        self._only_eos_at_max_len(lprobs, at, max_len)
        in_prefix = self._force_prefix(lprobs, at, max_len, prefix_tokens, beam)
        if in_prefix is True:  # stock: no min-len ban nor suppression on prefix steps
            return lprobs
        free = None if in_prefix is False else ~in_prefix
        self._ban_early_eos(lprobs, at, free)
        self._suppress(lprobs, free)
        return lprobs

    def _only_eos_at_max_len(self, lprobs: Tensor, at: StepAt, max_len: int) -> None:
        if at.limits is None and at.lo >= max_len:  # every row at the limit: stock's slices
            lprobs[:, : self.eos] = -math.inf
            lprobs[:, self.eos + 1:] = -math.inf
        elif at.hi >= max_len or at.limits is not None:
            at_max = at.steps >= (max_len if at.limits is None else at.limits)
            if bool(at_max.any()):
                idx = at_max.nonzero().squeeze(1)
                keep = lprobs[idx, self.eos].clone()
                lprobs[idx] = -math.inf
                lprobs[idx, self.eos] = keep

    def _force_prefix(self, lprobs: Tensor, at: StepAt, max_len: int,
                      prefix_tokens: Optional[Tensor], beam: int) -> Union[bool, Tensor]:
        """Rows at a prefix step keep only their prefix token (pad in the prefix: free).
        Returns whether rows are at a prefix step: True/False for all rows, or (m,) bool.
        With ``at.limits``, ``max_len`` only gates (the largest limit)."""
        if prefix_tokens is None or at.lo >= prefix_tokens.size(1) or at.lo >= max_len:
            return False
        plen = prefix_tokens.size(1)
        if at.steps is None:
            ptok = prefix_tokens[:, at.lo].unsqueeze(-1).repeat(1, beam).view(-1)
            in_prefix = True
        else:
            rows = prefix_tokens if at.rows is None else prefix_tokens.index_select(0, at.rows)
            ptok = rows.gather(1, at.steps.clamp(max=plen - 1).unsqueeze(1)).squeeze(1)
            in_prefix = (at.steps < plen) & (
                at.steps < (max_len if at.limits is None else at.limits))
        forced = ptok.ne(self.pad)
        if in_prefix is not True:
            forced &= in_prefix
        # stock's _prefix_tokens, operation for operation
        prefix_lprobs = lprobs.gather(-1, ptok.unsqueeze(-1))
        lprobs[forced] = torch.tensor(-math.inf).to(lprobs)
        lprobs[forced] = lprobs[forced].scatter(-1, ptok[forced].unsqueeze(-1), prefix_lprobs[forced])
        return in_prefix

    def _ban_early_eos(self, lprobs: Tensor, at: StepAt, free: Optional[Tensor]) -> None:
        if at.lo >= self.min_len:
            return
        if at.steps is None:
            lprobs[:, self.eos] = -math.inf
            return
        ban = at.steps < self.min_len
        if free is not None:
            ban &= free
        if bool(ban.any()):
            lprobs[ban.nonzero().squeeze(1), self.eos] = -math.inf

    def _suppress(self, lprobs: Tensor, free: Optional[Tensor]) -> None:
        if self.suppress is None:
            return
        if free is None:
            lprobs[:, self.suppress] = -math.inf
        else:
            idx = free.nonzero()  # (k, 1): broadcast against the suppressed indices
            lprobs[idx, self.suppress.to(lprobs.device).unsqueeze(0)] = -math.inf

    # ---- the repeated n-gram ban -----------------------------------------------------

    def ngram_ban_applies(self, hi: int) -> bool:
        """Whether a row at step ``hi`` (or below) can have an n-gram to ban."""
        return self.blocker is not None and hi - self.blocker.no_repeat_ngram_size + 2 > 0

    def ban_repeats(self, lprobs: Tensor, at: StepAt, history: Tensor, bsz: int = 0,
                    beam: int = 1) -> Tensor:
        """The n-gram ban, through the blocker.  history: (m, W) int64 hypotheses of the
        lprobs rows (BOS first; read up to each row's step).  Uniform: fairseq's blocker
        call ``blocker(tokens, lprobs, bsz, beam, step)`` (any blocker); per-row steps:
        ``blocker.ban_ragged`` (:class:`~fairseq_fastgen.search.ngram_blocker.NGramBlocker`).
        Returns lprobs."""
        if self.blocker is None:
            return lprobs
        if at.steps is None:
            return self.blocker(history, lprobs, bsz, beam, at.lo)
        return self.blocker.ban_ragged(history, at.steps, lprobs, max_step=at.hi)
