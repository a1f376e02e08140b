"""Encoder-decoder attention with keys/values kept once per sentence, shared by the beam.

fairseq replicates the encoder output ``beam`` times, projects keys/values for every
hypothesis, and re-gathers them with ``index_select`` at every step although all
hypotheses of a sentence attend to the same source.  Here keys/values are projected once
per sentence and never reordered; only a batch shrink (finished sentences) selects rows.
Projecting once per sentence is exact with one thread; with several, a GEMM over fewer
rows may be split and rounded otherwise, so bitwise mode projects the replicas as fairseq
does.

Two ways to attend:

* lossless (default): the beam's queries become the rows of one GEMM per (sentence,
  head), ``(beam, d) x (d, S)``.  A GEMM of another shape may round the last bit
  differently (~1e-6 on scores).
* bitwise: attention runs exactly fairseq's computation.  For models that fairseq itself
  makes beam-aware (``set_beam_size``, e.g. BART) that is its ``einsum`` over per-sentence
  keys/values, which we reproduce; otherwise keys/values are broadcast to one copy per
  hypothesis once per batch (re-selected only on a shrink) and attention runs fairseq's
  ``(1, d) x (d, S)`` GEMM per (hypothesis, head).
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


class CrossAttentionCache:
    """One decoder layer's encoder-decoder attention over a batch of sentences."""

    def __init__(self, attn, enc: Tensor, pad_mask: Optional[Tensor], beam: int,
                 shared: bool = True, bitwise: bool = False, q_proj=None, out_proj=None):
        """attn: the layer's fairseq MultiheadAttention; enc: (S, bsz, C_enc) encoder
        output of each sentence once; pad_mask: (bsz, S) bool, True at padding;
        q_proj/out_proj: callables for the query/output projections (default: attn's)."""
        self.attn = attn
        self.q_proj = q_proj or attn.q_proj
        self.out_proj = out_proj or attn.out_proj
        self.beam = beam
        self.heads = attn.num_heads
        self.head_dim = attn.head_dim
        self.merged = shared and not bitwise
        # fairseq's own beam-aware path (MultiheadAttention.beam_size > 1, set for BART)
        self.einsum = bitwise and getattr(attn, "beam_size", 1) > 1
        self.per_sentence = self.merged or self.einsum
        s, bsz, _ = enc.shape
        self.pad = pad_mask.bool() if pad_mask is not None and pad_mask.any() else None
        if not self.per_sentence:
            # one copy per hypothesis, fairseq's layout, built once instead of every step.
            # Projected from the replicated encoder output as fairseq projects it: with
            # several threads a GEMM of bsz*S rows need not round as one of bsz*beam*S
            rep = torch.arange(bsz, device=enc.device).repeat_interleave(beam)
            if bitwise:
                k, v = self._project(enc.index_select(1, rep))  # (S, n, C)
                self.pad = self.pad.index_select(0, rep) if self.pad is not None else None
                self.k, self.v = (self._heads(t, s, bsz * beam) for t in (k, v))
                return
        k, v = self._project(enc)  # (S, bsz, C): once per sentence
        self.k, self.v = (self._heads(t, s, bsz) for t in (k, v))
        if not self.per_sentence:
            self.k, self.v, self.pad = self._rows(rep, beam)

    def _heads(self, t: Tensor, s: int, rows: int) -> Tensor:
        """(S, rows, C) -> (rows*H, S, hd) contiguous, as fairseq stores prev_key."""
        return t.contiguous().view(s, rows * self.heads, self.head_dim).transpose(0, 1).contiguous()

    def _project(self, enc: Tensor) -> Tuple[Tensor, Tensor]:
        """Keys and values (S, rows, C) of enc (S, rows, C_enc)."""
        return self.attn.k_proj(enc), self.attn.v_proj(enc)

    def _rows(self, sent_rows: Tensor, per_sent: int):
        """Select sentences (bsz_new,) from (bsz*H, S, hd) caches."""
        s = self.k.size(1)
        k = self.k.view(-1, self.heads, s, self.head_dim).index_select(0, sent_rows)
        v = self.v.view(-1, self.heads, s, self.head_dim).index_select(0, sent_rows)
        pad = self.pad.index_select(0, sent_rows) if self.pad is not None else None
        return (k.view(-1, s, self.head_dim), v.view(-1, s, self.head_dim), pad)

    def select(self, sent_idx: Tensor, order: Tensor) -> None:
        """Keep only sentences sent_idx (bsz_new,) of the current batch.

        order: (bsz_new*beam,) previous-step row of each new hypothesis; in bitwise mode
        the per-hypothesis copies follow it (any beam of the sentence would do: they
        are identical).
        """
        if self.per_sentence:
            self.k, self.v, self.pad = self._rows(sent_idx, 1)
        else:
            self.k, self.v, self.pad = self._rows(order, 1)

    def attend(self, x: Tensor, need_attn: bool, beam: Optional[int] = None
               ) -> Tuple[Tensor, Optional[Tensor]]:
        """x: (n, C) queries, n = bsz*beam (``beam`` may be 1 with one copy per sentence:
        the first step). Returns (n, C) output and optionally the head-averaged attention
        (n, S)."""
        a = self.attn
        n, c = x.shape
        q = self.q_proj(x)
        q *= a.scaling
        s = self.k.size(1)
        if self.merged:
            beam = beam or self.beam
            bsz = n // beam
            q = q.view(bsz, beam, self.heads, self.head_dim).transpose(1, 2)
            q = q.reshape(bsz * self.heads, beam, self.head_dim)
            w = torch.bmm(q, self.k.transpose(1, 2))  # (bsz*H, beam, S)
            if self.pad is not None:
                w = w.view(bsz, self.heads, beam, s).masked_fill(
                    self.pad.view(bsz, 1, 1, s), float("-inf")).view(-1, beam, s)
            p = F.softmax(w, dim=-1, dtype=torch.float32)
            out = torch.bmm(p.type_as(w), self.v)  # (bsz*H, beam, hd)
            out = out.view(bsz, self.heads, beam, self.head_dim).transpose(1, 2)
            out = self.out_proj(out.reshape(n, c))
            attn = None
            if need_attn:
                attn = p.view(bsz, self.heads, beam, s).transpose(0, 1).reshape(
                    self.heads, n, s).mean(dim=0)
            return out, attn
        if self.einsum:
            return self._attend_einsum(q, n, c, s, need_attn)
        q = q.view(n * self.heads, 1, self.head_dim)
        w = torch.bmm(q, self.k.transpose(1, 2))  # (n*H, 1, S)
        if self.pad is not None:
            w = w.view(n, self.heads, 1, s).masked_fill(
                self.pad.view(n, 1, 1, s), float("-inf")).view(n * self.heads, 1, s)
        p = F.softmax(w, dim=-1, dtype=torch.float32)
        out = torch.bmm(p.type_as(w), self.v).view(n, c)
        out = self.out_proj(out)
        attn = None
        if need_attn:
            attn = p.view(n, self.heads, 1, s).transpose(1, 0).mean(dim=0)[:, -1, :]
        return out, attn

    def _attend_einsum(self, q: Tensor, n: int, c: int, s: int, need_attn: bool):
        """fairseq's beam-aware encoder-decoder attention, operation for operation."""
        h, hd = self.heads, self.head_dim
        kv_bsz = self.k.size(0) // h
        q = q.view(n * h, 1, hd)
        w = torch.einsum("bxhtd,bhsd->bxhts", q.view((kv_bsz, -1, h) + q.size()[1:]),
                         self.k.view((kv_bsz, h) + self.k.size()[1:]))
        w = w.reshape((-1,) + w.size()[-2:])
        if self.pad is not None:
            w = w.view(kv_bsz, -1, h, 1, s).masked_fill(
                self.pad.unsqueeze(1).unsqueeze(2).unsqueeze(3), float("-inf"))
            w = w.view(n * h, 1, s)
        p = F.softmax(w, dim=-1, dtype=torch.float32)
        probs = p.type_as(w)
        out = torch.einsum("bxhts,bhsd->bxhtd", probs.view((kv_bsz, -1, h) + probs.size()[1:]),
                           self.v.view((kv_bsz, h) + self.v.size()[1:]))
        out = out.reshape((-1,) + out.size()[-2:])
        out = self.out_proj(out.transpose(0, 1).contiguous().view(n, c))
        attn = None
        if need_attn:
            attn = p.view(n, h, 1, s).transpose(1, 0).mean(dim=0)[:, -1, :]
        return out, attn
