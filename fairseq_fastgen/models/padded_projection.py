"""Output projection with the vocabulary dimension padded for the BLAS.

A vocabulary of, say, 6,003 words can make the (rows, C) x (C, V) output projection run
at about half the speed of the same GEMM with V a multiple of 64 (MKL on AVX2; see
benchmarks/results/NOTES.md, "Padded output projection").  This module
keeps a zero-padded copy of the weight, and a bias whose padding columns are -inf, and
returns the (rows, Vp) product: the first V columns are the logits, computed by a
differently blocked GEMM (equal in most shapes, within float rounding otherwise, so a
lossless-mode optimization only, off in bitwise mode); the padding columns are -inf, so
log_softmax over the whole contiguous row gives the same distribution (they add exact
zeros to the sum) and the caller slices ``[..., :V]`` afterwards.  Slicing the logits
before log_softmax instead would make log_softmax copy a strided input, losing most of
the gain.

The copy costs one extra output embedding in memory; it is rebuilt whenever the model's
weight changes (``fairseq-train --eval-bleu`` trains between validations), detected by
the tensor's version counter and storage pointer.
"""
import copy
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from . import gemm_kernel
from .packed_gemm import RowPacks

PAD_MULTIPLE = 64


def params_key(*params: Optional[Tensor]) -> tuple:
    """Changes whenever any of ``params`` is updated in place (version counter) or replaced
    (storage pointer): the key of caches derived from model weights."""
    return tuple(None if p is None else (p._version, p.data_ptr()) for p in params)


class PaddedProjection:
    """Callable ``(rows, C) -> (rows, Vp)``: ``linear(x)`` up to GEMM rounding, then -inf."""

    def __init__(self, linear: nn.Linear, multiple: int = PAD_MULTIPLE, max_packs: int = 0,
                 onednn: bool = False):
        """max_packs: row counts whose GEMM may run on a packed weight (0: none; see
        :mod:`~fairseq_fastgen.models.packed_gemm`); onednn: the GEMM runs on oneDNN
        (:mod:`~fairseq_fastgen.models.gemm_kernel`; then no packs)."""
        self.linear = linear
        self.multiple = multiple
        self.onednn = onednn
        self.packs = RowPacks(0 if onednn else max_packs)
        self._key: Optional[tuple] = None
        self._wt: Optional[Tensor] = None  # (C, Vp) contiguous
        self._bias: Optional[Tensor] = None  # (Vp,): the linear's bias, then -inf
        self._base: Optional["PaddedProjection"] = None  # a twin's original (with_kernel)

    @staticmethod
    def worthwhile(linear: nn.Module, multiple: int = PAD_MULTIPLE) -> bool:
        """Only a plain nn.Linear whose output size is not already aligned."""
        return isinstance(linear, nn.Linear) and linear.out_features % multiple != 0

    def padded_size(self) -> int:
        """Vp: the output width, the vocabulary rounded up to the multiple."""
        v = self.linear.out_features
        return -(-v // self.multiple) * self.multiple

    def usable(self) -> bool:
        """CPU BLAS only: cuBLAS has no such cliff, and CUDA n-gram kernels index the
        log-probabilities as a contiguous (rows, V) buffer."""
        return self.linear.weight.device.type == "cpu"

    def with_kernel(self, onednn: bool) -> "PaddedProjection":
        """This projection on the other kernel, sharing its padded copy (no packs)."""
        if onednn == self.onednn:
            return self
        twin = copy.copy(self)
        twin.onednn = onednn
        twin.packs = RowPacks(0)
        twin._base = self  # one padded copy: the twin reads the original's
        return twin

    def refresh(self) -> None:
        """Rebuild the padded copy now if the weight changed (else on the next call)."""
        self._padded()

    def __call__(self, x: Tensor) -> Tensor:
        """x: (rows, C) float; returns (rows, Vp) contiguous: logits, then -inf columns."""
        wt, bias = self._padded()
        out = gemm_kernel.linear(x, wt, bias) if self.onednn and gemm_kernel.usable(x) \
            else self.packs.linear(x, wt, bias)
        if out is not None:
            if bias is None:
                out[:, self.linear.out_features:] = float("-inf")
            return out
        if bias is None:
            # zero weight columns give 0, overwritten by -inf: cheaper than addmm's
            # broadcast copy of a (Vp,) bias into the whole output
            out = torch.mm(x, wt)
            out[:, self.linear.out_features:] = float("-inf")
            return out
        return torch.addmm(bias, x, wt)

    def _padded(self) -> Tuple[Tensor, Optional[Tensor]]:
        if self._base is not None:
            return self._base._padded()
        w, b = self.linear.weight, self.linear.bias
        key = params_key(w, b)
        if key != self._key:
            with torch.no_grad():
                v, c = w.shape
                vp = -(-v // self.multiple) * self.multiple
                wt = w.new_zeros(c, vp)
                wt[:, :v] = w.t()
                self._wt = wt
                self._bias = None
                if b is not None:
                    self._bias = b.new_full((vp,), float("-inf"))
                    self._bias[:v] = b
            self.packs.clear()
            self._key = key
        return self._wt, self._bias
