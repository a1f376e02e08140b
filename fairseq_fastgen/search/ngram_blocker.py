"""Repeated n-gram blocking (``--no-repeat-ngram-size``) that is correct on every device.

Semantics are those of fairseq's CUDA kernel: at step ``t`` every earlier position ``i``
whose ``n-1`` tokens equal the hypothesis' last ``n-1`` tokens bans the token at
``i+n-1``.  fairseq's CPU fallback compares the wrong slice of the token buffer (its
trailing padding) and bans nothing (fairseq issue #4709).

The torch path is vectorized over rows and positions with no host sync: matches are found
on an ``unfold`` view and applied with ``scatter_reduce_(amin)``, which is deterministic
with duplicate bans (a ban is a ``-inf`` minimum; a non-match contributes ``+inf``).
"""
import logging
import math
from typing import Optional

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def ban_repeated_ngrams(tokens: Tensor, lprobs: Tensor, step: int, n: int) -> Tensor:
    """Set lprobs of tokens that would repeat an n-gram to -inf, in place: every row at
    ``step`` (the uniform case of :func:`ban_repeated_ngrams_ragged`).

    tokens: (rows, >= step+1) int64, hypotheses so far (column 0 is BOS)
    lprobs: (rows, vocab) float, next-token log-probabilities
    """
    return _ban(tokens, lprobs, n, step - n + 2, None)


def ban_repeated_ngrams_ragged(tokens: Tensor, steps: Tensor, lprobs: Tensor, n: int,
                               max_step: Optional[int] = None) -> Tensor:
    """:func:`ban_repeated_ngrams` with its own step per row, in place.

    tokens: (rows, W) hypotheses (column 0 is BOS; columns after a row's step ignored);
    steps: (rows,) int64; lprobs: (rows, vocab); max_step: an upper bound of steps known
    on the host (saves reading it; W > max_step needed)."""
    starts = steps - n + 2
    if max_step is not None:
        width = max_step - n + 2
    else:
        width = int(starts.max()) if starts.numel() else 0
    return _ban(tokens, lprobs, n, width, starts)


def _ban(tokens: Tensor, lprobs: Tensor, n: int, width: int, starts: Optional[Tensor]) -> Tensor:
    """width: candidate n-gram start positions 0 .. width-1 (host); starts: (rows,) how
    many of them each row has (None: every row all ``width``, its last n-1 tokens at
    columns width .. width+n-2)."""
    if width <= 0:
        return lprobs
    banned = tokens[:, n - 1 : n - 1 + width]  # (rows, width)
    valid = None
    if starts is not None:
        valid = torch.arange(width, device=tokens.device).unsqueeze(0) < starts.unsqueeze(1)
    if n == 1:
        match = torch.ones_like(banned, dtype=torch.bool) if valid is None else valid
    else:
        windows = tokens.unfold(1, n - 1, 1)[:, :width]  # (rows, width, n-1)
        if starts is None:
            last = tokens[:, width : width + n - 1]  # the hypothesis' last n-1 tokens
        else:
            last_idx = (starts.unsqueeze(1) + torch.arange(n - 1, device=tokens.device)).clamp(min=0)
            last = tokens.gather(1, last_idx)
        match = (windows == last.unsqueeze(1)).all(dim=-1)
        if valid is not None:
            match &= valid
    src = torch.full(banned.shape, math.inf, dtype=lprobs.dtype, device=lprobs.device)
    src.masked_fill_(match, -math.inf)
    lprobs.scatter_reduce_(1, banned, src, reduce="amin")
    return lprobs


class NGramBlocker(nn.Module):
    """The plugin's blockers: fairseq ``NGramRepeatBlock``'s call (every row at one step)
    and :meth:`ban_ragged` (a step per row, for block verification)."""

    def __init__(self, no_repeat_ngram_size: int):
        super().__init__()
        self.no_repeat_ngram_size = no_repeat_ngram_size

    def forward(self, tokens: Tensor, lprobs: Tensor, bsz: int, beam_size: int, step: int):
        return ban_repeated_ngrams(tokens, lprobs, step, self.no_repeat_ngram_size)

    def ban_ragged(self, tokens: Tensor, steps: Tensor, lprobs: Tensor,
                   max_step: Optional[int] = None) -> Tensor:
        """:func:`ban_repeated_ngrams_ragged` (the torch path on every device: the CUDA
        kernel takes one step for all rows)."""
        return ban_repeated_ngrams_ragged(tokens, steps, lprobs, self.no_repeat_ngram_size,
                                          max_step=max_step)


class TorchNGramBlocker(NGramBlocker):
    """Drop-in for fairseq's ``NGramRepeatBlock`` (same call signature), torch only."""


class AutoNGramBlocker(NGramBlocker):
    """CuPy kernel for CUDA tensors when CuPy is usable, the torch path otherwise."""

    def forward(self, tokens: Tensor, lprobs: Tensor, bsz: int, beam_size: int, step: int):
        if lprobs.is_cuda:
            from .cupy_kernels import cupy_ban_repeated_ngrams, cupy_usable

            if cupy_usable():
                return cupy_ban_repeated_ngrams(tokens, lprobs, step, self.no_repeat_ngram_size)
        return ban_repeated_ngrams(tokens, lprobs, step, self.no_repeat_ngram_size)


class CupyNGramBlocker(NGramBlocker):
    """Always the CuPy kernel (CUDA tensors only); errors clearly elsewhere."""

    def forward(self, tokens: Tensor, lprobs: Tensor, bsz: int, beam_size: int, step: int):
        from .cupy_kernels import cupy_ban_repeated_ngrams

        return cupy_ban_repeated_ngrams(tokens, lprobs, step, self.no_repeat_ngram_size)


def corrected_stock_loop(tokens: Tensor, lprobs: Tensor, bsz: int, beam_size: int, step: int,
                         n: int) -> Tensor:
    """fairseq's CPU fallback (``NGramRepeatBlock._no_repeat_ngram``) with #4709 fixed.

    The reference that tests and benchmarks compare against: the same Python loops over
    rows and positions, but the n-gram to check is the hypothesis' last ``n-1`` tokens
    (``tokens[:, step+2-n : step+1]``), not the buffer's trailing padding.
    tokens: (bsz*beam, >= step+1) int64; lprobs: (bsz*beam, vocab), updated in place.
    """
    banned = [[] for _ in range(bsz * beam_size)]
    if step + 2 - n >= 0:
        cpu_tokens = tokens.cpu().tolist()
        check_start_pos = step + 2 - n
        for r in range(bsz * beam_size):
            ngram_to_check = cpu_tokens[r][step + 2 - n : step + 1]
            for i in range(check_start_pos):
                if ngram_to_check == cpu_tokens[r][i : i + n - 1]:
                    banned[r].append(cpu_tokens[r][i + n - 1])
    for r in range(bsz * beam_size):
        lprobs[r][torch.tensor(banned[r], dtype=torch.int64)] = torch.tensor(-math.inf).to(lprobs)
    return lprobs


def build_blocker(n: int, kind: str = "auto") -> nn.Module:
    """The n-gram blocker for ``--fastgen-tune ngram_blocker=kind``."""
    if kind == "stock":
        from fairseq.ngram_repeat_block import NGramRepeatBlock

        return NGramRepeatBlock(n)
    if kind == "torch":
        return TorchNGramBlocker(n)
    if kind == "cupy":
        return CupyNGramBlocker(n)
    return AutoNGramBlocker(n)
