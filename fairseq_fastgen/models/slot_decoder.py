"""Incremental decoding over sentence slots whose rows stand at different steps.

Continuous batching (:mod:`~fairseq_fastgen.search.continuous`) keeps ``slots`` sentences
of ``beam`` rows each in flight; a finished sentence's slot is taken by the next
sentence of the data, which starts at step 0 while its neighbours are deeper.  So, unlike
:class:`~fairseq_fastgen.models.fast_decoder.FastDecoder`, every row carries its own step:

* self-attention keys/values: one time-major buffer per layer, ``(T, rows, C)``, written at
  each row's own step; a row attends over the buffer's first ``max step + 1`` positions
  with the positions past its step masked to -inf (they hold an earlier sentence's keys or
  nothing).  Masked positions get weight exactly 0, so a row's attention is its stock
  value up to the summation order of the softmax (lossless mode);
* encoder-decoder keys/values: per slot, ``(slots*H, S, hd)`` with a padding mask
  ``(slots, S)``; a sentence's keys are copied in when it takes its slot (projected once
  per batch, as :class:`~fairseq_fastgen.models.cached_attention.CrossAttentionCache`
  projects them), its padding and the width past its batch's source masked;
* positions: each row's embedding of its own step.

Rows are slot-major (row ``r`` belongs to slot ``r // beam``); the slot set is compact:
:meth:`reorder` takes the rows that continue and the slots that stay.

With the C++ layers (``native``, :mod:`~fairseq_fastgen.models.native_step`) the
self-attention buffers are never reordered nor masked: each row owns a buffer row
(``phys``) where it writes its key/value at its own step, and an ancestor table says in
which buffer row each of its earlier steps lies (``anc[r, s]``), as in
:meth:`FastDecoder.reorder <fairseq_fastgen.models.fast_decoder.FastDecoder.reorder>`;
a row attends over its own ``step + 1`` positions only.  A beam reorder gathers ``anc``;
a row keeps its buffer row (its sentence's rows own theirs while it lives: two rows that
continue one hypothesis must not write to one place), except when slots are compacted
away, where the rows take their buffer rows with them.  A sentence taking a freed slot
takes its rows' buffer rows (the finished sentence no longer reads them); new slots take
buffer rows no live row owns.  So a buffer row is written by one live sentence only.
"""
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .cached_attention import CrossAttentionCache
from .layers import DecoderStack, LayerWeights

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
        """x: (slots*beam, C) queries (the stack's call: ``need_attn`` is never asked
        here).  Returns (rows, C) and None."""
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
        return self.out_proj(out), None


class SlotDecoder:
    """One fairseq transformer model decoding ``slots x beam`` rows at per-row steps.

    Per step: :meth:`step` (tokens and steps of every row), then :meth:`reorder`.  New
    sentences: :meth:`batch_cross` once per batch, :meth:`admit` per slot they take.
    """

    def __init__(self, stack: DecoderStack, beam: int, native=None):
        """stack: a lossless-mode layer stack (shared with the batch-at-a-time decoder);
        native: its :class:`~fairseq_fastgen.models.native_step.NativeLayers` (fp32), or
        None: the Python step over masked buffers."""
        self.stack = stack
        self.beam = beam
        self._native = native
        self._anc: Optional[Tensor] = None  # (rows, T) int64, native: see the module doc
        self._phys: Optional[Tensor] = None  # (rows,) int64, native: each row's buffer row
        self.vocab = self.stack.vocab
        self.cross: List[Optional[SlotCross]] = []
        for l in self.stack.layers:
            ea = l.layer.encoder_attn
            self.cross.append(None if ea is None else SlotCross(
                ea, l.heads, l.head_dim, l.ea_q or ea.q_proj, l.ea_out or ea.out_proj, beam))
        self.k: List[Tensor] = []  # per layer (T, capacity rows, C); rows [:self.rows] in use
        self.rows = 0
        self.v: List[Tensor] = []
        self._spare: List[Optional[Tensor]] = []
        self._positions: Optional[Tensor] = None

    def prepare(self) -> None:
        self.stack.prepare()

    def reset(self) -> None:
        """Forget every slot (a new run of batches)."""
        self.k, self.v, self._spare = [], [], []
        self.rows = 0
        self._anc = self._phys = None
        for c in self.cross:
            if c is not None:
                c.k = c.v = c.pad = None

    # ---- sentences in and out ---------------------------------------------------------

    def batch_cross(self, encoder_out: Optional[dict]) -> List[Optional[CrossAttentionCache]]:
        """Each layer's keys/values of a batch's sentences (projected once per sentence)."""
        return self.stack.cross_caches(encoder_out, self.beam, shared=True)

    def admit(self, slots: Tensor, batch: List[Optional[CrossAttentionCache]], sents: Tensor,
              rows: int, max_steps: int) -> None:
        """Slots (m,) take sentences ``sents`` (m,) of a batch (from :meth:`batch_cross`);
        ``rows``: rows in flight after admission; ``max_steps``: the largest length limit
        + 1 of any sentence in flight."""
        self.prepare()
        for cross, b in zip(self.cross, batch):
            if cross is not None and b is not None:
                cross.admit(slots, b, sents)
        if self._native is None:
            self._ensure(rows, max_steps)
        else:
            self._own_rows(rows, max_steps)

    def _own_rows(self, rows: int, steps: int) -> None:
        """Native: rows past the ones in use take buffer rows no live row owns."""
        old = self.rows
        if self._phys is None:
            self._phys = torch.zeros(0, dtype=torch.long, device=self.stack.device_dtype()[0])
            self._anc = self._phys.new_zeros(0, steps)
        if rows > self._phys.numel() or steps > self._anc.size(1):
            anc = self._anc.new_zeros(max(rows, self._anc.size(0)), max(steps, self._anc.size(1)))
            anc[: self._anc.size(0), : self._anc.size(1)] = self._anc
            phys = self._phys.new_zeros(anc.size(0))
            phys[: self._phys.numel()] = self._phys
            self._anc, self._phys = anc, phys
        need = rows
        if rows > old:
            size = max(rows, self.k[0].size(1) if self.k else 0)
            used = torch.zeros(size, dtype=torch.bool, device=self._phys.device)
            used[self._phys[:old]] = True
            free = (~used).nonzero().squeeze(1)[: rows - old]
            self._phys[old:rows] = free
            need = int(free[-1]) + 1
        self._ensure(need, steps)  # (keeps larger buffers as they are)
        self.rows = rows

    def _ensure(self, rows: int, steps: int) -> None:
        """Buffers of at least ``rows`` rows and ``steps`` positions; ``rows`` in use.

        Buffers keep their size when rows are dropped (the rows in use are a prefix,
        still a view of ``(t, rows*H, hd)``): no allocation after the first batches."""
        dev, dtype = self.stack.device_dtype()
        if self._positions is None or self._positions.size(1) < steps:
            self._positions = self.stack.position_table(steps)
        self.rows = rows
        if self.k and self.k[0].size(0) >= steps and self.k[0].size(1) >= rows:
            return
        had = bool(self.k)
        for i, l in enumerate(self.stack.layers):
            t, n = self.k[i].shape[:2] if had else (0, 0)
            # zeros, not empty: masked positions must hold finite values (0 * NaN is NaN)
            k = torch.zeros(max(t, steps), max(n, rows), l.dim, device=dev, dtype=dtype)
            v = torch.zeros_like(k)
            if had:
                k[:t, :n] = self.k[i]
                v[:t, :n] = self.v[i]
                self.k[i], self.v[i] = k, v
            else:
                self.k.append(k)
                self.v.append(v)
        self._spare = [None] * (2 * len(self.k))

    def reorder(self, order: Tensor, keep_slots: Optional[Tensor], upto: int) -> None:
        """Row i becomes old row order[i] (n_new,) for every cached step < ``upto``
        (double-buffered ``index_select`` into the rows' prefix; native: of the ancestor
        table); keep_slots (s_new,): the slots that stay, in order (None: all)."""
        n_new = order.numel()
        if self._native is not None:
            self._anc[:n_new, :upto] = self._anc[: self.rows, :upto].index_select(0, order)
            if keep_slots is not None:  # compacted: rows keep the buffer rows they own
                self._phys[:n_new] = self._phys[: self.rows].index_select(0, order)
            self.rows = n_new
            self._keep_slots(keep_slots)
            return
        for j, (bufs, i) in enumerate((b, i) for i in range(len(self.k)) for b in (self.k, self.v)):
            cur = bufs[i]
            spare = self._spare[j]
            if spare is None or spare.shape != cur.shape:
                spare = torch.zeros_like(cur)
            torch.index_select(cur[:upto, : self.rows], 1, order, out=spare[:upto, :n_new])
            bufs[i], self._spare[j] = spare, cur
        self.rows = n_new
        self._keep_slots(keep_slots)

    def _keep_slots(self, keep_slots: Optional[Tensor]) -> None:
        if keep_slots is not None:
            for c in self.cross:
                if c is not None:
                    c.keep(keep_slots)

    # ---- the step ---------------------------------------------------------------------

    def step(self, last: Tensor, steps: Tensor, t_max: int, temperature: float = 1.0):
        """last: (n,) int64 each row's latest token; steps: (n,) int64 each row's step;
        t_max: the largest step (host).  Returns (lprobs (n, V) float32, logits finite)."""
        n = last.numel()
        pos = self._positions[0].index_select(0, steps).unsqueeze(1) if (
            self._positions is not None) else None
        x = self.stack.embed(last.unsqueeze(1), pos)
        if self._native is not None:
            x = self._native_layers(x, steps, t_max)
            x = self.stack.final_features(x)
            lprobs = self.stack.log_probs(x, temperature)[:, : self.vocab]
            return lprobs, self.stack.logits_finite(x)
        ar = torch.arange(n, device=last.device)
        # (n, t_max+1): -inf where a row's history ends
        mask = torch.zeros(n, t_max + 1, device=x.device, dtype=x.dtype).masked_fill_(
            torch.arange(t_max + 1, device=x.device).unsqueeze(0) > steps.unsqueeze(1), _NEG_INF)

        def self_attention(i: int, l: LayerWeights, x: Tensor) -> Tensor:
            return self._self_attention(i, l, x, steps, ar, t_max, mask)

        x, _ = self.stack.layers_forward(x, self_attention, self.cross, False)
        x = self.stack.final_features(x)
        lprobs = self.stack.log_probs(x, temperature)[:, : self.vocab]
        return lprobs, self.stack.logits_finite(x)

    def _native_layers(self, x: Tensor, steps: Tensor, t_max: int) -> Tensor:
        n = x.size(0)
        slots = n // self.beam
        caches: List[Tensor] = []
        xs: List[Optional[Tensor]] = []
        for k, v, c in zip(self.k, self.v, self.cross):
            caches += [k, v]
            xs += [None, None, None] if c is None else [
                c.k[: slots * c.heads], c.v[: slots * c.heads], c.pad[:slots]]
        return self._native.at_row_steps(x, caches, xs, t_max, self.beam, self._anc[:n],
                                         steps + 1, self._phys[:n])

    def _self_attention(self, i: int, l: LayerWeights, x: Tensor, steps: Tensor, ar: Tensor,
                        t_max: int, mask: Tensor) -> Tensor:
        n, c = x.shape
        q, k, v = l.project_qkv(x)
        kb, vb = self.k[i], self.v[i]
        kb[steps, ar] = k
        vb[steps, ar] = v
        t1 = t_max + 1
        bh = n * l.heads
        keys = kb[:t1, :n].view(t1, bh, l.head_dim).transpose(0, 1)
        values = vb[:t1, :n].view(t1, bh, l.head_dim).transpose(0, 1)
        w = torch.bmm(q.reshape(bh, 1, l.head_dim), keys.transpose(1, 2))  # (bh, 1, t1)
        w = (w.view(n, l.heads, t1) + mask.unsqueeze(1)).view(bh, 1, t1)
        p = F.softmax(w, dim=-1, dtype=torch.float32).type_as(w)
        out = torch.bmm(p, values).view(n, c)
        return l.sa_out(out)
