"""The decoder step of the fast paths: sentence slots whose rows stand at any steps.

Continuous batching (:mod:`~fairseq_fastgen.search.continuous`) keeps ``slots`` sentences
of ``beam`` rows each in flight; a finished sentence's slot is taken by the next
sentence of the data, which starts at step 0 while its neighbours are deeper.  A batch
decoded on its own is the special case where every row may stand at one step
(``steps=None``); aggressive decoding's batches take every slot at once
(:meth:`SlotDecoder.start`).  The layer arithmetic is
:class:`~fairseq_fastgen.models.layers.DecoderStack`'s; this module owns the caches:

* self-attention keys/values: one time-major buffer per layer, ``(T, rows, C)``, written at
  each row's own step; a row attends over the buffer's first ``max step + 1`` positions
  with the positions past its step masked to -inf (they hold an earlier sentence's keys or
  nothing).  Masked positions get weight exactly 0, so a row's attention is its stock
  value up to the summation order of the softmax (lossless mode);
* encoder-decoder keys/values: per slot, ``(slots*H, S, hd)`` with a padding mask
  ``(slots, S)``; a sentence's keys are copied in when it takes its slot (projected once
  per batch, as :class:`~fairseq_fastgen.models.cached_attention.CrossAttentionCache`
  projects them: once per sentence, shared by its beam), its padding and the width past
  its batch's source masked;
* positions: each row's embedding of its own step.

Rows are slot-major (row ``r`` belongs to slot ``r // beam``); the slot set is compact:
:meth:`reorder` takes the rows that continue and the slots that stay.

With the C++ layers (``native``, :mod:`~fairseq_fastgen.models.native_step`) the
self-attention buffers are never reordered nor masked: each row owns a buffer row
(``phys``) where it writes its key/value at its own step, and an ancestor table says in
which buffer row each of its earlier steps lies (``anc[r, s]``), so a beam reorder
gathers the (rows, t) table, not every layer's (t, rows, C) keys and values (19% of
generation at batch 64 on the bundled model; benchmarks/results/NOTES.md,
"Ancestor-indexed KV cache"); a row attends over its own ``step + 1`` positions only.
A row keeps its buffer row (its sentence's rows own theirs while it lives: two rows that
continue one hypothesis must not write to one place), except when slots are compacted
away, where the rows take their slots' buffer rows with them.  A sentence taking a freed
slot takes its rows' buffer rows (the finished sentence no longer reads them); new slots
take buffer rows no live row owns.  So a buffer row is written by one live sentence only.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native_step
from .cached_attention import CrossAttentionCache, source_length
from .slot_cross import SlotCross
from .step_records import BlockOutput, Queries, StepOutput
from .layers import DecoderStack, LayerWeights

_NEG_INF = float("-inf")
GROWTH = 1.25  # positions grow by this factor (a growth copies the prefix once)
MARGIN = 16  # positions past the source length a batch first reserves, and the least growth


class SlotDecoder:
    """One fairseq transformer model decoding ``slots x beam`` rows at per-row steps: the
    one decoder step of the fast paths (the slot engine's, a batch decoded on its own
    included, and aggressive decoding's blocks).

    Per step: :meth:`step` (tokens and steps of every row), then :meth:`reorder`.  New
    sentences: :meth:`batch_cross` once per batch, :meth:`admit` per slot they take, or
    :meth:`start` for a batch that takes every slot.
    """

    def __init__(self, stack: DecoderStack, beam: int, native=None, build_native: bool = False,
                 fused_cross: bool = False):
        """stack: a lossless-mode layer stack; native: its
        :class:`~fairseq_fastgen.models.native_step.NativeLayers` (fp32), or None: the Python
        step over masked buffers; build_native: build them at :meth:`prepare` where the model
        allows (fp32 CPU; else one log line), with ``fused_cross`` attention."""
        self.stack = stack
        self.beam = beam
        self._native = native
        self._build_native = build_native
        self._fused_cross = fused_cross
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
        self._max_steps = 0  # positions the sentences in flight may reach
        self._pos_limit = 0  # positions with an embedding of their own
        self._hi = 0  # positions written so far (blocks)

    def prepare(self) -> None:
        """Build (or re-read, when the weights changed) what is derived from the weights,
        and the C++ layers once (before forking decoding workers, which then share them)."""
        self.stack.prepare()
        if self._build_native:
            self._build_native = False  # decided once
            if self.stack.device_dtype()[1] == torch.float32:
                self._native = native_step.build(self.stack, fused_cross=self._fused_cross)

    def native(self) -> Optional[native_step.NativeLayers]:
        """The C++ layers this decoder runs (None: the Python step)."""
        self.prepare()
        return self._native

    def on_stack(self, stack: DecoderStack) -> "SlotDecoder":
        """A fresh decoder of these layers on ``stack`` (another GEMM kernel: the same
        weight copies, :meth:`~fairseq_fastgen.models.layers.DecoderStack.with_gemm`)."""
        native = self.native()
        return SlotDecoder(stack, self.beam,
                           native=native.for_stack(stack) if native is not None else None)

    def reset(self) -> None:
        """Forget every slot (a new run of batches); the buffers are kept, as
        :meth:`start` keeps them, and admitted sentences overwrite what they read."""
        self.rows = 0
        self._hi = 0

    # ---- sentences in and out ---------------------------------------------------------

    def batch_cross(self, encoder_out: Optional[dict]) -> List[Optional[CrossAttentionCache]]:
        """Each layer's keys/values of a batch's sentences (projected once per sentence)."""
        return self.stack.cross_caches(encoder_out)

    def start(self, encoder_out: Optional[dict], bsz: int, max_steps: int, room: int = 0) -> None:
        """A batch of ``bsz`` sentences takes slots 0..bsz-1 (batch-at-a-time decoding);
        the buffers of earlier batches are kept (a fresh multi-megabyte buffer faults on
        every page at its first write: 20% of the C++ layer time at batch 64,
        benchmarks/results/NOTES.md, "KV buffers kept across batches").  Positions are
        reserved for the source length and a margin, and grow as steps need them, up to
        ``max_steps`` and ``room`` more that blocks may write past it (aggressive
        decoding's padding: their position embedding is the last one's)."""
        self.rows = 0
        self._hi = 0
        width = source_length(encoder_out)
        first = min(max_steps, 64 if width is None else width + MARGIN)
        self.prepare()
        for cross, b in zip(self.cross, self.batch_cross(encoder_out)):
            if cross is not None and b is not None:
                cross.adopt(b)
        self._pos_limit, self._max_steps = max_steps, max_steps + room
        self._take_rows(bsz * self.beam, first)

    def admit(self, slots: Tensor, batch: List[Optional[CrossAttentionCache]], sents: Tensor,
              rows: int, max_steps: int) -> None:
        """Slots (m,) take sentences ``sents`` (m,) of a batch (from :meth:`batch_cross`);
        ``rows``: rows in flight after admission; ``max_steps``: the largest length limit
        + 1 of any sentence in flight."""
        self.prepare()
        self._max_steps = self._pos_limit = max_steps
        for cross, b in zip(self.cross, batch):
            if cross is not None and b is not None:
                cross.admit(slots, b, sents)
        self._take_rows(rows, max_steps)

    def _take_rows(self, rows: int, steps: int) -> None:
        if self._native is None:
            self._ensure(rows, steps)
        else:
            self._own_rows(rows, steps)

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
        self._position_room(steps)
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

    def _reserve(self, steps: int) -> None:
        """Room for ``steps`` positions: grown by 1.25x (at least MARGIN more, at most
        the admitted limit), a prefix copy each time."""
        have = self.k[0].size(0) if self.k else 0
        # buffers kept from an earlier batch may outsize the position table of a run whose
        # limit was lower: its embeddings are looked up whatever the buffers hold
        self._position_room(steps)
        if steps <= have and (self._anc is None or steps <= self._anc.size(1)):
            return
        steps = max(steps, min(max(int(have * GROWTH), have + MARGIN), self._max_steps))
        if self._native is None:
            self._ensure(self.rows, steps)
        else:
            self._own_rows(self.rows, steps)

    def _position_room(self, steps: int) -> None:
        """The position table covers ``steps`` positions, at most the limit's."""
        pos = min(steps, max(self._pos_limit, 1))
        if self._positions is None or self._positions.size(1) < pos:
            self._positions = self.stack.position_table(pos)

    def reorder(self, order: Tensor, keep_slots: Optional[Tensor], upto: int) -> None:
        """Row i becomes old row order[i] (n_new,) for every cached step < ``upto``
        (double-buffered ``index_select`` into the rows' prefix; native: of the ancestor
        table); keep_slots (s_new,): the slots that stay, in order (None: all), each
        new row in one of them (order[i] in old slot keep_slots[i // beam])."""
        n_new = order.numel()
        if self._native is not None:
            self._anc[:n_new, :upto] = self._anc[: self.rows, :upto].index_select(0, order)
            if keep_slots is not None:  # compacted: rows keep their slots' buffer rows
                self._phys[:n_new] = self._phys[: self.rows].view(-1, self.beam).index_select(
                    0, keep_slots).view(-1)
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

    def step(self, last: Tensor, steps: Optional[Tensor], t_max: int, temperature: float = 1.0,
             need_attn: bool = False) -> StepOutput:
        """last: (n,) int64 each row's latest token; steps: (n,) int64 each row's step
        (None: every row at ``t_max``, a batch's); t_max: the largest step (host);
        need_attn: also the last layer's head-averaged cross-attention (n, S) over the
        slots' key width (0 past a sentence's source)."""
        n = last.numel()
        self._reserve(t_max + 1)
        if steps is None:
            pos = self._positions[:, t_max] if self._positions is not None else None
        else:
            pos = self._positions[0].index_select(0, steps).unsqueeze(1) if (
                self._positions is not None) else None
        x = self.stack.embed(last.unsqueeze(1), pos)
        if self._native is not None:
            lens = steps + 1 if steps is not None else torch.full(
                (n,), t_max + 1, dtype=torch.long, device=last.device)
            x, attn = self._native_layers(x, lens, t_max, need_attn)
        else:
            mask = None
            if steps is not None:  # (n, 1, 1, t_max+1): True where a row's history ends
                mask = (torch.arange(t_max + 1, device=x.device).unsqueeze(0) >
                        steps.unsqueeze(1)).view(n, 1, 1, t_max + 1)
            rows = torch.arange(n, device=x.device) if steps is not None else None
            q = Queries(n, 1, steps, rows, t_max, mask)
            x, attn = self._python_layers(x, q, need_attn)
        x = self.stack.final_features(x)
        lprobs = self.stack.log_probs(x, temperature)[:, : self.vocab]
        return StepOutput(lprobs, attn, self.stack.logits_finite(x))

    def block(self, tokens: Tensor, start: Tensor, out_rows: Optional[Tensor] = None,
              bounds: Optional[Tuple[int, int]] = None, log_probs: bool = False,
              temperature: float = 1.0) -> BlockOutput:
        """A block of ``L`` tokens per row (aggressive decoding's verification pass, the
        Python layers): tokens (n, L) int64, row r's tokens at positions start[r] + 0..L-1,
        query j of row r seeing keys 0..start[r]+j only (causal within the block, blind
        to whatever an earlier pass left past start[r]: rolling rejected drafts back is
        free); bounds: (lo, hi) with lo <= start <= hi when the caller knows them (hi may
        be an upper bound).  Scores of the flat positions ``out_rows`` (indices into n*L;
        all when None): logits, or with ``log_probs`` log-probabilities as :meth:`step`'s."""
        n, L = tokens.shape
        dev = tokens.device
        if bounds is None:
            bounds = (int(start.min()), int(start.max()))
        t1 = bounds[1] + L
        self._reserve(t1)
        self._hi = max(self._hi, t1)
        pos = start.unsqueeze(1) + torch.arange(L, device=dev)  # (n, L)
        positions = None
        if self._positions is not None:
            positions = self._positions[0, pos.clamp(max=self._positions.size(1) - 1)]
        x = self.stack.embed(tokens, positions)
        mask = None
        if L > 1 or bounds[0] != bounds[1]:  # key i visible to query (r, j) iff i <= pos
            mask = (torch.arange(t1, device=dev).view(1, 1, t1) > pos.unsqueeze(2)).unsqueeze(1)
        rows = torch.arange(n, device=dev).repeat_interleave(L)
        x, _ = self._python_layers(x, Queries(n, L, pos.reshape(-1), rows, t1 - 1, mask), False)
        if out_rows is not None:
            x = x.index_select(0, out_rows)
        x = self.stack.final_features(x)
        scores = self.stack.log_probs(x, temperature) if log_probs else self.stack.project_out(x)
        return BlockOutput(scores, self.stack.logits_finite(x))

    def select(self, rows: Tensor) -> None:
        """Blocks (beam 1): only rows (n_new,) stay, in that order."""
        self.reorder(rows, rows, min(self._hi, self.k[0].size(0)))

    def _python_layers(self, x: Tensor, q: Queries, need_attn: bool):
        def self_attention(i: int, l: LayerWeights, x: Tensor) -> Tensor:
            return self._self_attention(i, l, x, q)

        return self.stack.layers_forward(x, self_attention, self.cross, need_attn,
                                         cross_beam=self.beam * q.L)

    def _native_layers(self, x: Tensor, lens: Tensor, t_max: int, need_attn: bool):
        n = x.size(0)
        slots = n // self.beam
        caches: List[Tensor] = []
        xs: List[Optional[Tensor]] = []
        for k, v, c in zip(self.k, self.v, self.cross):
            caches += [k, v]
            xs += [None, None, None] if c is None else [
                c.k[: slots * c.heads], c.v[: slots * c.heads], c.pad[:slots]]
        return self._native.at_row_steps(x, caches, xs, t_max, self.beam, self._anc[:n],
                                         lens, self._phys[:n], need_attn)

    def _self_attention(self, i: int, l: LayerWeights, x: Tensor, at: Queries) -> Tensor:
        """x: (n*L, C), row-major: the L queries of each row."""
        m, c = x.shape
        n, L = at.n, at.L
        q, k, v = l.project_qkv(x)
        kb, vb = self.k[i], self.v[i]
        if at.pos is None:  # every row at step t_max
            kb[at.t_max, :n] = k
            vb[at.t_max, :n] = v
        else:
            kb.index_put_((at.pos, at.rows), k)
            vb.index_put_((at.pos, at.rows), v)
        t1 = at.t_max + 1
        bh = n * l.heads
        keys = kb[:t1, :n].view(t1, bh, l.head_dim).transpose(0, 1)
        values = vb[:t1, :n].view(t1, bh, l.head_dim).transpose(0, 1)
        if L > 1:
            q = q.view(n, L, l.heads, l.head_dim).transpose(1, 2)
        w = torch.bmm(q.reshape(bh, L, l.head_dim), keys.transpose(1, 2))  # (n*H, L, t1)
        if at.mask is not None:
            w = w.view(n, l.heads, L, t1).masked_fill(at.mask, _NEG_INF).view(bh, L, t1)
        p = F.softmax(w, dim=-1, dtype=torch.float32).type_as(w)
        out = torch.bmm(p, values)  # (n*H, L, hd)
        if L > 1:
            out = out.view(n, l.heads, L, l.head_dim).transpose(1, 2)
        return l.sa_out(out.reshape(m, c))
