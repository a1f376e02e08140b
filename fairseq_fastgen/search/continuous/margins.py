"""The margin guard: which sentences a GEMM kernel that rounds otherwise than stock's may
have decoded otherwise, so that they are decoded again with stock's kernel.

oneDNN's GEMMs (models/gemm_kernel.py) sum in another order than MKL's, so every
log-probability may move by a few units in the last places: on the bundled models a
candidate's cumulative score moved by up to 6e-5 against the MKL run, and the difference
between two candidates of one step by up to 4.8e-5 (512 kjv->web sentences, beam 5,
benchmarks/results/NOTES.md, "Margin guard").  Beam search is a sequence of comparisons,
and the output changes only where one of them comes out the other way.

Why a step decided as stock would (given a bound ``margin`` on how far the difference of
two candidates' scores can move): a step's outcome, as ``SequenceGenerator._generate``
computes it from the candidates best first, is which candidates are finalized (eos among
the first k positions, in order, while the sentence has fewer than k hypotheses) and
which become the next hypotheses (the first k that are not eos or ignored, then the
rest).  Give each candidate its role: finalized, taken, or neither (taken counts only
if the sentence goes on); the beam step assigns the roles as it decides (beams.py and its
C++ twin), so they are computed once.  Sorting is a sequence of swaps of neighbours; swapping two of
one role changes no role (the order among finalized hypotheses is sorted away at the
end, and the order of the next hypotheses matters only through exact ties, which are
neighbours closer than any margin).  So if every pair of neighbours of different roles
is at least ``margin`` apart, the reference kernel orders them the same and the step's
outcome is stock's.  ``ignore`` is positional (fairseq masks the first k *positions*),
so a slot with an ignored position checks all its neighbours.  The last pair needs the
best candidate after the 2k that decide: the caller asks for 2k + 1.  Two -inf
neighbours are the same bans either way and are skipped.  The finished hypotheses are
then sorted by score: neighbours there must be ``margin / min(len)**lenpen`` apart
(normalized scores move by the cumulative score's move over the length penalty).

A sentence none of whose comparisons was tight is stock's (up to the scores' last
places); one with a tight comparison is decoded again on MKL (engine.py), so the output
is that of the reference kernel everywhere.  The bound is measured, not proven, and for
the model and machine at hand: each engine decodes its first batch on both kernels
(engine.py; that batch's output is MKL's) and sets the margin to ``--fastgen-tune
margin_guard`` (8) times the largest move seen there (:func:`calibrated`), logged once;
every 64th batch of the run is decoded on both kernels again (stream.py, its output MKL's)
and the margin grows where its moves ask for more (:func:`rechecked`, logged).
Why 8: a comparison of two candidates moves by up to twice one score's move, and over all
batches of the bundled models the largest move was up to 1.75x the first batch's
(benchmarks/margin_calibration.py; this leaves 2.3x on top).
"""
import logging
from typing import List, Optional, Tuple

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

_NEG_INF = float("-inf")
# the margin grows with the scores: margin * (1 + |score| / SCORE_SCALE) (a score's last
# places grow with it; measured moves: 1.2e-5 at |score| 1, 2.7e-5 at 10, 1.1e-4 at 100)
SCORE_SCALE = 25.0


def tight_slots(roles: Tensor, cand_scores: Tensor, ignored: Tensor, goes_on: Tensor,
                margin: float) -> Tensor:
    """Slots whose step compared two candidates of different roles closer than ``margin``
    (see the module doc).

    roles: (s, 2k) int8, each deciding candidate's role as the beam step assigned it
    (bits: 1 finalized, 2 taken; beams.SlotBeams, csrc/slot_beams.cpp); cand_scores: (s,
    W) float, best first, W = 2k or 2k + 1 (the best candidate after the 2k, role none);
    ignored: (s,) bool, slots with an ignored position before the step; goes_on: (s,)
    bool, slots that continue after it (a taken candidate counts only then).
    Returns (s,) bool.
    """
    s, decide = roles.shape
    taken = (roles & 2).ne(0) & goes_on.unsqueeze(1)
    role = torch.zeros(cand_scores.shape, dtype=torch.int8, device=cand_scores.device)
    role[:, :decide] = torch.where(taken, 2, roles & 1).to(torch.int8)
    relevant = role[:, :-1].ne(role[:, 1:]) | ignored.unsqueeze(1)
    left, right = cand_scores[:, :-1], cand_scores[:, 1:]
    close = left.ne(_NEG_INF) & (left - right).lt(margin * (1 + right.abs() / SCORE_SCALE))
    return (relevant & close).any(1)


def tight_finals(fin_score: Tensor, fin_len: Tensor, fin_count: Tensor, margin: float,
                 len_penalty: Optional[float]) -> Tensor:
    """Sentences whose finished hypotheses, sorted by score, have two neighbours closer
    than ``margin / min(len) ** len_penalty`` (None: scores not normalized).

    fin_score: (d, k) float (positions past fin_count unused); fin_len: (d, k) int64;
    fin_count: (d,) int64.  Returns (d,) bool."""
    d, k = fin_score.shape
    if d == 0 or k < 2:
        return torch.zeros(d, dtype=torch.bool, device=fin_score.device)
    used = torch.arange(k, device=fin_score.device).unsqueeze(0) < fin_count.unsqueeze(1)
    score = torch.where(used, fin_score.double(), torch.full_like(fin_score, _NEG_INF).double())
    score, order = torch.sort(score, dim=1, descending=True)
    length = fin_len.gather(1, order).double().clamp(min=1)
    scale = length.pow(len_penalty) if len_penalty is not None else torch.ones_like(length)
    low = torch.minimum(scale[:, :-1], scale[:, 1:])
    right = score[:, 1:]
    bound = margin * (1 + right.abs() * low / SCORE_SCALE) / low
    left = score[:, :-1]
    close = left.ne(_NEG_INF) & (left - right).lt(bound)
    return close.any(1)


def candidates_wanted(beam: int, vocab: int) -> int:
    """Candidates per slot the guard asks for: the 2k that decide, and the next one where
    the vocabulary has it (a first step draws on one hypothesis's words only)."""
    return 2 * beam + 1 if 2 * beam + 1 <= vocab else 2 * beam



class MarginGuard:
    """One engine run's record of the slots whose sentence compared two candidates
    within the margin (slot-indexed like the run's slots; compacted with them)."""

    def __init__(self, margin: float, len_penalty: Optional[float], device):
        """len_penalty: the final scores' length penalty (None: not normalized)."""
        self.margin = margin
        self.len_penalty = len_penalty
        self.tight = torch.zeros(0, dtype=torch.bool, device=device)  # (slots,)

    def admit(self, slots: Tensor, n: int) -> None:
        """Slots (m,) of ``n`` in all start new sentences."""
        if self.tight.numel() < n:
            grown = torch.zeros(n, dtype=torch.bool, device=self.tight.device)
            grown[: self.tight.numel()] = self.tight
            self.tight = grown
        self.tight[slots] = False

    def step(self, tight: Tensor) -> None:
        """tight: (s,) bool, this step's :func:`tight_slots` of the first s slots."""
        self.tight[: tight.numel()] |= tight

    def compact(self, keep: Tensor) -> None:
        self.tight = self.tight.index_select(0, keep)

    def finished(self, done: Tensor, fin_score: Tensor, fin_len: Tensor,
                 fin_count: Tensor) -> List[bool]:
        """For the done slots (d,): whether their sentence is to be decoded again (a tight
        step, or finished hypotheses too close); the fin_* tensors are all slots'."""
        finals = tight_finals(fin_score.index_select(0, done), fin_len.index_select(0, done),
                              fin_count.index_select(0, done), self.margin, self.len_penalty)
        return (self.tight.index_select(0, done) | finals).tolist()


# the smallest calibrated margin: a few units in the last place of an fp32 score near 1
FLOOR = 2.0 ** -20


def score_move(reference: List[list], other: List[list]) -> Tuple[float, int, int]:
    """(largest move, best hypotheses that differ, hypotheses compared) between two
    decodings of the same sentences (``SequenceGenerator.generate``'s lists): the largest
    move of a cumulative score over the hypotheses whose tokens agree, relative as
    :func:`tight_slots` bounds it (``|a - b| / (1 + |b| / SCORE_SCALE)``).  Run once per
    engine: a Python loop over one batch's hypotheses."""
    move, flips, seen = 0.0, 0, 0
    for ref_hyps, hyps in zip(reference, other):
        flips += bool(ref_hyps and hyps) and not torch.equal(ref_hyps[0]["tokens"], hyps[0]["tokens"])
        for a, b in zip(ref_hyps, hyps):
            if a["tokens"].shape != b["tokens"].shape or not torch.equal(a["tokens"], b["tokens"]):
                continue
            ca = a["positional_scores"].double().cumsum(0)
            cb = b["positional_scores"].double().cumsum(0)
            ok = ca.isfinite() & cb.isfinite()
            rel = (ca - cb).abs() / (1 + cb.abs() / SCORE_SCALE)
            move = max(move, float(rel[ok].max()) if bool(ok.any()) else 0.0)
            seen += 1
    return move, flips, seen


def calibrated(reference: List[list], other: List[list], multiple: float) -> float:
    """The margin: ``multiple`` times :func:`score_move` between a batch decoded on MKL
    (``reference``) and on oneDNN (``other``), at least :data:`FLOOR`; logged once."""
    move, flips, seen = score_move(reference, other)
    margin = max(multiple * move, FLOOR)
    logger.info("fairseq-fastgen: margin guard calibrated on %d sentences (%d hypotheses "
                "alike): largest score move between MKL and oneDNN %.3g (relative to 1 + "
                "|score| / %g), margin %.3g = %g x that (at least %.3g)%s", len(reference),
                seen, move, SCORE_SCALE, margin, multiple, FLOOR,
                f"; {flips} best hypotheses already differed" if flips else "")
    return margin


def rechecked(reference: List[list], other: List[list], multiple: float, margin: float) -> float:
    """The margin after a re-check batch (decoded on MKL, ``reference``, and on oneDNN,
    ``other``): ``multiple`` times its largest score move where that is more than
    ``margin`` (logged), else ``margin``."""
    move, flips, _ = score_move(reference, other)
    if multiple * move <= margin:
        return margin
    logger.info("fairseq-fastgen: margin guard re-checked on %d sentences: score move %.3g, "
                "margin raised from %.3g to %.3g%s", len(reference), move, margin,
                multiple * move, f"; {flips} best hypotheses differed" if flips else "")
    return multiple * move
