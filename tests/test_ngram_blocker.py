"""The vectorized n-gram blocker against a plain-Python reference of fairseq's CUDA
kernel semantics, on random inputs (hypothesis); the ragged ban (a step per row) against
the uniform one and against the reference row by row."""
import math
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq_fastgen.search.ngram_blocker import (
    TorchNGramBlocker, ban_repeated_ngrams, ban_repeated_ngrams_ragged)


def reference(tokens, lprobs, step, n):
    """fairseq's kernel, one row and one start position at a time."""
    out = lprobs.clone()
    toks = tokens.tolist()
    for r, row in enumerate(toks):
        starts = step - n + 2
        for i in range(max(starts, 0)):
            if all(row[i + k] == row[starts + k] for k in range(n - 1)):
                out[r, row[i + n - 1]] = -math.inf
    return out


@st.composite
def cases(draw):
    n = draw(st.integers(1, 6))
    vocab = draw(st.sampled_from([5, 7, 50, 1000, 50000]))
    rows = draw(st.integers(1, 64))
    step = draw(st.integers(0, 300))
    # few distinct tokens make repeats (and duplicate bans) common
    distinct = draw(st.integers(1, min(vocab, 6)))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    seed = draw(st.integers(0, 2**31 - 1))
    return n, vocab, rows, step, distinct, dtype, seed


def _draw_tensors(case, spare: int):
    """tokens: (rows, step + 2 + spare) drawn from a few distinct words (repeats, and so
    bans, are common); lprobs: (rows, vocab) in the case's dtype."""
    _, vocab, rows, step, distinct, dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(vocab, generator=g)[:distinct]
    tokens = pool[torch.randint(0, distinct, (rows, step + 2 + spare), generator=g)]
    return tokens, torch.randn(rows, vocab, generator=g).to(dtype)


@settings(max_examples=60, deadline=None)
@given(cases())
def test_matches_reference(case):
    n, _, _, step, _, _, _ = case
    tokens, lprobs = _draw_tensors(case, spare=0)
    tokens[:, step + 1:] = 1  # trailing padding, as in the generator's buffer
    expect = reference(tokens, lprobs, step, n)
    got = ban_repeated_ngrams(tokens, lprobs.clone(), step, n)
    assert torch.equal(got, expect)


def test_long_rows_beyond_1024():
    g = torch.Generator().manual_seed(0)
    step = 1500
    tokens = torch.randint(4, 8, (3, step + 2), generator=g)
    lprobs = torch.zeros(3, 10)
    assert torch.equal(ban_repeated_ngrams(tokens, lprobs.clone(), step, 3),
                       reference(tokens, lprobs, step, 3))


def test_blocks_what_stock_cpu_fallback_misses():
    """fairseq #4709: stock's CPU path bans nothing; ours bans the repeat."""
    from fairseq.ngram_repeat_block import NGramRepeatBlock
    tokens = torch.tensor([[2, 5, 6, 7, 5, 6, 1, 1, 1]])  # step 5: last bigram (5, 6) seen before 7
    lprobs = torch.zeros(1, 10)
    ours = TorchNGramBlocker(3)(tokens, lprobs.clone(), 1, 1, 5)
    assert ours[0, 7] == -math.inf and (ours[0, torch.arange(10) != 7] == 0).all()
    stock = NGramRepeatBlock(3, use_extension=False)(tokens, lprobs.clone(), 1, 1, 5)
    assert (stock == 0).all()


class _OpLog(TorchDispatchMode):
    """Records every aten op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _ops(fn):
    with _OpLog() as log:
        out = fn()
    return out, log.ops


def test_no_host_sync_or_python_loop_needed_for_shape():
    """In place, no device-to-host read (``_local_scalar_dense``, what ``.item()``,
    ``.tolist()`` and ``bool()`` dispatch to), and the same ops whatever the number of
    rows or the step (no Python loop over rows or positions)."""
    tokens = torch.randint(4, 9, (320, 102))
    lprobs = torch.randn(320, 6000)
    out, ops = _ops(lambda: ban_repeated_ngrams(tokens, lprobs, 100, 3))
    assert out is lprobs and out.shape == (320, 6000)
    assert "_local_scalar_dense" not in ops and "nonzero" not in ops
    for rows, step in ((1, 100), (64, 100), (320, 30), (320, 80)):
        t, lp = tokens[:rows], lprobs[:rows].clone()
        _, other = _ops(lambda: ban_repeated_ngrams(t, lp, step, 3))
        assert other == ops


def test_ragged_ban_with_host_bound_has_no_host_sync():
    tokens = torch.randint(4, 9, (40, 60))
    steps = torch.randint(0, 50, (40,))
    lprobs = torch.randn(40, 30)
    _, ops = _ops(lambda: ban_repeated_ngrams_ragged(tokens, steps, lprobs, 3, max_step=49))
    assert "_local_scalar_dense" not in ops and "nonzero" not in ops


@settings(max_examples=40, deadline=None)
@given(cases())
def test_ragged_ban_at_one_step_is_the_uniform_ban(case):
    """Every row at the same step: the ragged ban and the uniform one give the same bits."""
    n, _, rows, step, _, _, _ = case
    tokens, lprobs = _draw_tensors(case, spare=3)  # spare columns past the step
    steps = torch.full((rows,), step)
    uniform = ban_repeated_ngrams(tokens, lprobs.clone(), step, n)
    assert torch.equal(ban_repeated_ngrams_ragged(tokens, steps, lprobs.clone(), n), uniform)
    assert torch.equal(ban_repeated_ngrams_ragged(tokens, steps, lprobs.clone(), n,
                                                  max_step=step + 3), uniform)
    assert torch.equal(TorchNGramBlocker(n).ban_ragged(tokens, steps, lprobs.clone()), uniform)


@settings(max_examples=40, deadline=None)
@given(cases())
def test_ragged_ban_matches_a_per_row_loop(case):
    """Rows at different steps: each row as the reference bans it at its own step."""
    n, vocab, rows, step, distinct, dtype, seed = case
    g = torch.Generator().manual_seed(seed)
    pool = torch.randperm(vocab, generator=g)[:distinct]
    width = step + 2
    tokens = pool[torch.randint(0, distinct, (rows, width), generator=g)]
    steps = torch.randint(0, step + 1, (rows,), generator=g)
    lprobs = torch.randn(rows, vocab, generator=g).to(dtype)
    expect = torch.cat([reference(tokens[r:r + 1], lprobs[r:r + 1], int(steps[r]), n)
                        for r in range(rows)])
    hi = int(steps.max())
    for bound in (None, hi, step):  # read on the device, exact host bound, loose host bound
        got = ban_repeated_ngrams_ragged(tokens, steps, lprobs.clone(), n, max_step=bound)
        assert torch.equal(got, expect)


def test_kernel_source_compiles_with_nvcc(tmp_path):
    """A syntax or type error in the CUDA source fails CI even without a GPU."""
    import shutil
    import subprocess
    from fairseq_fastgen.search.cupy_kernels import kernel_source_path
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        pytest.skip("nvcc not installed on this machine")
    p = subprocess.run([nvcc, "-c", "-o", str(tmp_path / "k.o"), str(kernel_source_path())],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    syms = subprocess.run(["nm", str(tmp_path / "k.o")], capture_output=True, text=True).stdout
    for name in ("ban_ngrams_f32", "ban_ngrams_f16", "ban_ngrams_bf16"):
        assert name in syms


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cupy_kernel_matches_reference(dtype):
    pytest.importorskip("cupy", reason="CuPy not installed")
    from fairseq_fastgen.search.cupy_kernels import cupy_ban_repeated_ngrams
    g = torch.Generator().manual_seed(0)
    for n, step in ((1, 5), (2, 40), (3, 1500), (4, 300)):
        tokens = torch.randint(4, 9, (64, step + 2), generator=g)
        lprobs = torch.randn(64, 50, generator=g).to(dtype)
        expect = reference(tokens, lprobs, step, n)
        got = cupy_ban_repeated_ngrams(tokens.cuda(), lprobs.cuda(), step, n).cpu()
        assert torch.equal(got, expect)
