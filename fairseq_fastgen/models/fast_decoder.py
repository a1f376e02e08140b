"""A lean incremental step over an already-built fairseq ``TransformerDecoder``.

Nothing is converted or copied: the step reads the decoder's own modules and weights
(embeddings, positions, layer norms, ``MultiheadAttention`` projections, FFN), so the
model stays usable by stock code afterwards.  What changes is the state kept between
steps:

* self-attention keys/values live in :class:`~fairseq_fastgen.models.kv_cache.KVCache`
  (preallocated, written and reordered in place);
* encoder-decoder keys/values live in
  :class:`~fairseq_fastgen.models.cached_attention.CrossAttentionCache` (projected once
  per sentence, shared by the beam);
* the attention-weight average over heads is computed only when asked for.

The layer arithmetic is :class:`~fairseq_fastgen.models.layers.DecoderStack`'s (fairseq's
eval-mode incremental path, operation for operation in bitwise mode); this module owns the
per-batch state and the one-query-per-hypothesis self-attention.
"""
from typing import List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .cached_attention import CrossAttentionCache
from .kv_cache import KVCache, Spare, first_capacity
from .layers import DecoderStack, LayerWeights
from . import native_step


class StepOutput(NamedTuple):
    """lprobs: (n, V') float32 log-probabilities (V' >= the vocabulary, columns past it
    -inf); attn: (n, S) head-averaged cross-attention or None; logits_finite: the logits
    were proven finite (then lprobs has no NaN unless temperature < 1)."""
    lprobs: Tensor
    attn: Optional[Tensor]
    logits_finite: bool


class FastDecoder:
    """Incremental decoding of one fairseq transformer model, many hypotheses at once.

    Usage per batch: ``start(encoder_out, bsz, beam, max_len)``, then per step
    ``step(tokens)`` and ``reorder(order)`` (``select_sentences`` when sentences finish).
    """

    def __init__(self, model, shared_encoder: bool = True, kv_cache: bool = True,
                 bitwise: bool = False, vocab_pad: bool = True, packed_gemm_mb: int = 0,
                 native: bool = False, ancestor_kv: bool = False, kv_reuse: bool = False,
                 fused_cross: bool = False, gemm: str = "mkl"):
        """native: run the layers of a step in C++ where the model and batch allow
        (:mod:`~fairseq_fastgen.models.native_step`; same bits as the Python step);
        ancestor_kv: with the native step, never reorder the self-attention caches (see
        :meth:`reorder`); kv_reuse: a batch's caches take over the last batch's buffers
        (see :mod:`~fairseq_fastgen.models.kv_cache`); fused_cross: with the native step,
        encoder-decoder attention by the C++ kernel of one pass per sentence; gemm: the
        projections' GEMM kernel (:mod:`~fairseq_fastgen.models.gemm_kernel`)."""
        self.stack = DecoderStack(model, bitwise=bitwise, vocab_pad=vocab_pad,
                                  packed_gemm_mb=packed_gemm_mb, gemm=gemm)
        self.model = model
        self.shared_encoder = shared_encoder
        self.kv_cache = kv_cache
        self.bitwise = bitwise
        self.vocab = self.stack.vocab
        self._positions: Optional[Tensor] = None
        self.self_kv: List[KVCache] = []
        self._spare: Spare = None  # the buffers the last layer's reorder left
        self.cross: List[Optional[CrossAttentionCache]] = []
        self.step_idx = 0
        self.beam = 1
        self._first_once = False
        self._native_wanted = native
        self._native: Optional[native_step.NativeLayers] = None
        self._native_now = False  # this batch runs the C++ layers
        self._ancestor_kv = ancestor_kv
        self._kv_reuse = kv_reuse
        self._fused_cross = fused_cross
        self._anc: Optional[Tensor] = None  # (n, max_len+1) int64 in ancestor mode
        self._rows: Optional[Tensor] = None  # arange(n) of the batch, in ancestor mode

    # ---- per batch ----------------------------------------------------------------

    def prepare(self) -> None:
        """Build (or re-read, when the model's weights changed) everything derived from
        the weights: transposed and padded copies, the logit bound.  Cheap when nothing
        changed; called by :meth:`start`, and before forking decoding workers so that they
        share one copy."""
        self.stack.prepare()
        if self._native_wanted and self._native is None:
            self._native_wanted = False  # decided once
            self._native = native_step.build(self.stack, fused_cross=self._fused_cross)

    def native_for_slots(self) -> Optional[native_step.NativeLayers]:
        """The C++ layers for rows at different steps (continuous batching:
        :class:`~fairseq_fastgen.models.slot_decoder.SlotDecoder`), or None: they need
        the native step, ancestor-indexed caches and fp32."""
        self.prepare()
        if self._native is None or not self._ancestor_kv or \
                self.stack.device_dtype()[1] != torch.float32:
            return None
        return self._native

    def start(self, encoder_out: Optional[dict], bsz: int, beam: int, max_len: int) -> None:
        """encoder_out: fairseq encoder output for ``bsz`` sentences (not replicated)."""
        self.step_idx = 0
        self.beam = beam
        self.prepare()
        self._positions = self.stack.position_table(max_len + 1)
        n = bsz * beam
        dev, dtype = self.stack.device_dtype()
        cap = first_capacity(_source_length(encoder_out), max_len + 1)
        old = self.self_kv if self._kv_reuse and len(self.self_kv) == len(self.stack.layers) \
            else [None] * len(self.stack.layers)  # the last batch's, taken over if large enough
        self.self_kv = [KVCache(n, l.dim, max_len + 1, dev, dtype, reuse=prev,
                                preallocate=self.kv_cache, initial=cap)
                        for l, prev in zip(self.stack.layers, old)]
        if not self._kv_reuse:
            self._spare = None
        self.cross = self.stack.cross_caches(encoder_out, beam, shared=self.shared_encoder)
        # At step 0 every hypothesis of a sentence is the same (BOS, empty history): in
        # lossless mode one row per sentence is computed and copied to the beam (fewer
        # GEMM rows: last bits may differ), when cross-attention keeps one copy per sentence.
        self._first_once = beam > 1 and not self.bitwise and all(
            c is None or c.per_sentence for c in self.cross)
        self._native_now = self._native is not None and self.kv_cache and all(
            c is None or c.merged for c in self.cross)
        self._anc = None
        if self._native_now and self._ancestor_kv and dtype == torch.float32:
            self._rows = torch.arange(n, device=dev)  # column t of every step: row h is h
            self._anc = torch.empty(n, max_len + 1, dtype=torch.long, device=dev)
            self._anc[:, 0] = self._rows

    def reorder(self, order: Tensor) -> None:
        """order: (n_new,) int64 row of the previous step each new hypothesis continues.

        In ancestor mode the caches stay where they are: hypothesis h's step-s key/value
        is row ``anc[h, s]`` of step s, so a reorder gathers the (n, t) index table, not
        every layer's (t, n, C) keys and values (19% of generation at batch 64 on the
        bundled model; see benchmarks/results/NOTES.md, "Ancestor-indexed KV cache")."""
        if self._anc is not None:
            t = self.step_idx
            n = order.numel()
            self._anc[:n, :t] = self._anc[:, :t].index_select(0, order)
            self._anc = self._anc[:n]
            self._anc[:, t] = self._rows[:n]
            return
        spare = self._spare
        if spare is not None and self.self_kv and \
                spare[0].numel() < self.self_kv[0].k[:, :1].numel() * order.numel():
            spare = self._spare = None  # outgrown: freed before a new pair is made
        for cache in self.self_kv:  # each layer reorders into the buffers the last one left
            spare = cache.reorder(order, spare)
        self._spare = spare

    def select_sentences(self, sent_idx: Tensor, order: Tensor) -> None:
        """Drop finished sentences: sent_idx (bsz_new,) kept sentences; order as reorder()."""
        for cross in self.cross:
            if cross is not None:
                cross.select(sent_idx, order)

    # ---- per step -----------------------------------------------------------------

    def step(self, tokens: Tensor, need_attn: bool, temperature: float = 1.0) -> StepOutput:
        """One decoder step: log-probabilities of the next word, as fairseq's
        ``get_normalized_probs(..., log_probs=True)`` computes them from the logits divided
        by ``temperature``.

        tokens: (n, step+1) int64, the hypotheses so far (only the last column is read);
        need_attn: also return the head-averaged cross-attention (n, S).
        """
        t = self.step_idx
        rep = self.beam if t == 0 and self._first_once else 1
        positions = self._positions[:, t : t + 1] if self._positions is not None else None
        x = self.stack.embed(tokens[::rep, -1:], positions)  # (n, C): one query per hypothesis

        if self._native_now and rep == 1:
            x, attn = self._native(x, self.self_kv, self.cross, t, self.beam, need_attn,
                                   ancestors=self._anc)
        else:
            def self_attention(i: int, l: LayerWeights, x: Tensor) -> Tensor:
                return self._self_attention(l, self.self_kv[i], x, rep)

            x, attn = self.stack.layers_forward(x, self_attention, self.cross, need_attn,
                                                cross_beam=1 if rep > 1 else None)
        x = self.stack.final_features(x)
        lprobs = self.stack.log_probs(x, temperature)
        finite = self.stack.logits_finite(x)
        if rep > 1:  # one row per sentence computed: every hypothesis gets it
            lprobs = lprobs.repeat_interleave(rep, dim=0)
            if attn is not None:
                attn = attn.repeat_interleave(rep, dim=0)
        self.step_idx += 1
        return StepOutput(lprobs, attn, finite)

    @staticmethod
    def _self_attention(l: LayerWeights, cache: KVCache, x: Tensor, rep: int = 1) -> Tensor:
        """x: (rows, C), one row per hypothesis, or per sentence (rep = beam, step 0)."""
        n, c = x.shape
        q, k, v = l.project_qkv(x)
        keys, values = cache.append(k, v, rep)  # (t+1, n, C) views
        t1 = keys.size(0)
        bh = n * l.heads
        q = q.reshape(bh, 1, l.head_dim)
        # (a view, but for the strided rows of the first step's one-per-sentence queries)
        keys = keys.reshape(t1, bh, l.head_dim).transpose(0, 1)
        values = values.reshape(t1, bh, l.head_dim).transpose(0, 1)
        w = torch.bmm(q, keys.transpose(1, 2))
        p = F.softmax(w, dim=-1, dtype=torch.float32).type_as(w)
        out = torch.bmm(p, values).view(n, c)
        return l.sa_out(out)


def _source_length(encoder_out: Optional[dict]) -> Optional[int]:
    """Padded source length S of fairseq's encoder output (None: no encoder)."""
    if encoder_out is None or len(encoder_out.get("encoder_out", [])) == 0:
        return None
    return encoder_out["encoder_out"][0].size(0)
