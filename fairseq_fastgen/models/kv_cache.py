"""Preallocated self-attention key/value cache, appended and reordered in place.

Layout is time-major, ``(capacity, n, C)``: the valid prefix ``[:t]`` of the buffer is
contiguous, so a beam reorder is one ``index_select(..., out=)`` into a second buffer
(double buffering) and appending a step is one row copy.  fairseq instead re-allocates
the whole cache twice per step (``index_select`` in ``reorder_incremental_state`` and
``torch.cat`` in attention).  Attention reads the prefix as a strided
``(n*heads, t, head_dim)`` view; batched GEMM on it gives the same bits as on a
contiguous copy.
"""
from typing import Tuple

import torch
from torch import Tensor


class KVCache:
    """Keys and values of one self-attention layer for ``n`` hypotheses."""

    def __init__(self, n: int, dim: int, max_steps: int, device, dtype, preallocate=True,
                 initial: int = 64):
        self.dim = dim
        self.max_steps = max_steps
        self.preallocate = preallocate
        cap = min(max_steps, initial) if preallocate else 0
        self.k = torch.empty(cap, n, dim, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self._spare_k = self._spare_v = None
        self.t = 0

    def append(self, k: Tensor, v: Tensor, rep: int = 1) -> Tuple[Tensor, Tensor]:
        """Add this step's k, v: (n, C), or (n / rep, C) rows each repeated ``rep`` times.
        Returns all keys and values so far of the given rows: (t+1, n / rep, C)."""
        if rep > 1:
            k = k.unsqueeze(1).expand(-1, rep, -1).reshape(-1, self.dim)
            v = v.unsqueeze(1).expand(-1, rep, -1).reshape(-1, self.dim)
            keys, values = self.append(k, v)
            return keys[:, ::rep], values[:, ::rep]
        if not self.preallocate:
            # Ablation path: grow by concatenation, as fairseq does.
            self.k = torch.cat([self.k, k.unsqueeze(0)], 0)
            self.v = torch.cat([self.v, v.unsqueeze(0)], 0)
            self.t += 1
            return self.k, self.v
        if self.t == self.k.size(0):
            self._grow()
        self.k[self.t].copy_(k)
        self.v[self.t].copy_(v)
        self.t += 1
        return self.k[: self.t], self.v[: self.t]

    def reorder(self, order: Tensor) -> None:
        """Row i of the cache becomes old row order[i]; order: (n_new,) int64."""
        t = self.t
        if not self.preallocate:
            self.k = self.k.index_select(1, order)
            self.v = self.v.index_select(1, order)
            return
        n_new = order.numel()
        cap = self.k.size(0)
        if self._spare_k is None or self._spare_k.shape[:2] != (cap, n_new):
            self._spare_k = self.k.new_empty(cap, n_new, self.dim)
            self._spare_v = self.v.new_empty(cap, n_new, self.dim)
        torch.index_select(self.k[:t], 1, order, out=self._spare_k[:t])
        torch.index_select(self.v[:t], 1, order, out=self._spare_v[:t])
        self.k, self._spare_k = self._spare_k, self.k
        self.v, self._spare_v = self._spare_v, self.v

    def _grow(self) -> None:
        cap = min(self.max_steps, max(2 * self.k.size(0), 1))
        if cap <= self.k.size(0):
            cap = self.k.size(0) + 1  # past the length limit only in prefix/forced decoding
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(cap, old.size(1), self.dim)
            new[: self.t].copy_(old[: self.t])
            setattr(self, name, new)
        self._spare_k = self._spare_v = None
