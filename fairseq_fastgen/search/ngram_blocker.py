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

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def ban_repeated_ngrams(tokens: Tensor, lprobs: Tensor, step: int, n: int) -> Tensor:
    """Set lprobs of tokens that would repeat an n-gram to -inf, in place.

    tokens: (rows, >= step+1) int64, hypotheses so far (column 0 is BOS)
    lprobs: (rows, vocab) float, next-token log-probabilities
    """
    starts = step - n + 2  # candidate n-gram start positions 0 .. starts-1
    if starts <= 0:
        return lprobs
    tok = tokens[:, : step + 1]
    banned = tok[:, n - 1 : n - 1 + starts]  # (rows, starts)
    if n == 1:
        match = torch.ones_like(banned, dtype=torch.bool)
    else:
        windows = tok.unfold(1, n - 1, 1)[:, :starts]  # (rows, starts, n-1)
        last = tok[:, starts : starts + n - 1]  # the hypothesis' last n-1 tokens
        match = (windows == last.unsqueeze(1)).all(dim=-1)
    src = torch.full(banned.shape, math.inf, dtype=lprobs.dtype, device=lprobs.device)
    src.masked_fill_(match, -math.inf)
    lprobs.scatter_reduce_(1, banned, src, reduce="amin")
    return lprobs


class TorchNGramBlocker(nn.Module):
    """Drop-in for fairseq's ``NGramRepeatBlock`` (same call signature)."""

    def __init__(self, no_repeat_ngram_size: int):
        super().__init__()
        self.no_repeat_ngram_size = no_repeat_ngram_size

    def forward(self, tokens: Tensor, lprobs: Tensor, bsz: int, beam_size: int, step: int):
        return ban_repeated_ngrams(tokens, lprobs, step, self.no_repeat_ngram_size)


class AutoNGramBlocker(TorchNGramBlocker):
    """CuPy kernel for CUDA tensors when CuPy is usable, the torch path otherwise."""

    def forward(self, tokens: Tensor, lprobs: Tensor, bsz: int, beam_size: int, step: int):
        if lprobs.is_cuda:
            from .cupy_kernels import cupy_ban_repeated_ngrams, cupy_usable

            if cupy_usable():
                return cupy_ban_repeated_ngrams(tokens, lprobs, step, self.no_repeat_ngram_size)
        return ban_repeated_ngrams(tokens, lprobs, step, self.no_repeat_ngram_size)


class CupyNGramBlocker(TorchNGramBlocker):
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
    """The n-gram blocker for ``--fastgen-ngram-blocker kind``."""
    if kind == "stock":
        from fairseq.ngram_repeat_block import NGramRepeatBlock

        return NGramRepeatBlock(n)
    if kind == "torch":
        return TorchNGramBlocker(n)
    if kind == "cupy":
        return CupyNGramBlocker(n)
    return AutoNGramBlocker(n)
