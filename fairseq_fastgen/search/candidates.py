"""Beam-search candidate selection without a top-k over every (hypothesis, word) pair.

fairseq's ``BeamSearch.step`` adds each hypothesis' cumulative score to its whole
(vocab,) row of log-probabilities and runs one ``topk`` over the ``beam * vocab`` sums of
each sentence: at batch 64, beam 5 and a 6k vocabulary that is a 1.9M-element add and a
top-k over 30k elements per sentence, every step.

Here the row is cut into chunks of ``CHUNK`` words.  Adding a row's score is monotone in
float32 (rounding preserves order), so a chunk's best sum is ``max(chunk) + score``; the
``k`` best sums of a sentence lie in its ``k`` chunks with the best maxima (a chunk outside
them has a maximum, hence every element, below the k-th best sum).  Only those
``k * CHUNK`` elements (plus a short tail when the vocabulary is not a multiple of
``CHUNK``) get their score added and go through the final top-k.  Each selected sum is
computed exactly as stock computes it (``lprob + score`` in float32), so the values are
stock's; only the order among exactly equal sums may differ from ``torch.topk``'s over the
full row (a tie, which the lossless definition of docs/lossless.md allows; bitwise mode keeps
fairseq's ``BeamSearch.step``).

With ``native`` (``--fastgen-disable native_candidates`` switches it off) CPU float32 rows go to
the C++ extension's ``beam_candidates`` (``csrc/beam_candidates.cpp``): one pass per
sentence keeping its k best sums, a block of 16 words looked at only when one of its sums
(computed as above) beats the k-th best; the same values, equal sums lowest (beam, word)
first.  At batch 8, beam 5 it took candidate selection from ~110 to ~30 us per step
(benchmarks/results/NOTES.md, "Native beam candidates").
"""
from typing import Optional, Tuple

import torch
from torch import Tensor


CHUNK = 64


def top_candidates(lprobs: Tensor, scores: Optional[Tensor], k: int,
                   chunk: int = CHUNK) -> Tuple[Tensor, Tensor, Tensor]:
    """The ``k`` best ``lprobs + scores`` of each sentence, as ``BeamSearch.step`` returns them.

    lprobs: (bsz, beams, V) float, last dimension contiguous (other strides free);
    scores: (bsz, beams) cumulative score of each hypothesis, or None (first step: the
    sums are the log-probabilities themselves).
    Returns scores (bsz, k) float sorted descending, word indices (bsz, k) int64 and beam
    indices (bsz, k) int64.
    """
    bsz, beams, vocab = lprobs.shape
    n_chunks = vocab // chunk
    if n_chunks <= k:  # small vocabulary: nothing to prune
        return full_topk(lprobs, scores, k)
    main = lprobs[..., : n_chunks * chunk].view(bsz, beams, n_chunks, chunk)
    best = main.amax(dim=-1)  # (bsz, beams, n_chunks)
    if scores is not None:
        best = best + scores.unsqueeze(-1)
    _, top = torch.topk(best.view(bsz, -1), k=k, dim=1)  # (bsz, k) chunk ids
    beam_of = torch.div(top, n_chunks, rounding_mode="trunc")
    chunk_of = top - beam_of * n_chunks
    sent = torch.arange(bsz, device=lprobs.device).unsqueeze(1)
    pool = main[sent, beam_of, chunk_of]  # (bsz, k, chunk)
    if scores is not None:
        pool = pool + scores.gather(1, beam_of).unsqueeze(-1)
    offsets = torch.arange(chunk, device=lprobs.device)
    pool_words = (chunk_of * chunk).unsqueeze(-1) + offsets  # (bsz, k, chunk)
    pool_beams = beam_of.unsqueeze(-1).expand(bsz, k, chunk)
    pool, pool_words, pool_beams = (t.reshape(bsz, -1) for t in (pool, pool_words, pool_beams))
    tail_start = n_chunks * chunk
    if tail_start < vocab:  # the last, partial chunk: every hypothesis' tail joins the pool
        tail = lprobs[..., tail_start:]
        if scores is not None:
            tail = tail + scores.unsqueeze(-1)
        width = vocab - tail_start
        tail_words = (tail_start + torch.arange(width, device=lprobs.device)).expand(bsz, beams, width)
        tail_beams = torch.arange(beams, device=lprobs.device).unsqueeze(-1).expand(bsz, beams, width)
        pool = torch.cat([pool, tail.reshape(bsz, -1)], dim=1)
        pool_words = torch.cat([pool_words, tail_words.reshape(bsz, -1)], dim=1)
        pool_beams = torch.cat([pool_beams, tail_beams.reshape(bsz, -1)], dim=1)
    values, pos = torch.topk(pool, k=k, dim=1)
    return values, pool_words.gather(1, pos), pool_beams.gather(1, pos)


def full_topk(lprobs: Tensor, scores: Optional[Tensor], k: int):
    """stock's candidates: one ``topk`` over each sentence's ``beam * V`` sums (its order
    among exact ties); arguments and results as :func:`top_candidates`'s."""
    bsz, beams, vocab = lprobs.shape
    if scores is not None:
        lprobs = lprobs + scores.unsqueeze(-1)
    values, idx = torch.topk(lprobs.reshape(bsz, -1), k=k, dim=1)
    beam = torch.div(idx, vocab, rounding_mode="trunc")
    return values, idx - beam * vocab, beam
