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

The layer arithmetic is :class:`~fairseq_fastgen.models.layers.DecoderStack`'s, shared
with :class:`~fairseq_fastgen.models.fast_decoder.FastDecoder` (fairseq's layer norms,
projections, FFN and ``MultiheadAttention`` weights, in fairseq's order); only the
self-attention reads a block of queries per row instead of one.  Results
match stock fairseq's one-token steps to float rounding (other GEMM shapes), which the
caller's near-tie rule accounts for.
"""
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .cached_attention import CrossAttentionCache
from .layers import DecoderStack, LayerWeights


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


class Block(NamedTuple):
    """Where the queries of one pass sit: n rows of L positions; pos: (n*L,) int64 each
    query's position; rows: (n*L,) int64 its row; t_max: keys read per row; mask:
    (n, 1, L, t_max) bool, True where a key is hidden (None: nothing hidden)."""
    n: int
    L: int
    pos: Tensor
    rows: Tensor
    t_max: int
    mask: Optional[Tensor]


class BlockOutput(NamedTuple):
    """scores: (m, V') logits, or log-probabilities when asked (V' >= the vocabulary,
    columns past it -inf); logits_finite: the logits were proven finite."""
    scores: Tensor
    logits_finite: bool


class VerifyDecoder:
    """Blocks of ``L`` tokens per row through one fairseq transformer decoder.

    Per batch: ``start(encoder_out, bsz, max_len, max_block)``; then
    ``forward(tokens, start_pos, out_rows)`` any number of times (the caller keeps each
    row's length = ``start_pos``) and ``select(rows)`` to drop finished rows.
    """

    def __init__(self, model, vocab_pad: bool = True, packed_gemm_mb: int = 0):
        # lossless mode only: a block pass has other GEMM shapes than stock's steps; MKL,
        # since no margin guard checks a greedy pass (search/continuous/margins.py)
        self.stack = DecoderStack(model, bitwise=False, vocab_pad=vocab_pad,
                                  packed_gemm_mb=packed_gemm_mb)
        self.model = model
        self.vocab = self.stack.vocab
        self._positions: Optional[Tensor] = None
        self._n_pos = 0
        self.self_kv: List[RaggedKVCache] = []
        self.cross: List[Optional[CrossAttentionCache]] = []

    def start(self, encoder_out: Optional[dict], bsz: int, max_len: int, max_block: int) -> None:
        """encoder_out: fairseq encoder output for ``bsz`` rows; max_block: the widest L."""
        self.stack.prepare()
        self._positions = self.stack.position_table(max_len + 1)
        self._n_pos = self._positions.size(1) if self._positions is not None else 0
        cap = max_len + 1 + max_block  # block padding may run past max_len: never clamp
        dev, dtype = self.stack.device_dtype()
        self.self_kv = [RaggedKVCache(bsz, l.dim, cap, dev, dtype) for l in self.stack.layers]
        self.cross = self.stack.cross_caches(encoder_out, 1, shared=True)

    def select(self, rows: Tensor) -> None:
        for c in self.self_kv:
            c.select(rows)
        for cross in self.cross:
            if cross is not None:
                cross.select(rows, rows)

    def forward(self, tokens: Tensor, start_pos: Tensor, out_rows: Optional[Tensor] = None,
                bounds: Optional[Tuple[int, int]] = None, log_probs: bool = False,
                temperature: float = 1.0) -> BlockOutput:
        """tokens: (n, L) int64, row r's tokens at positions start_pos[r] + 0..L-1;
        bounds: (lo, hi) with lo <= start_pos <= hi, when the caller knows them (saves
        host reads; hi may be an upper bound).

        Scores of the flat positions ``out_rows`` (indices into n*L; all when None):
        logits, or with ``log_probs`` log-probabilities as :meth:`FastDecoder.step`
        computes them."""
        n, L = tokens.shape
        offs = torch.arange(L, device=tokens.device)
        pos = start_pos.unsqueeze(1) + offs  # (n, L)
        positions = None
        if self._positions is not None:
            positions = self._positions[0, pos.clamp(max=self._n_pos - 1)]
        x = self.stack.embed(tokens, positions)
        if bounds is None:
            bounds = (int(start_pos.min()), int(start_pos.max()))
        t_max = bounds[1] + L
        mask = None
        if L > 1 or bounds[0] != bounds[1]:
            # key i visible to query (r, j) iff i <= start_pos[r] + j
            keys = torch.arange(t_max, device=tokens.device)
            mask = (keys.view(1, 1, t_max) > pos.unsqueeze(2)).unsqueeze(1)  # (n, 1, L, T)
        rows = torch.arange(n, device=tokens.device).repeat_interleave(L)
        block = Block(n, L, pos.reshape(-1), rows, t_max, mask)

        def self_attention(i: int, l: LayerWeights, x: Tensor) -> Tensor:
            return self._self_attention(l, self.self_kv[i], x, block)

        # the merged per-sentence cross-attention GEMM takes the L queries of a row
        x, _ = self.stack.layers_forward(x, self_attention, self.cross, cross_beam=L)
        if out_rows is not None:
            x = x.index_select(0, out_rows)
        x = self.stack.final_features(x)
        scores = self.stack.log_probs(x, temperature) if log_probs else self.stack.project_out(x)
        return BlockOutput(scores, self.stack.logits_finite(x))

    @staticmethod
    def _self_attention(l: LayerWeights, cache: RaggedKVCache, x: Tensor, block: Block) -> Tensor:
        """x: (n*L, C) the block's queries, row-major."""
        n, L, t_max, mask = block.n, block.L, block.t_max, block.mask
        m, c = x.shape
        q, k, v = l.project_qkv(x)
        cache.write(block.pos, block.rows, k, v)
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
