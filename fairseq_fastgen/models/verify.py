"""A multi-token decoder pass over fairseq's own decoder modules, with a ragged KV cache.

Used by aggressive (draft-and-verify) greedy decoding: every row feeds ``L`` tokens at
once (its last accepted token and up to ``L-1`` draft tokens) starting at its own position,
and the self-attention keys/values of every row live in one time-major buffer
``(capacity, n, C)`` (the layout of :class:`~fairseq_fastgen.models.kv_cache.KVCache`)
with a **per-row length**.  A pass writes the ``L`` new keys/values of row ``r`` at
positions ``len[r] .. len[r]+L-1`` and attends with an explicit mask: query ``j`` of row
``r`` sees keys ``0 .. len[r]+j`` only (causal within the block, and blind to anything a
previous pass left beyond ``len[r]``).  Rolling back rejected draft positions is therefore
free: the caller just sets the row's length to the accepted prefix; stale entries are
masked and later overwritten.  Finished rows leave the batch by one ``index_select``.

The layer arithmetic is :class:`~fairseq_fastgen.models.fast_decoder.FastDecoder`'s
(fairseq's layer norms, projections, FFN and ``MultiheadAttention`` weights, in fairseq's
order); only the attention reads a block of queries per row instead of one.  Results
match stock fairseq's one-token steps to float rounding (other GEMM shapes), which the
caller's near-tie rule accounts for.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .cached_attention import CrossAttentionCache
from .fast_decoder import FastDecoder, _Layer


class RaggedKVCache:
    """Self-attention keys/values of one layer; rows have independent lengths."""

    def __init__(self, n: int, dim: int, capacity: int, device, dtype):
        # zeros, not empty: masked (zero-weight) slots must hold finite numbers
        self.k = torch.zeros(capacity, n, dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def write(self, pos: Tensor, rows: Tensor, k: Tensor, v: Tensor) -> None:
        """pos, rows: (m,) int64 slot of each new entry; k, v: (m, C)."""
        self.k.index_put_((pos, rows), k)
        self.v.index_put_((pos, rows), v)

    def select(self, rows: Tensor) -> None:
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)


class VerifyDecoder(FastDecoder):
    """Blocks of ``L`` tokens per row through one fairseq transformer decoder.

    Per batch: ``start(encoder_out, bsz, max_len, max_block)``; then
    ``forward(tokens, start_pos, out_rows)`` any number of times (the caller keeps each
    row's length = ``start_pos``) and ``select(rows)`` to drop finished rows.
    """

    def __init__(self, model, vocab_pad: bool = True):
        super().__init__(model, shared_encoder=True, kv_cache=True, bitwise=False,
                         vocab_pad=vocab_pad)
        self._ctx = None

    def start(self, encoder_out: Optional[dict], bsz: int, max_len: int, max_block: int) -> None:
        # FastDecoder.start builds positions, cross-attention caches (beam 1, per sentence)
        # and no KV caches: ragged ones are made here.
        super().start(encoder_out, bsz, 1, max_len, self_kv=False)
        cap = max_len + 1 + max_block  # block padding may run past max_len: never clamp
        dev, dtype = self._device_dtype()
        self.self_kv = [RaggedKVCache(bsz, l.dim, cap, dev, dtype) for l in self.layers]
        self._n_pos = self._positions.size(1) if self._positions is not None else 0

    def select(self, rows: Tensor) -> None:
        for c in self.self_kv:
            c.select(rows)
        for cross in self.cross:
            if cross is not None:
                cross.select(rows, rows)

    def forward(self, tokens: Tensor, start_pos: Tensor, out_rows: Optional[Tensor] = None,
                bounds: Optional[Tuple[int, int]] = None, log_probs: bool = False,
                temperature: float = 1.0) -> Tensor:
        """tokens: (n, L) int64, row r's tokens at positions start_pos[r] + 0..L-1;
        bounds: (lo, hi) with lo <= start_pos <= hi, when the caller knows them (saves
        host reads; hi may be an upper bound).

        Returns logits (m, V') of the flat positions ``out_rows`` (indices into n*L;
        all when None), or with ``log_probs`` their log-probabilities as
        :meth:`FastDecoder.step` computes them; V' >= ``self.vocab``, the columns past it
        -inf."""
        dec = self.decoder
        n, L = tokens.shape
        x = dec.embed_scale * dec.embed_tokens(tokens)
        if dec.project_in_dim is not None:
            x = dec.project_in_dim(x)
        offs = torch.arange(L, device=tokens.device)
        pos = start_pos.unsqueeze(1) + offs  # (n, L)
        if self._positions is not None:
            x = x + self._positions[0, pos.clamp(max=self._n_pos - 1)]
        if dec.layernorm_embedding is not None:
            x = dec.layernorm_embedding(x)
        x = x.reshape(n * L, x.size(-1))
        if bounds is None:
            bounds = (int(start_pos.min()), int(start_pos.max()))
        t_max = bounds[1] + L
        mask = None
        if L > 1 or bounds[0] != bounds[1]:
            # key i visible to query (r, j) iff i <= start_pos[r] + j
            keys = torch.arange(t_max, device=tokens.device)
            mask = (keys.view(1, 1, t_max) > pos.unsqueeze(2)).unsqueeze(1)  # (n, 1, L, T)
        rows = torch.arange(n, device=tokens.device).repeat_interleave(L)
        self._ctx = (n, L, pos.reshape(-1), rows, t_max, mask)
        for cross in self.cross:
            if cross is not None:
                cross.beam = L  # the merged per-sentence GEMM takes the L queries of a row
        for i, l in enumerate(self.layers):
            x, _ = self._layer(l, i, x, False)
        if out_rows is not None:
            x = x.index_select(0, out_rows)
        x = self._final_features(x)
        if log_probs:
            return self._log_probs(x, temperature)
        return self._project_out(x)

    def _self_attention(self, l: _Layer, cache: RaggedKVCache, x: Tensor, rep: int = 1) -> Tensor:
        n, L, pos, rows, t_max, mask = self._ctx
        m, c = x.shape
        q, k, v = self._project_qkv(l, x)
        cache.write(pos, rows, k, v)
        bh = n * l.heads
        keys = cache.k[:t_max].view(t_max, bh, l.head_dim).transpose(0, 1)
        values = cache.v[:t_max].view(t_max, bh, l.head_dim).transpose(0, 1)
        q = q.view(n, L, l.heads, l.head_dim).transpose(1, 2).reshape(bh, L, l.head_dim)
        w = torch.bmm(q, keys.transpose(1, 2))  # (n*H, L, T)
        if mask is not None:
            w = w.view(n, l.heads, L, t_max).masked_fill(mask, float("-inf")).view(bh, L, t_max)
        p = F.softmax(w, dim=-1, dtype=torch.float32).type_as(w)
        out = torch.bmm(p, values)  # (n*H, L, hd)
        out = out.view(n, l.heads, L, l.head_dim).transpose(1, 2).reshape(m, c)
        return l.sa_out(out)


def cross_attention_supported(dec: VerifyDecoder) -> bool:
    return all(c is None or isinstance(c, CrossAttentionCache) and c.merged for c in dec.cross)
