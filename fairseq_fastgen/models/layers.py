"""The decoder layer stack the fast step runs: fairseq's modules, read in fairseq's order.

:class:`~fairseq_fastgen.models.slot_decoder.SlotDecoder` owns the caches and the
self-attention over them; everything else is here, once: the embedding, each layer's
norms, encoder-decoder attention and FFN, the final features, the output projection and
the normalization.  Every arithmetic operation mirrors fairseq's eval-mode path
(``TransformerDecoderBase.extract_features_scriptable`` ->
``TransformerDecoderLayerBase.forward`` -> ``MultiheadAttention.forward``) in the same
order, through transposed weight copies and fused q/k/v GEMMs (other GEMM shapes: lossless
mode; bitwise mode runs stock's modules).
"""
import copy
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.models.transformer import TransformerDecoderBase
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

from . import gemm_kernel, precision
from .cached_attention import CrossAttentionCache
from .linear import TransposedLinear, projection, refresh_all, with_kernel
from .packed_gemm import max_packs as packs_within
from .padded_projection import PaddedProjection, params_key
from .support import standard_normalization

LPROB_BLOCK = 128  # rows per block of the blocked output projection + log_softmax


class LayerWeights:
    """Per-layer projections gathered once:
    :class:`~fairseq_fastgen.models.linear.TransposedLinear` copies of their weights
    (q/k/v fused into one GEMM), or the module itself where a copy does not serve."""

    def __init__(self, layer: TransformerDecoderLayerBase, max_packs: int = 0,
                 onednn: bool = False):
        """max_packs: row counts each projection may pack (see
        :mod:`~fairseq_fastgen.models.packed_gemm`); onednn: the copies' GEMMs run on
        oneDNN (:mod:`~fairseq_fastgen.models.gemm_kernel`)."""
        sa, ea = layer.self_attn, layer.encoder_attn
        self.layer = layer
        self.heads = sa.num_heads
        self.head_dim = sa.head_dim
        self.dim = sa.embed_dim
        self.scaling = sa.scaling
        qkv = [sa.q_proj, sa.k_proj, sa.v_proj]
        p, d = max_packs, onednn  # only the transposed copies use them
        self.qkv = TransposedLinear(qkv, p, d) if TransposedLinear.usable(qkv) else None
        self.sa_out = projection(sa.out_proj, p, d)
        self.fc1 = projection(layer.fc1, p, d)
        self.fc2 = projection(layer.fc2, p, d)
        self.ea_q = projection(ea.q_proj, p, d) if ea is not None else None
        self.ea_out = projection(ea.out_proj, p, d) if ea is not None else None

    def refresh(self) -> None:
        """Re-read copied weights that changed (the model may have trained since)."""
        refresh_all([self.qkv, self.sa_out, self.fc1, self.fc2, self.ea_q, self.ea_out])

    def with_kernel(self, onednn: bool) -> "LayerWeights":
        """These projections on the other GEMM kernel, sharing the weight copies."""
        twin = copy.copy(self)
        for name in ("qkv", "sa_out", "fc1", "fc2", "ea_q", "ea_out"):
            setattr(twin, name, with_kernel(getattr(self, name), onednn))
        return twin

    def project_qkv(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Scaled queries, keys and values of x: (rows, C) each; one fused GEMM where the
        copy serves (else q/k/v GEMMs as stock computes them)."""
        sa = self.layer.self_attn
        c = x.size(-1)
        if self.qkv is not None:
            qkv = self.qkv(x)
            q, k, v = qkv[:, :c], qkv[:, c:2 * c], qkv[:, 2 * c:]
            return q * self.scaling, k, v
        q = sa.q_proj(x)
        k = sa.k_proj(x)
        v = sa.v_proj(x)
        q *= self.scaling
        return q, k, v


# self-attention of one layer: (layer index, its weights, x (rows, C)) -> (rows, C)
SelfAttention = Callable[[int, LayerWeights, Tensor], Tensor]


class DecoderStack:
    """One fairseq ``TransformerDecoder`` as the drivers run it; holds only what is derived
    from the weights (transposed and padded copies, the logit bound), no per-batch state."""

    def __init__(self, model, vocab_pad: bool = True, packed_gemm_mb: int = 0,
                 gemm: str = "mkl"):
        """packed_gemm_mb: MiB of MKL packed weights the projections may keep (lossless
        mode on CPU; 0: plain GEMMs); gemm: the projections' kernel, one of
        :data:`~fairseq_fastgen.config.GEMM_KERNELS` (lossless mode)."""
        self.model = model
        self.decoder: TransformerDecoderBase = model.decoder
        self.onednn = _use_onednn(gemm, self.decoder)
        packs = 0 if self.onednn else packs_within(
            packed_gemm_mb, _projection_bytes(self.decoder))
        # Fused q/k/v and transposed weight copies change GEMM shapes/kernels (last bits):
        # lossless mode only.
        self.layers = [LayerWeights(l, max_packs=packs, onednn=self.onednn)
                       for l in self.decoder.layers]
        # A padded copy of the output projection is a differently blocked GEMM: lossless
        # mode only.
        proj = self.decoder.output_projection
        self._padded_proj = (
            PaddedProjection(proj, max_packs=packs, onednn=self.onednn)
            if vocab_pad and PaddedProjection.worthwhile(proj) else None)
        # logits may carry -inf padding columns past the vocabulary (see PaddedProjection):
        # callers normalize whole rows, then keep [..., :vocab]
        self._out_t = (projection(proj, packs, self.onednn)
                       if proj is not None else None)
        # blocked output projection + log_softmax (another GEMM blocking: lossless mode)
        self._blocked_lprobs = proj is not None and standard_normalization(model)
        self._lprob_buf: Optional[Tensor] = None
        self.vocab = proj.out_features if proj is not None else len(self.decoder.dictionary)
        self._w_bound_key: Optional[tuple] = None  # params_key of the cached weight bound
        self._w_bound: Tuple[float, float] = (0.0, 0.0)

    def with_gemm(self, onednn: bool) -> "DecoderStack":
        """This stack with its projection copies on oneDNN or MKL,
        sharing the copies (continuous batching's reference decoding,
        search/continuous/margins.py); itself when it already runs there."""
        onednn = onednn and gemm_kernel.available()
        if onednn == self.onednn:
            return self
        twin = copy.copy(self)
        twin.onednn = onednn
        twin.layers = [l.with_kernel(onednn) for l in self.layers]
        if self._padded_proj is not None:
            twin._padded_proj = self._padded_proj.with_kernel(onednn)
        twin._out_t = with_kernel(self._out_t, onednn)
        twin._lprob_buf = None
        return twin

    def onednn_serves(self, mode: str) -> bool:
        """Whether oneDNN serves this decoder (``onednn``: fp32 on CPU, where torch has it;
        ``auto``: also measured clearly faster than MKL)."""
        return _use_onednn(mode, self.decoder)

    def prepare(self) -> None:
        """Build (or re-read, when the model's weights changed) everything derived from
        the weights.  Cheap when nothing changed."""
        for l in self.layers:
            l.refresh()
        if self._padded_proj is not None and self._padded_proj.usable():
            self._padded_proj.refresh()
        else:
            refresh_all([self._out_t])
        self._refresh_weight_bound()

    # ---- per batch ----------------------------------------------------------------

    def position_table(self, steps: int) -> Optional[Tensor]:
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

    def cross_caches(self, encoder_out: Optional[dict]) -> List[Optional[CrossAttentionCache]]:
        """Each layer's encoder-decoder keys/values for ``encoder_out`` (fairseq's encoder
        output of bsz sentences, not replicated: once per sentence); None for layers
        without one."""
        enc = pad = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
            if len(encoder_out["encoder_padding_mask"]) > 0:
                pad = encoder_out["encoder_padding_mask"][0]
        caches: List[Optional[CrossAttentionCache]] = []
        with gemm_kernel.linears(self.onednn):  # the keys/values: the modules' own GEMMs
            for l in self.layers:
                ea = l.layer.encoder_attn
                caches.append(None if ea is None or enc is None else
                              CrossAttentionCache(ea, enc, pad))
        return caches

    def device_dtype(self):
        w = self.decoder.output_projection.weight
        return w.device, w.dtype

    # ---- the forward pass -------------------------------------------------------------

    def embed(self, tokens: Tensor, positions: Optional[Tensor]) -> Tensor:
        """tokens: (n, L) int64; positions: their position embeddings, broadcastable to
        (n, L, C), or None.  Returns (n*L, C)."""
        dec = self.decoder
        x = dec.embed_scale * dec.embed_tokens(tokens)
        if dec.project_in_dim is not None:
            x = dec.project_in_dim(x)
        if positions is not None:
            x += positions
        if dec.layernorm_embedding is not None:
            x = dec.layernorm_embedding(x)
        return x.view(-1, x.size(-1))

    def layers_forward(self, x: Tensor, self_attention: SelfAttention,
                       cross: List[Optional[CrossAttentionCache]], need_attn: bool = False,
                       cross_beam: Optional[int] = None) -> Tuple[Tensor, Optional[Tensor]]:
        """x: (rows, C) through every layer.  cross_beam: queries per sentence of the
        encoder-decoder attention (None: the caches' own beam).  Returns (rows, C) and,
        if need_attn, the last layer's head-averaged cross-attention (rows, S)."""
        attn = None
        last = len(self.layers) - 1
        for i, l in enumerate(self.layers):
            x, a = self._layer(i, l, x, self_attention, cross[i], need_attn and i == last,
                               cross_beam)
            if a is not None:
                attn = a
        return x, attn

    def _layer(self, i: int, l: LayerWeights, x: Tensor, self_attention: SelfAttention,
               cross: Optional[CrossAttentionCache], need_attn: bool, cross_beam: Optional[int]):
        layer = l.layer
        residual = x
        if layer.normalize_before:
            x = layer.self_attn_layer_norm(x)
        x = self_attention(i, l, x)
        x = layer.residual_connection(x, residual)
        if not layer.normalize_before:
            x = layer.self_attn_layer_norm(x)
        attn = None
        if cross is not None:
            residual = x
            if layer.normalize_before:
                x = layer.encoder_attn_layer_norm(x)
            x, attn = cross.attend(x, need_attn, beam=cross_beam)
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

    def final_features(self, x: Tensor) -> Tensor:
        """Final layer norm and output dim projection of x: (rows, C)."""
        dec = self.decoder
        if dec.layer_norm is not None:
            x = dec.layer_norm(x)
        if dec.project_out_dim is not None:
            x = dec.project_out_dim(x)
        return x

    def logits_finite(self, x: Tensor) -> bool:
        """Whether the logits of final features x: (rows, C) are surely finite (CPU only:
        elsewhere the bound would cost a host sync; then False).

        |logit| <= max|x| * max_i ||W_i||_1 + max|b|: lets the generator skip its NaN scan
        of the (n, vocab) log-probabilities (log_softmax of finite logits has no NaN).
        Checked on the hidden state, vocab/C times smaller; NaN in x fails the test, so
        the full scan runs."""
        if x.device.type != "cpu":
            return False
        bound = float(x.abs().amax()) * self._w_bound[0] + self._w_bound[1]
        return bound < 1e37  # far below float32's 3.4e38, above any rounding slack

    def log_probs(self, x: Tensor, temperature: float) -> Tensor:
        """(rows, V') float32 log-probabilities of final features x: (rows, C), as
        fairseq's ``get_normalized_probs(..., log_probs=True)`` computes them from the
        logits divided by ``temperature``; V' >= ``vocab``, the columns past it -inf.

        In lossless mode on CPU with fairseq's own normalization, the output projection
        and log_softmax run on blocks of ``LPROB_BLOCK`` rows into a buffer kept across
        steps: each block's logits are normalized while still in cache instead of making
        a round trip through memory (a (rows, vocab) matrix: megabytes per step).
        """
        rows = x.size(0)
        if not self._blocked_lprobs or x.device.type != "cpu" or rows <= LPROB_BLOCK:
            logits = self.project_out(x)
            if temperature != 1.0:
                logits = logits.div_(temperature)
            if self._blocked_lprobs and logits.dtype == torch.float32:
                # = fairseq's chain down to utils.log_softmax, without its call overhead
                return torch.log_softmax(logits, dim=-1)
            return self.model.get_normalized_probs((logits.unsqueeze(1), None), log_probs=True,
                                                   sample=None)[:, 0]
        out = self._lprob_buffer(rows)
        for i in range(0, rows, LPROB_BLOCK):
            logits = self.project_out(x[i: i + LPROB_BLOCK])
            if temperature != 1.0:
                logits = logits.div_(temperature)
            # = fairseq utils.log_softmax(logits, dim=-1), which normalizes half-precision
            # logits in float32 (on CPU: a cast, then the float32 kernel)
            torch.log_softmax(logits.float(), dim=-1, out=out[i: i + LPROB_BLOCK])
        return out

    def project_out(self, x: Tensor) -> Tensor:
        """Logits (rows, V') of final features x: (rows, C); V' >= vocab, the columns past
        the vocabulary -inf.  In float32 under --bf16 (models/precision.py)."""
        with precision.float32_region(x.device.type):  # the weights' own precision
            return self._project_out(x.to(self.device_dtype()[1]))

    def _project_out(self, x: Tensor) -> Tensor:
        if self._padded_proj is not None and self._padded_proj.usable():
            return self._padded_proj(x)
        if self._out_t is not None:
            return self._out_t(x)
        return self.decoder.output_projection(x)

    def _lprob_buffer(self, rows: int) -> Tensor:
        cols = self._padded_proj.padded_size() if self._padded_proj is not None else self.vocab
        buf = self._lprob_buf
        if buf is None or buf.size(0) < rows or buf.size(1) != cols:
            w = self.decoder.output_projection.weight
            buf = self._lprob_buf = torch.empty(rows, cols, device=w.device, dtype=torch.float32)
        return buf[:rows]

    def _refresh_weight_bound(self) -> None:
        """(max_i ||W_i||_1, max|b|) of the output projection, recomputed only when the
        weight changed (a full pass over the vocabulary, as costly as a whole step at batch 1)."""
        proj = self.decoder.output_projection
        w, b = proj.weight, proj.bias
        key = params_key(w, b)
        if self._w_bound_key != key:
            with torch.no_grad():
                w_l1 = float(w.abs().sum(dim=1).amax())
                b_max = float(b.abs().amax()) if b is not None else 0.0
            self._w_bound, self._w_bound_key = (w_l1, b_max), key


def _projection_bytes(decoder) -> int:
    """Bytes of the weights a decoder step multiplies by (its layers' projections and the
    output projection): what packing them for one row count costs."""
    mods = [decoder.output_projection]
    for layer in decoder.layers:
        sa, ea = layer.self_attn, layer.encoder_attn
        mods += [sa.q_proj, sa.k_proj, sa.v_proj, sa.out_proj, layer.fc1, layer.fc2]
        if ea is not None:  # its keys/values are projected once per batch, not per step
            mods += [ea.q_proj, ea.out_proj]
    return sum(m.weight.numel() * m.weight.element_size() for m in mods
               if m is not None and getattr(m, "weight", None) is not None)


def _use_onednn(gemm: str, decoder) -> bool:
    """Whether the decoder's projection copies run on oneDNN (measured on its output
    projection's shape, or its first FFN's without one)."""
    proj = decoder.output_projection
    lin = proj if isinstance(getattr(proj, "weight", None), Tensor) else (
        decoder.layers[0].fc1 if len(decoder.layers) else None)
    if not isinstance(getattr(lin, "weight", None), Tensor):
        return False
    outputs, features = lin.weight.shape
    return gemm_kernel.use_onednn(gemm, features, outputs, lin.weight.device, lin.weight.dtype)
