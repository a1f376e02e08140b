"""MKL's packed-weight GEMM for the decoder projections, one packed weight per row count.

At the few rows of a decoder step (a small batch's beams, a batch's tail) MKL runs
``addmm(b, x, Wt)`` far from its peak, and with two threads hardly faster than with one.
With the weight packed in advance for the exact row count (``cblas_sgemm_pack``, reached
through ``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, the kernels
inductor uses for frozen fp32 linears) the same product ran 1.1-1.3x faster on the
project's 2-core Intel Xeon, and generation in one process 1.05-1.15x faster at batch 8
(two runs; see benchmarks/results/NOTES.md, "Packed GEMM").

A packed weight serves only the row count it was packed for (MKL falls back to a plain
GEMM otherwise) and costs about one copy of the weight, so :class:`RowPacks` packs a row
count only once it has been used ``PACK_AFTER`` times, keeps at most ``max_packs`` of them
and replaces the least used one only by a row count used twice as often.  Every projection
of a decoder sees the same row counts, so all make the same choices without sharing state.

With one torch thread (each decoding worker's) the packed GEMMs gained nothing (0.89-1.05x
at the layer shapes), so they serve only steps run on two threads or more.

Another GEMM kernel may round the last bit differently: a lossless-mode optimization,
fp32 on CPU only.
"""
from typing import Dict, Optional

import torch
from torch import Tensor

PACK_AFTER = 4  # uses of a row count before it is packed: a pack costs ~2-3 small GEMMs


def available() -> bool:
    """Whether this torch build has MKL's packed GEMM ops."""
    mkl = getattr(torch.ops, "mkl", None)
    return (torch.backends.mkl.is_available() and mkl is not None
            and hasattr(mkl, "_mkl_linear") and hasattr(mkl, "_mkl_reorder_linear_weight"))


def max_packs(budget_mb: int, weights_bytes: int) -> int:
    """Row counts a decoder may pack within ``budget_mb`` MiB when one row count costs
    ``weights_bytes`` (the decoder's projection weights, each packed once)."""
    if budget_mb <= 0 or weights_bytes <= 0 or not available():
        return 0
    return int(budget_mb * 2 ** 20 // weights_bytes)


class RowPacks:
    """Packed copies of one projection's weight, by row count."""

    def __init__(self, max_packs: int):
        self.max_packs = max_packs
        self.uses: Dict[int, int] = {}
        self.packs: Dict[int, Tensor] = {}

    def clear(self) -> None:
        """Forget the packs (the weight changed); the use counts stay."""
        self.packs = {}

    def linear(self, x: Tensor, wt: Tensor, bias: Optional[Tensor]) -> Optional[Tensor]:
        """``addmm(bias, x, wt)`` through a packed weight: x (rows, in) float32 on CPU,
        wt (in, out) contiguous; None where this row count is not packed (the caller
        runs its plain GEMM)."""
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return None
        packed = self.pack_for(x.size(0), wt)
        if packed is None:
            return None
        w = wt.t()  # (out, in): the op reads only its shape (its fallback is never taken)
        return torch.ops.mkl._mkl_linear(x.contiguous(), packed, w, bias, x.size(0))

    def pack_for(self, m: int, wt: Tensor) -> Optional[Tensor]:
        """The packed weight for a GEMM of ``m`` rows by wt (in, out) float32 on CPU,
        counting this use (it may pack now); None: run the plain GEMM."""
        if self.max_packs <= 0:
            return None
        if torch.get_num_threads() < 2:
            # measured: with one thread the packed layer GEMMs ran 0.89-1.05x the plain
            # ones (decoding workers run one thread each)
            return None
        packed = self.packs.get(m)
        if packed is None:
            return self._admit(m, wt)
        self.uses[m] += 1
        return packed

    def _admit(self, m: int, wt: Tensor) -> Optional[Tensor]:
        n = self.uses.get(m, 0) + 1
        self.uses[m] = n
        if n < PACK_AFTER or m == 0:
            return None
        if len(self.packs) >= self.max_packs:
            victim = min(self.packs, key=self.uses.__getitem__)
            if n <= 2 * self.uses[victim]:  # hysteresis: no thrashing between two counts
                return None
            del self.packs[victim]
        with torch.no_grad():
            packed = torch.ops.mkl._mkl_reorder_linear_weight(wt.t().contiguous(), m)
        self.packs[m] = packed
        return packed
