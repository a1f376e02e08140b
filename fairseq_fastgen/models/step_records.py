"""What the decoder step (:mod:`~fairseq_fastgen.models.slot_decoder`) takes and returns."""
from typing import NamedTuple, Optional

from torch import Tensor


class StepOutput(NamedTuple):
    """lprobs: (n, V) float32 log-probabilities; attn: (n, S) head-averaged
    cross-attention or None; logits_finite: the logits were proven finite (then lprobs
    has no NaN unless temperature < 1)."""
    lprobs: Tensor
    attn: Optional[Tensor]
    logits_finite: bool


class Queries(NamedTuple):
    """Where a pass's queries sit: n rows of L queries; pos: (n*L,) int64 each query's
    position, or None: every row's one query at ``t_max``; rows: (n*L,) int64 its row
    (None with pos);
    t_max: the last key position read; mask: (n, 1, L, t_max+1) bool, True where a key
    is hidden from a query (None: nothing hidden)."""
    n: int
    L: int
    pos: Optional[Tensor]
    rows: Optional[Tensor]
    t_max: int
    mask: Optional[Tensor]


class BlockOutput(NamedTuple):
    """scores: (m, V') logits, or log-probabilities when asked (V' >= the vocabulary,
    columns past it -inf); logits_finite: the logits were proven finite."""
    scores: Tensor
    logits_finite: bool
