"""fairseq's ``Sampling.step`` with its draws audited: which draws sat on a boundary.

In lossless mode the fast decoder's log-probabilities differ from stock's by a float
rounding (~1e-6), so a draw picks stock's token unless one of its comparisons is that
close.  :func:`audited_step` makes stock's draws and counts the draws that were:

* **the draw itself.**  For one sample per row, ``torch.multinomial`` (ATen's fast path
  for ``n_sample == 1``) fills ``q ~ Exp(1)`` with one number per entry, in order, and
  takes ``argmax(p / q)``.  This module does exactly that, with the same generator and
  shapes, so the same seed gives stock's tokens and the same stream after them (a test
  holds it against ``torch.multinomial``); it then sees the margin between the best and
  the second ratio.  Invalid rows (inf, NaN, negative, all zero) go to
  ``torch.multinomial`` itself, which raises stock's error before drawing.
* **top-k** (``--sampling-topk``): the k-th and the next log-probability.
* **top-p** (``--sampling-topp``): the kept set is the words whose cumulative
  probability stays below p, plus one; it changes when the mass before the last kept word
  or the kept mass is within the tolerance of p.  The kept width also sets how many
  exponentials the batch draws, so such a draw can change the batch and, with one random
  stream, the rest of the run.

Step 0 with beam > 1 draws ``beam`` samples with replacement (another ATen algorithm,
uniforms over the cumulative distribution): those draws are stock's call, not audited.

A boundary draw is one whose margin is below :data:`TOLERANCE` (relative for ratios and
probabilities, absolute for cumulative mass): the count is an upper bound on the draws
where lossless mode may choose otherwise than stock.  Bitwise mode (stock's exact
log-probabilities) calls stock's ``Sampling.step``.
"""
import math
from typing import Tuple

import torch
from torch import Tensor

TOLERANCE = 2e-6


def audited_step(search, step: int, lprobs: Tensor, scores: Tensor
                 ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``search.step(step, lprobs, scores)`` of a fairseq ``Sampling`` search, and the
    number of boundary draws as a 0-dim int64 tensor (no host read).

    lprobs: (bsz, beam, V) float, modified in place as stock's step does;
    scores: (bsz, beam, step). Returns scores (bsz, beam), indices (bsz, beam),
    beams (bsz, beam), boundary draws ().
    """
    bsz, beam_size, _ = lprobs.size()
    if step == 0:
        lprobs = lprobs[:, ::beam_size, :].contiguous()
    near = torch.zeros((), dtype=torch.long, device=lprobs.device)
    if search.sampling_topp > 0:
        probs, top_indices = search._sample_topp(lprobs)
        near += _topp_near(probs, search.sampling_topp)
    elif search.sampling_topk > 0:
        near += _topk_near(lprobs, search.sampling_topk)
        lprobs, top_indices = lprobs.topk(search.sampling_topk)
        probs = lprobs.exp_()
    else:
        probs = lprobs.exp_()
        top_indices = torch.empty(0).to(probs)
    if step == 0 and beam_size > 1:
        indices_buf = torch.multinomial(probs.view(bsz, -1), beam_size,
                                        replacement=True).view(bsz, beam_size)
    else:
        drawn, drawn_near = _draw_one(probs.view(bsz * beam_size, -1))
        indices_buf = drawn.view(bsz, beam_size)
        near += drawn_near
    if step == 0:
        probs = probs.expand(bsz, beam_size, -1)
    scores_buf = torch.gather(probs, dim=2, index=indices_buf.unsqueeze(-1))
    scores_buf = scores_buf.log_().view(bsz, -1)
    if search.sampling_topk > 0 or search.sampling_topp > 0:
        indices_buf = torch.gather(top_indices.expand(bsz, beam_size, -1), dim=2,
                                   index=indices_buf.unsqueeze(-1)).squeeze(2)
    if step == 0:
        beams_buf = indices_buf.new_zeros(bsz, beam_size)
    else:
        beams_buf = torch.arange(0, beam_size).to(indices_buf).repeat(bsz, 1)
        scores_buf.add_(torch.gather(scores[:, :, step - 1], dim=1, index=beams_buf))
    return scores_buf, indices_buf, beams_buf, near


def _draw_one(probs: Tensor) -> Tuple[Tensor, Tensor]:
    """``torch.multinomial(probs, 1, replacement=True)`` and its boundary draws.

    probs: (rows, W) float >= 0. Returns (rows, 1) int64 and a 0-dim count."""
    valid = (probs.max() < math.inf) & (probs.min() >= 0) & (probs.sum(-1) > 0).all()
    if not bool(valid):  # stock's error, raised before anything is drawn
        return torch.multinomial(probs, 1, replacement=True), torch.zeros((), dtype=torch.long)
    q = torch.empty_like(probs).exponential_(1)
    ratio = torch.div(probs, q, out=q)
    if ratio.size(-1) < 2:
        return ratio.argmax(-1, keepdim=True), torch.zeros((), dtype=torch.long)
    best = ratio.topk(2, dim=-1).values
    near = (best[:, 0] - best[:, 1]) <= TOLERANCE * best[:, 0]
    return ratio.argmax(-1, keepdim=True), near.sum()


def _topk_near(lprobs: Tensor, k: int) -> Tensor:
    """Rows whose k-th and (k+1)-th log-probabilities are within the tolerance (ties
    included).  lprobs: (bsz, beam, V)."""
    if k >= lprobs.size(-1):
        return torch.zeros((), dtype=torch.long, device=lprobs.device)
    kth = lprobs.topk(k, dim=-1).values[..., -1:]
    at_or_above = lprobs >= kth
    below = lprobs.masked_fill(at_or_above, -math.inf).max(-1, keepdim=True).values
    tie = at_or_above.sum(-1, keepdim=True) > k
    # log-probabilities: an absolute gap is the relative gap of the probabilities; a -inf
    # k-th word (fewer than k allowed) is never drawn, whichever ties with it
    close = kth - below <= TOLERANCE
    return ((tie | close) & torch.isfinite(kth)).sum()


def _topp_near(trimmed: Tensor, p: float) -> Tensor:
    """Rows whose kept set sits within the tolerance of p.  trimmed: (bsz, beam, W) the
    kept probabilities in descending order, zeros after the last kept one."""
    kept_mass = trimmed.sum(-1)
    kept = (trimmed > 0).sum(-1, keepdim=True).clamp_(min=1)
    last = trimmed.gather(-1, kept - 1).squeeze(-1)
    before_last = kept_mass - last
    return ((p - before_last <= TOLERANCE) | (kept_mass - p <= TOLERANCE)).sum()
