"""Encoder-decoder attention over sentence slots: each slot holds its sentence's keys and
values once, shared by the rows (beam, or a block's queries) of that slot.

A sentence's keys/values are copied in when it takes its slot (projected once per batch:
:class:`~fairseq_fastgen.models.cached_attention.CrossAttentionCache`); the width past
its batch's source and its padding are masked, so a query weighs them exactly 0.  The
beam's queries become the rows of one GEMM per (slot, head), ``(beam, d) x (d, S)``: a
GEMM of another shape than stock's, which may round the last bit otherwise (lossless
mode).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .cached_attention import CrossAttentionCache

_NEG_INF = float("-inf")


class SlotCross:
    """One layer's encoder-decoder attention over slots (merged-beam GEMMs)."""

    def __init__(self, attn, heads: int, head_dim: int, q_proj, out_proj, beam: int):
        self.attn = attn
        self.beam = beam
        self.heads = heads
        self.head_dim = head_dim
        self.q_proj = q_proj
        self.out_proj = out_proj
        self.k: Optional[Tensor] = None  # (slots*H, S, hd)
        self.v: Optional[Tensor] = None
        self.pad: Optional[Tensor] = None  # (slots, S) bool, True: masked

    def ensure(self, slots: int, width: int, like: Tensor) -> None:
        """Room for ``slots`` slots and sources of ``width`` positions (new room masked)."""
        h, hd = self.heads, self.head_dim
        if self.k is None:
            self.k = like.new_zeros(slots * h, width, hd)
            self.v = like.new_zeros(slots * h, width, hd)
            self.pad = torch.ones(slots, width, dtype=torch.bool, device=like.device)
            return
        old_slots, old_w = self.pad.shape
        if slots <= old_slots and width <= old_w:
            return
        s2, w2 = max(slots, old_slots), max(width, old_w)
        k = like.new_zeros(s2 * h, w2, hd)
        v = like.new_zeros(s2 * h, w2, hd)
        pad = torch.ones(s2, w2, dtype=torch.bool, device=like.device)
        k[: old_slots * h, :old_w] = self.k
        v[: old_slots * h, :old_w] = self.v
        pad[:old_slots, :old_w] = self.pad
        self.k, self.v, self.pad = k, v, pad

    def adopt(self, batch: CrossAttentionCache) -> None:
        """A batch's sentences take slots 0..bsz-1 in order: its keys/values become the
        slots' own, without a copy (batch-at-a-time decoding); the padding mask is copied:
        :meth:`keep` rewrites it in place, and every layer's batch holds the same one."""
        self.k, self.v = batch.k, batch.v
        bsz, s = self.k.size(0) // self.heads, self.k.size(1)
        self.pad = batch.pad.clone() if batch.pad is not None else torch.zeros(
            bsz, s, dtype=torch.bool, device=self.k.device)

    def admit(self, slots: Tensor, batch: CrossAttentionCache, sents: Tensor) -> None:
        """Slots (m,) take sentences ``sents`` (m,) of a batch's projected keys/values."""
        h, hd = self.heads, self.head_dim
        bk = batch.k.view(-1, h, batch.k.size(1), hd)
        width = bk.size(2)
        self.ensure(int(slots.max()) + 1, width, batch.k)
        k = self.k.view(-1, h, self.k.size(1), hd)
        v = self.v.view(-1, h, self.v.size(1), hd)
        k[slots, :, :width] = bk.index_select(0, sents)
        v[slots, :, :width] = batch.v.view(-1, h, width, hd).index_select(0, sents)
        self.pad[slots] = True
        if batch.pad is not None:
            self.pad[slots, :width] = batch.pad.index_select(0, sents)
        else:
            self.pad[slots, :width] = False

    def keep(self, slots: Tensor) -> None:
        """Only slots (s_new,) stay, in that order."""
        h, hd = self.heads, self.head_dim
        w, m = self.k.size(1), slots.numel()
        for name in ("k", "v"):  # in place: the buffers keep their size
            buf = getattr(self, name).view(-1, h, w, hd)
            buf[:m] = buf.index_select(0, slots)
        self.pad[:m] = self.pad.index_select(0, slots)

    def attend(self, x: Tensor, need_attn: bool = False, beam: Optional[int] = None):
        """x: (slots*beam, C) queries.  Returns (rows, C) and, if need_attn, the
        head-averaged attention (rows, S) over the buffers' width (0 past a source)."""
        beam = beam or self.beam
        n, c = x.shape
        slots = n // beam
        h, hd = self.heads, self.head_dim
        q = self.q_proj(x)
        q *= self.attn.scaling
        q = q.view(slots, beam, h, hd).transpose(1, 2).reshape(slots * h, beam, hd)
        k, v = self.k[: slots * h], self.v[: slots * h]
        s = k.size(1)
        w = torch.bmm(q, k.transpose(1, 2))  # (slots*H, beam, S)
        w = w.view(slots, h, beam, s).masked_fill(
            self.pad[:slots].view(slots, 1, 1, s), _NEG_INF).view(-1, beam, s)
        p = F.softmax(w, dim=-1, dtype=torch.float32)
        out = torch.bmm(p.type_as(w), v)
        out = out.view(slots, h, beam, hd).transpose(1, 2).reshape(n, c)
        attn = None
        if need_attn:
            attn = p.view(slots, h, beam, s).transpose(0, 1).reshape(h, n, s).mean(dim=0)
        return self.out_proj(out), attn
