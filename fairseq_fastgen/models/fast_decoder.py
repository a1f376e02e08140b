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

Every arithmetic operation mirrors fairseq's eval-mode incremental path
(``TransformerDecoderBase.extract_features_scriptable`` ->
``TransformerDecoderLayerBase.forward`` -> ``MultiheadAttention.forward``), in the same
order and with the same GEMM shapes in bitwise mode.
"""
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.models.transformer import TransformerDecoderBase
from fairseq.modules import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

from .cached_attention import CrossAttentionCache
from .kv_cache import KVCache
from .linear import TransposedLinear, projection, refresh_all
from .padded_projection import PaddedProjection, params_key


LPROB_BLOCK = 128  # rows per block of the blocked output projection + log_softmax


def standard_normalization(model) -> bool:
    """Whether ``model.get_normalized_probs`` is fairseq's log_softmax of the logits (no
    override anywhere in the chain, no ONNX tracing)."""
    from fairseq.models import BaseFairseqModel, FairseqDecoder

    dec = getattr(model, "decoder", None)
    if dec is None or getattr(dec, "adaptive_softmax", None) is not None \
            or getattr(dec, "onnx_trace", False):
        return False
    own = [BaseFairseqModel.get_normalized_probs]
    try:  # its override only calls the scriptable helper
        from fairseq.models.transformer import TransformerModelBase
        own.append(TransformerModelBase.get_normalized_probs)
    except ImportError:  # pragma: no cover - older fairseq
        pass
    return (type(model).get_normalized_probs in own
            and type(model).get_normalized_probs_scriptable
            is BaseFairseqModel.get_normalized_probs_scriptable
            and type(dec).get_normalized_probs is FairseqDecoder.get_normalized_probs
            and type(dec).get_normalized_probs_scriptable
            is FairseqDecoder.get_normalized_probs_scriptable)


def unsupported_reason(model) -> Optional[str]:
    """Why ``model``'s decoder cannot be driven by :class:`FastDecoder` (None if it can)."""
    dec = getattr(model, "decoder", None)
    if not isinstance(dec, TransformerDecoderBase):
        return f"decoder {type(dec).__name__} is not a fairseq TransformerDecoder"
    for name in ("forward", "extract_features", "extract_features_scriptable", "output_layer"):
        if getattr(type(dec), name) is not getattr(TransformerDecoderBase, name):
            return f"{type(dec).__name__} overrides {name}"
    if dec.adaptive_softmax is not None:
        return "adaptive softmax"
    if dec.quant_noise is not None:
        return "quant-noise embedding projection"
    if dec.cross_self_attention:
        return "cross-self-attention"
    if dec.dropout_module.apply_during_inference:
        return "dropout applied during inference"
    for layer in dec.layers:
        reason = _layer_unsupported(layer)
        if reason:
            return reason
    return None


def _layer_unsupported(layer) -> Optional[str]:
    if not isinstance(layer, TransformerDecoderLayerBase) or (
        type(layer).forward is not TransformerDecoderLayerBase.forward
    ):
        return f"decoder layer {type(layer).__name__} has its own forward"
    for extra in ("c_attn", "attn_ln", "ffn_layernorm", "w_resid"):
        if getattr(layer, extra, None) is not None:
            return f"decoder layer option {extra} (NormFormer-style scaling)"
    if layer.cross_self_attention:
        return "cross-self-attention"
    if layer.dropout_module.apply_during_inference or (
        layer.activation_dropout_module.apply_during_inference
    ):
        return "dropout applied during inference"
    for attn in (layer.self_attn, layer.encoder_attn):
        if attn is None:
            continue
        if type(attn).forward is not MultiheadAttention.forward:
            return f"attention module {type(attn).__name__} has its own forward"
        if attn.bias_k is not None or attn.add_zero_attn or getattr(attn, "use_xformers", False):
            return "attention with bias_k/add_zero_attn/xformers"
        if getattr(attn, "skip_embed_dim_check", False) or attn.head_dim * attn.num_heads != attn.embed_dim:
            return "pruned attention heads"
        if attn.dropout_module.apply_during_inference:
            return "dropout applied during inference"
    return None


class _Layer:
    """Per-layer projections gathered once: the model's own modules (bitwise mode), or
    :class:`~fairseq_fastgen.models.linear.TransposedLinear` copies of their weights
    (lossless mode; q/k/v fused into one GEMM)."""

    def __init__(self, layer: TransformerDecoderLayerBase, lossless: bool):
        sa, ea = layer.self_attn, layer.encoder_attn
        self.layer = layer
        self.heads = sa.num_heads
        self.head_dim = sa.head_dim
        self.dim = sa.embed_dim
        self.scaling = sa.scaling
        qkv = [sa.q_proj, sa.k_proj, sa.v_proj]
        self.qkv = TransposedLinear(qkv) if lossless and TransposedLinear.usable(qkv) else None
        self.sa_out = projection(sa.out_proj, lossless)
        self.fc1 = projection(layer.fc1, lossless)
        self.fc2 = projection(layer.fc2, lossless)
        self.ea_q = projection(ea.q_proj, lossless) if ea is not None else None
        self.ea_out = projection(ea.out_proj, lossless) if ea is not None else None

    def refresh(self) -> None:
        """Re-read copied weights that changed (the model may have trained since)."""
        refresh_all([self.qkv, self.sa_out, self.fc1, self.fc2, self.ea_q, self.ea_out])


class FastDecoder:
    """Incremental decoding of one fairseq transformer model, many hypotheses at once.

    Usage per batch: ``start(encoder_out, bsz, beam, max_len)``, then per step
    ``step(tokens)`` and ``reorder(order)``.
    """

    def __init__(self, model, shared_encoder: bool = True, kv_cache: bool = True,
                 bitwise: bool = False, vocab_pad: bool = True):
        self.model = model
        self.decoder: TransformerDecoderBase = model.decoder
        self.shared_encoder = shared_encoder
        self.kv_cache = kv_cache
        self.bitwise = bitwise
        # Fused q/k/v and transposed weight copies change GEMM shapes/kernels (last bits):
        # lossless mode only.
        self.layers = [_Layer(l, lossless=not bitwise) for l in self.decoder.layers]
        self._positions: Optional[Tensor] = None
        self.self_kv: List[KVCache] = []
        self.cross: List[Optional[CrossAttentionCache]] = []
        self.step_idx = 0
        # A padded copy of the output projection is a differently blocked GEMM: lossless
        # mode only.
        proj = self.decoder.output_projection
        self._padded_proj = (
            PaddedProjection(proj)
            if vocab_pad and not bitwise and PaddedProjection.worthwhile(proj) else None)
        # logits may carry -inf padding columns past the vocabulary (see PaddedProjection):
        # callers normalize whole rows, then keep [..., :vocab]
        self._out_t = projection(proj, transposed=not bitwise) if proj is not None else None
        # blocked output projection + log_softmax (another GEMM blocking: lossless mode)
        self._blocked_lprobs = not bitwise and proj is not None and standard_normalization(model)
        self._lprob_buf: Optional[Tensor] = None
        self.vocab = proj.out_features if proj is not None else len(self.decoder.dictionary)
        self._w_bound_key: Optional[tuple] = None  # params_key of the cached _weight_bound
        self._w_bound_cache: Tuple[float, float] = (0.0, 0.0)

    # ---- per batch ----------------------------------------------------------------

    def prepare(self) -> None:
        """Build (or re-read, when the model's weights changed) everything derived from
        the weights: transposed and padded copies, the logit bound.  Cheap when nothing
        changed; called by :meth:`start`, and before forking decoding workers so that they
        share one copy."""
        for l in self.layers:
            l.refresh()
        if self._padded_proj is not None and self._padded_proj.usable():
            self._padded_proj.refresh()
        else:
            refresh_all([self._out_t])
        self._w_bound = self._weight_bound()

    def start(self, encoder_out: Optional[dict], bsz: int, beam: int, max_len: int,
              self_kv: bool = True) -> None:
        """encoder_out: fairseq encoder output for ``bsz`` sentences (not replicated);
        self_kv False: the caller brings its own self-attention caches."""
        self.step_idx = 0
        self.beam = beam
        self.prepare()
        self._positions = self._position_table(max_len + 1)
        self.logits_finite = False
        enc = pad = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
            if len(encoder_out["encoder_padding_mask"]) > 0:
                pad = encoder_out["encoder_padding_mask"][0]
        n = bsz * beam
        dev, dtype = self._device_dtype()
        self.self_kv = [
            KVCache(n, l.dim, max_len + 1, dev, dtype, preallocate=self.kv_cache)
            for l in self.layers
        ] if self_kv else []
        self.cross = []
        for l in self.layers:
            ea = l.layer.encoder_attn
            if ea is None or enc is None:
                self.cross.append(None)
            else:
                self.cross.append(CrossAttentionCache(
                    ea, enc, pad, beam, shared=self.shared_encoder, bitwise=self.bitwise,
                    q_proj=l.ea_q, out_proj=l.ea_out))
        # At step 0 every hypothesis of a sentence is the same (BOS, empty history): in
        # lossless mode one row per sentence is computed and copied to the beam (fewer
        # GEMM rows: last bits may differ), when cross-attention keeps one copy per sentence.
        self._first_once = beam > 1 and not self.bitwise and all(
            c is None or c.per_sentence for c in self.cross)

    def reorder(self, order: Tensor) -> None:
        """order: (n_new,) int64 row of the previous step each new hypothesis continues."""
        for cache in self.self_kv:
            cache.reorder(order)

    def select_sentences(self, sent_idx: Tensor, order: Tensor) -> None:
        """Drop finished sentences: sent_idx (bsz_new,) kept sentences; order as reorder()."""
        for cross in self.cross:
            if cross is not None:
                cross.select(sent_idx, order)

    # ---- per step -----------------------------------------------------------------

    def step(self, tokens: Tensor, need_attn: bool, temperature: float = 1.0
             ) -> Tuple[Tensor, Optional[Tensor]]:
        """One decoder step: log-probabilities of the next word, as fairseq's
        ``get_normalized_probs(..., log_probs=True)`` computes them from the logits divided
        by ``temperature``.

        tokens: (n, step+1) int64, the hypotheses so far (only the last column is read)
        returns lprobs (n, V') float32 with V' >= ``self.vocab`` (columns past it -inf) and,
        if need_attn, head-averaged cross-attention (n, S)
        """
        dec = self.decoder
        t = self.step_idx
        rep = self.beam if t == 0 and self._first_once else 1
        last = tokens[::rep, -1:]
        x = dec.embed_scale * dec.embed_tokens(last)
        if dec.project_in_dim is not None:
            x = dec.project_in_dim(x)
        if self._positions is not None:
            x += self._positions[:, t : t + 1]
        if dec.layernorm_embedding is not None:
            x = dec.layernorm_embedding(x)
        x = x.view(-1, x.size(-1))  # (n, C): one query per hypothesis
        attn = None
        last_layer = len(self.layers) - 1
        for i, l in enumerate(self.layers):
            x, a = self._layer(l, i, x, need_attn and i == last_layer, rep)
            if a is not None:
                attn = a
        lprobs = self._log_probs(self._final_features(x), temperature)
        if rep > 1:  # one row per sentence computed: every hypothesis gets it
            lprobs = lprobs.repeat_interleave(rep, dim=0)
            if attn is not None:
                attn = attn.repeat_interleave(rep, dim=0)
        self.step_idx += 1
        return lprobs, attn

    def _log_probs(self, x: Tensor, temperature: float) -> Tensor:
        """(rows, V') float32 log-probabilities of final features x: (rows, C).

        In lossless mode on CPU with fairseq's own normalization, the output projection
        and log_softmax run on blocks of ``LPROB_BLOCK`` rows into a buffer kept across
        steps: each block's logits are normalized while still in cache instead of making
        a round trip through memory (a (rows, vocab) matrix: megabytes per step).
        """
        rows = x.size(0)
        if not self._blocked_lprobs or x.device.type != "cpu" or rows <= LPROB_BLOCK:
            logits = self._project_out(x)
            if temperature != 1.0:
                logits = logits.div_(temperature)
            return self.model.get_normalized_probs((logits.unsqueeze(1), None), log_probs=True,
                                                   sample=None)[:, 0]
        out = self._lprob_buffer(rows)
        for i in range(0, rows, LPROB_BLOCK):
            logits = self._project_out(x[i: i + LPROB_BLOCK])
            if temperature != 1.0:
                logits = logits.div_(temperature)
            # = fairseq utils.log_softmax(logits, dim=-1) (float32)
            torch.log_softmax(logits, dim=-1, out=out[i: i + LPROB_BLOCK])
        return out

    def _lprob_buffer(self, rows: int) -> Tensor:
        cols = self._padded_proj.padded_size() if self._padded_proj is not None else self.vocab
        buf = self._lprob_buf
        if buf is None or buf.size(0) < rows or buf.size(1) != cols:
            w = self.decoder.output_projection.weight
            buf = self._lprob_buf = torch.empty(rows, cols, device=w.device, dtype=torch.float32)
        return buf[:rows]

    def _project_out(self, x: Tensor) -> Tensor:
        """Logits (rows, V') of final features x: (rows, C); V' >= self.vocab, the columns
        past the vocabulary -inf."""
        if self._padded_proj is not None and self._padded_proj.usable():
            return self._padded_proj(x)
        if self._out_t is not None:
            return self._out_t(x)
        return self.decoder.output_projection(x)

    def _weight_bound(self) -> Tuple[float, float]:
        """(max_i ||W_i||_1, max|b|) of the output projection, recomputed only when the
        weight changed (a full pass over the vocabulary: ~1 ms, a step's worth at batch 1)."""
        proj = self.decoder.output_projection
        w, b = proj.weight, proj.bias
        key = params_key(w, b)
        if self._w_bound_key != key:
            with torch.no_grad():
                w_l1 = float(w.abs().sum(dim=1).amax())
                b_max = float(b.abs().amax()) if b is not None else 0.0
            self._w_bound_cache, self._w_bound_key = (w_l1, b_max), key
        return self._w_bound_cache

    def _logits_surely_finite(self, x: Tensor) -> bool:
        """Whether x @ W.T + b cannot overflow: |logit| <= max|x| * max_i ||W_i||_1 + max|b|.

        Lets the generator skip its NaN scan of the (n, vocab) log-probabilities: log_softmax
        of finite logits has no NaN.  Checked on the (n, C) hidden state, vocab/C times
        smaller; NaN in x makes the test fail, so the full scan runs.
        """
        bound = float(x.abs().amax()) * self._w_bound[0] + self._w_bound[1]
        return bound < 1e37  # far below float32's 3.4e38, above any rounding slack

    def _layer(self, l: _Layer, i: int, x: Tensor, need_attn: bool, rep: int = 1):
        """x: (rows, C), one row per hypothesis, or per sentence (rep = beam, step 0)."""
        layer = l.layer
        residual = x
        if layer.normalize_before:
            x = layer.self_attn_layer_norm(x)
        x = self._self_attention(l, self.self_kv[i], x, rep)
        x = layer.residual_connection(x, residual)
        if not layer.normalize_before:
            x = layer.self_attn_layer_norm(x)
        attn = None
        cross = self.cross[i]
        if cross is not None:
            residual = x
            if layer.normalize_before:
                x = layer.encoder_attn_layer_norm(x)
            x, attn = cross.attend(x, need_attn, beam=1 if rep > 1 else None)
            x = layer.residual_connection(x, residual)
            if not layer.normalize_before:
                x = layer.encoder_attn_layer_norm(x)
        residual = x
        if layer.normalize_before:
            x = layer.final_layer_norm(x)
        x = l.fc1(x)
        # in place: the same relu without a second (rows, ffn) buffer
        x = x.relu_() if layer.activation_fn is F.relu else layer.activation_fn(x)
        x = l.fc2(x)
        x = layer.residual_connection(x, residual)
        if not layer.normalize_before:
            x = layer.final_layer_norm(x)
        return x, attn

    def _final_features(self, x: Tensor) -> Tensor:
        """Final layer norm and output dim projection of x: (rows, C); on CPU also proves
        the coming logits finite (see _logits_surely_finite)."""
        dec = self.decoder
        if dec.layer_norm is not None:
            x = dec.layer_norm(x)
        if dec.project_out_dim is not None:
            x = dec.project_out_dim(x)
        if x.device.type == "cpu":
            self.logits_finite = self._logits_surely_finite(x)
        return x

    @staticmethod
    def _project_qkv(l: _Layer, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Scaled queries, keys and values of x: (rows, C) each; one fused GEMM unless
        bitwise (then q/k/v GEMMs as stock computes them)."""
        sa = l.layer.self_attn
        c = x.size(-1)
        if l.qkv is not None:
            qkv = l.qkv(x)
            q, k, v = qkv[:, :c], qkv[:, c:2 * c], qkv[:, 2 * c:]
            return q * l.scaling, k, v
        q = sa.q_proj(x)
        k = sa.k_proj(x)
        v = sa.v_proj(x)
        q *= l.scaling
        return q, k, v

    def _self_attention(self, l: _Layer, cache: KVCache, x: Tensor, rep: int = 1) -> Tensor:
        n, c = x.shape
        q, k, v = self._project_qkv(l, x)
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

    # ---- helpers --------------------------------------------------------------------

    def _position_table(self, steps: int) -> Optional[Tensor]:
        """Position embeddings of steps 0..steps-1, (1, steps, C), in one lookup per batch.

        A row of non-pad tokens gets positions padding_idx+1.. exactly as fairseq's
        incremental lookup gives step t position padding_idx+t+1 (learned or sinusoidal).
        """
        pos = self.decoder.embed_positions
        if pos is None:
            return None
        dev = self.decoder.output_projection.weight.device
        dummy = torch.full((1, steps), self.decoder.padding_idx + 1, dtype=torch.long, device=dev)
        return pos(dummy)

    def _device_dtype(self):
        w = self.decoder.output_projection.weight
        return w.device, w.dtype
