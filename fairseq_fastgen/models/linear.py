"""Decoder projections through contiguous transposed copies of their weights.

``nn.Linear`` computes ``x @ W.T`` with ``W`` stored (out, in): BLAS reads the transposed
operand, and at the few rows of a decoder step (a sentence's beam, a small batch, the
tail of a batch whose sentences finished) MKL runs that 1.3-1.8x slower than the same
product with ``W.T`` stored contiguously (``addmm(b, x, Wt)``; measured in
benchmarks/results/small_gemm.md).  Another GEMM kernel may round the last bit
differently, so this is a lossless-mode optimization; bitwise mode calls the modules.

The copies cost one extra set of decoder weights in memory and are rebuilt whenever a
weight changes (``params_key``: ``fairseq-train --eval-bleu`` trains between validations).
"""
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor, nn

from .padded_projection import params_key


class TransposedLinear:
    """Callable ``(rows, in) -> (rows, out)`` equal to ``torch.cat([l(x) for l in linears], -1)``
    up to GEMM rounding: several linears of the same input (q/k/v) become one GEMM."""

    def __init__(self, linears: Sequence[nn.Linear]):
        self.linears = list(linears)
        self._key: Optional[tuple] = None
        self.wt: Optional[Tensor] = None  # (in, sum(out)) contiguous
        self.bias: Optional[Tensor] = None

    @staticmethod
    def usable(linears: Sequence[nn.Module]) -> bool:
        """Plain nn.Linear modules whose biases are all present or all absent."""
        if not all(type(l) is nn.Linear for l in linears):
            return False
        return len({l.bias is None for l in linears}) == 1

    def refresh(self) -> None:
        ps = [p for l in self.linears for p in (l.weight, l.bias)]
        key = params_key(*ps)
        if key == self._key:
            return
        with torch.no_grad():
            w = torch.cat([l.weight for l in self.linears]) if len(self.linears) > 1 \
                else self.linears[0].weight
            self.wt = w.t().contiguous()
            self.bias = None
            if self.linears[0].bias is not None:
                self.bias = torch.cat([l.bias for l in self.linears]).contiguous()
        self._key = key

    def __call__(self, x: Tensor) -> Tensor:
        """x: (rows, in) float."""
        if self.bias is None:
            return torch.mm(x, self.wt)
        return torch.addmm(self.bias, x, self.wt)


def projection(linears: Sequence[nn.Module], transposed: bool) -> Callable[[Tensor], Tensor]:
    """One callable for ``linears`` applied to the same input and concatenated: a
    :class:`TransposedLinear` when ``transposed`` and usable, else the modules themselves
    (in bitwise mode: exactly stock's GEMMs)."""
    if transposed and TransposedLinear.usable(linears):
        return TransposedLinear(linears)
    if len(linears) == 1:
        return linears[0]
    return lambda x: torch.cat([l(x) for l in linears], dim=-1)


def refresh_all(projections: List[Callable]) -> None:
    for p in projections:
        if isinstance(p, TransposedLinear):
            p.refresh()
