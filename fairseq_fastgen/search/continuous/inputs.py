"""The engine's input and its bookkeeping: a feed of batches, the batches in flight
(their sentences' results as they finish) and the sentences waiting for a slot."""
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from torch import Tensor


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
class Batch:
    """One input batch in flight: its sample and its sentences' results."""
    sample: Dict[str, Any]
    hypos: List[Optional[list]]
    remaining: int
    prefix: Optional[Tensor] = None  # (bsz, P) int64
    redo: List[int] = field(default_factory=list)  # sentences the margin guard sends back
    encoder_outs: Optional[list] = None  # kept for a second decoding (margin guard)
    cross: list = field(default_factory=list)  # per model: per layer projected keys/values
    max_len: int = 0
    src_len: Optional[Tensor] = None  # (bsz,)
    # margin guard: a batch that re-checks the margin is decoded on both kernels; its
    # oneDNN hypotheses, kept for the comparison (its output is MKL's)
    other: Optional[List[Optional[list]]] = None


@dataclass
class Pending:
    batch: Batch
    index: int  # sentence within its batch


def by_batch(take: List[Pending], slots: List[int]):
    """Group admitted sentences by batch: (batch, (indices, slots))."""
    groups: Dict[int, Tuple[Batch, Tuple[List[int], List[int]]]] = {}
    for p, s in zip(take, slots):
        g = groups.setdefault(id(p.batch), (p.batch, ([], [])))
        g[1][0].append(p.index)
        g[1][1].append(s)
    return list(groups.values())
