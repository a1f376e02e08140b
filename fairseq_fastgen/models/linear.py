"""Decoder projections through contiguous transposed copies of their weights.

``nn.Linear`` computes ``x @ W.T`` with ``W`` stored (out, in): BLAS reads the transposed
operand, and at the few rows of a decoder step (a sentence's beam, a small batch, the
tail of a batch whose sentences finished) MKL can run that markedly slower than the same
product with ``W.T`` stored contiguously (``addmm(b, x, Wt)``; see
benchmarks/results/NOTES.md, "Transposed weight copies").  Another GEMM kernel may round the last bit
differently, so this is a lossless-mode optimization; bitwise mode calls the modules.

The copies cost one extra set of decoder weights in memory and are rebuilt whenever a
weight changes (``params_key``: ``fairseq-train --eval-bleu`` trains between validations).
"""
import copy
from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor, nn

from . import gemm_kernel
from .packed_gemm import RowPacks
from .padded_projection import params_key


class TransposedLinear:
    """Callable ``(rows, in) -> (rows, out)`` equal to ``torch.cat([l(x) for l in linears], -1)``
    up to GEMM rounding: several linears of the same input (q/k/v) become one GEMM."""

    def __init__(self, linears: Sequence[nn.Linear], max_packs: int = 0, onednn: bool = False):
        """max_packs: row counts whose GEMM may run on a packed weight (0: none; see
        :mod:`~fairseq_fastgen.models.packed_gemm`); onednn: the GEMM runs on oneDNN
        (:mod:`~fairseq_fastgen.models.gemm_kernel`; then no packs)."""
        self.linears = list(linears)
        self.onednn = onednn
        self.packs = RowPacks(0 if onednn else max_packs)
        self._key: Optional[tuple] = None
        self.wt: Optional[Tensor] = None  # (in, sum(out)) contiguous
        self.bias: Optional[Tensor] = None
        self._base: Optional["TransposedLinear"] = None  # a twin's original (with_kernel)

    @staticmethod
    def usable(linears: Sequence[nn.Module]) -> bool:
        """Plain nn.Linear modules whose biases are all present or all absent."""
        if not all(type(l) is nn.Linear for l in linears):
            return False
        return len({l.bias is None for l in linears}) == 1

    def refresh(self) -> None:
        if self._base is not None:
            self._base.refresh()
            self.wt, self.bias, self._key = self._base.wt, self._base.bias, self._base._key
            return
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
        self.packs.clear()
        self._key = key

    def with_kernel(self, onednn: bool) -> "TransposedLinear":
        """This projection on the other kernel, sharing its weight copy (no packs)."""
        if onednn == self.onednn:
            return self
        twin = copy.copy(self)
        twin.onednn = onednn
        twin.packs = RowPacks(0)
        twin._base = self  # one weight copy: the twin re-reads the original's
        return twin

    def __call__(self, x: Tensor) -> Tensor:
        """x: (rows, in) float."""
        if self.onednn and gemm_kernel.usable(x):
            return gemm_kernel.linear(x, self.wt, self.bias)
        out = self.packs.linear(x, self.wt, self.bias)
        if out is not None:
            return out
        if self.bias is None:
            return torch.mm(x, self.wt)
        return torch.addmm(self.bias, x, self.wt)


def projection(linear: nn.Module, max_packs: int = 0, onednn: bool = False
               ) -> Callable[[Tensor], Tensor]:
    """``linear`` as a callable: a :class:`TransposedLinear` copy where usable, else the
    module itself."""
    if TransposedLinear.usable([linear]):
        return TransposedLinear([linear], max_packs, onednn)
    return linear


def with_kernel(p: Optional[Callable], onednn: bool) -> Optional[Callable]:
    """A :func:`projection` on the other kernel (a module itself stays as it is)."""
    return p.with_kernel(onednn) if isinstance(p, TransposedLinear) else p


def refresh_all(projections: List[Callable]) -> None:
    for p in projections:
        if isinstance(p, TransposedLinear):
            p.refresh()
