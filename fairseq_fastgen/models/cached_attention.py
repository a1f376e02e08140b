"""Encoder-decoder keys/values projected once per sentence, shared by the beam.

fairseq replicates the encoder output ``beam`` times, projects keys/values for every
hypothesis, and re-gathers them with ``index_select`` at every step although all
hypotheses of a sentence attend to the same source.  Here a batch's keys/values are
projected once per sentence (the decoder's slots then hold them:
:class:`~fairseq_fastgen.models.slot_decoder.SlotCross`, where the beam's queries become
the rows of one GEMM per sentence and head).  Projecting once per sentence is exact with
one thread; with several, a GEMM over fewer rows may be split and rounded otherwise
(lossless mode; bitwise mode runs stock's modules).
"""
from typing import Optional

from torch import Tensor


class CrossAttentionCache:
    """One decoder layer's encoder-decoder keys/values of a batch's sentences:
    k, v: (bsz*H, S, hd) contiguous, as fairseq stores ``prev_key``; pad: (bsz, S) bool,
    True at padding, or None."""

    def __init__(self, attn, enc: Tensor, pad_mask: Optional[Tensor]):
        """attn: the layer's fairseq MultiheadAttention; enc: (S, bsz, C_enc) encoder
        output of each sentence once; pad_mask: (bsz, S) bool, True at padding."""
        s, bsz, _ = enc.shape
        self.pad = pad_mask.bool() if pad_mask is not None and pad_mask.any() else None
        heads, hd = attn.num_heads, attn.head_dim
        self.k, self.v = (t.contiguous().view(s, bsz * heads, hd).transpose(0, 1).contiguous()
                          for t in (attn.k_proj(enc), attn.v_proj(enc)))


def source_length(encoder_out: Optional[dict]) -> Optional[int]:
    """Padded source length S of fairseq's encoder output (None: no encoder)."""
    if encoder_out is None or len(encoder_out.get("encoder_out", [])) == 0:
        return None
    return encoder_out["encoder_out"][0].size(0)
