"""Which fairseq decoders the fast drivers can run: the modules and options they mirror."""
from typing import Optional

from fairseq.models.transformer import TransformerDecoderBase
from fairseq.modules import MultiheadAttention
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase


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
