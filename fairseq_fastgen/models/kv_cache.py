"""Preallocated self-attention key/value cache, appended and reordered in place.

Layout is time-major, ``(capacity, n, C)``: the valid prefix ``[:t]`` of the buffer is
contiguous, so a beam reorder is one ``index_select(..., out=)`` into a spare buffer and
appending a step is one row copy.  fairseq instead re-allocates the whole cache twice per
step (``index_select`` in ``reorder_incremental_state`` and ``torch.cat`` in attention).
Attention reads the prefix as a strided ``(n*heads, t, head_dim)`` view whose strides do
not depend on the capacity; batched GEMM on it gives the same bits as on a contiguous copy.

With the native step's ancestor-indexed attention (``ancestor_kv``, on by default)
the caches are only appended to: :class:`~fairseq_fastgen.models.fast_decoder.FastDecoder`
keeps which row of each step holds each hypothesis's keys/values and never calls
:meth:`KVCache.reorder`.

Memory: the layers of a decoder share one spare pair, handed from layer to layer by
:meth:`KVCache.reorder` (the buffers a layer leaves are the next layer's spare), so L
layers hold 2L + 2 buffers, not 4L.  The first capacity comes from the caller (the source
length and a margin, see :func:`first_capacity`) and grows by 1.25x, instead of 64
positions doubling: at beam 5, batch 64 a worker held ~250 MB of mostly unused cache at 20-token
sentences (benchmarks/results/long_memory.md).

A batch's caches take over the previous batch's buffers when they are large enough
(``reuse``): a fresh multi-megabyte buffer is mapped by the allocator and every page of it
faults on its first write, which made the per-step cache writes 20% of the C++ layer time
at batch 64 (see benchmarks/results/NOTES.md, "KV buffers kept across batches").  So a
decoder keeps its largest batch's cache memory between batches (never more than that
batch's own peak).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

Spare = Optional[Tuple[Tensor, Tensor]]  # (k, v) buffers of any shape, reused by numel

GROWTH = 1.25  # a growth copies the prefix once; every reorder copies it anyway
MARGIN = 16  # positions past the source length a first buffer holds, and the least growth


def first_capacity(src_len: Optional[int], max_steps: int) -> int:
    """Positions to allocate for a batch: the source length plus a margin (translation
    and rewriting output is usually near it), or 64 when there is no source."""
    want = 64 if src_len is None else src_len + MARGIN
    return max(1, min(max_steps, want))


def _fit(buf: Tensor, shape) -> Optional[Tensor]:
    """A contiguous view of ``buf``'s memory with ``shape``, if it is large enough."""
    need = shape[0] * shape[1] * shape[2]
    if buf.numel() < need or not buf.is_contiguous():
        return None
    return buf.view(-1)[:need].view(shape)


class KVCache:
    """Keys and values of one self-attention layer for ``n`` hypotheses."""

    def __init__(self, n: int, dim: int, max_steps: int, device, dtype, preallocate=True,
                 initial: int = 64, reuse: Optional["KVCache"] = None):
        """reuse: a finished cache whose buffers this one may take (its contents are not
        read: only positions written by this cache are)."""
        self.dim = dim
        self.max_steps = max_steps
        self.preallocate = preallocate
        cap = min(max_steps, initial) if preallocate else 0
        self.k = self.v = None
        if preallocate and reuse is not None and n > 0 and reuse.k.dtype == dtype and \
                reuse.k.device == torch.device(device):
            # as many positions as the old buffers hold, up to the limit: fewer growths
            fits = min(max_steps, min(reuse.k.numel(), reuse.v.numel()) // (n * dim))
            if fits >= cap:
                self.k = _fit(reuse.k, (fits, n, dim))
                self.v = _fit(reuse.v, (fits, n, dim))
        if self.k is None or self.v is None:
            self.k = torch.empty(cap, n, dim, device=device, dtype=dtype)
            self.v = torch.empty_like(self.k)
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

    def next_slot(self) -> Tuple[Tensor, Tensor]:
        """The (capacity, n, C) key and value buffers, grown if full, for a caller that
        writes this step's rows at index ``t`` itself and then calls :meth:`advance`."""
        assert self.preallocate, "next_slot needs the preallocated cache"
        if self.t == self.k.size(0):
            self._grow()
        return self.k, self.v

    def advance(self) -> None:
        """Count the step written through :meth:`next_slot`."""
        self.t += 1

    def reorder(self, order: Tensor, spare: Spare = None) -> Spare:
        """Row i of the cache becomes old row order[i]; order: (n_new,) int64.

        spare: buffers to reorder into (any shape: their memory is reused when large
        enough, else a new pair is made).  Returns the buffers this cache no longer uses,
        the spare for the next layer's reorder."""
        t = self.t
        if not self.preallocate:
            self.k = self.k.index_select(1, order)
            self.v = self.v.index_select(1, order)
            return spare
        shape = (self.k.size(0), order.numel(), self.dim)
        k_out = _fit(spare[0], shape) if spare is not None else None
        v_out = _fit(spare[1], shape) if spare is not None else None
        if k_out is None or v_out is None:
            k_out, v_out = self.k.new_empty(shape), self.v.new_empty(shape)
        torch.index_select(self.k[:t], 1, order, out=k_out[:t])
        torch.index_select(self.v[:t], 1, order, out=v_out[:t])
        freed = (self.k, self.v)
        self.k, self.v = k_out, v_out
        return freed

    def _grow(self) -> None:
        old_cap = self.k.size(0)
        cap = min(self.max_steps, max(int(old_cap * GROWTH), old_cap + MARGIN))
        if cap <= old_cap:
            cap = old_cap + 1  # past the length limit only in prefix/forced decoding
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty(cap, old.size(1), self.dim)
            new[: self.t].copy_(old[: self.t])
            setattr(self, name, new)
