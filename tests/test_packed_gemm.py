"""MKL packed-weight GEMMs of the decoder projections (models/packed_gemm.py)."""
import pytest
import torch
from torch import nn

from conftest import assert_same_hypos, batches, generators, load
from fairseq_fastgen.config import FastGenConfig, FastGenConfigError
from fairseq_fastgen.models import packed_gemm
from fairseq_fastgen.models.linear import TransposedLinear
from fairseq_fastgen.models.packed_gemm import PACK_AFTER, RowPacks

needs_mkl = pytest.mark.skipif(not packed_gemm.available(),
                               reason="this torch build has no MKL packed GEMM ops")


@pytest.fixture(autouse=True)
def two_threads():
    # packed GEMMs serve steps on two threads or more (the tests run on one)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


@needs_mkl
def test_packs_row_counts_used_often_within_the_bound():
    torch.manual_seed(0)
    lin = nn.Linear(32, 48)
    proj = TransposedLinear([lin], max_packs=2)
    proj.refresh()
    for rows, uses in ((5, PACK_AFTER), (7, PACK_AFTER + 2), (3, PACK_AFTER + 4)):
        x = torch.randn(rows, 32)
        for _ in range(uses):
            torch.testing.assert_close(proj(x), lin(x), rtol=1e-5, atol=1e-5)
    # 5 and 7 were packed; 3 (used less than twice as often as 5) did not evict either
    assert sorted(proj.packs.packs) == [5, 7]
    for _ in range(PACK_AFTER * 3):
        proj(torch.randn(3, 32))
    assert sorted(proj.packs.packs) == [3, 7]  # now it did: 5 was the least used


@needs_mkl
def test_a_changed_weight_drops_its_packs():
    lin = nn.Linear(16, 24)
    proj = TransposedLinear([lin], max_packs=4)
    x = torch.randn(6, 16)
    proj.refresh()
    for _ in range(PACK_AFTER + 1):
        proj(x)
    assert 6 in proj.packs.packs
    with torch.no_grad():
        lin.weight.mul_(-2.0)  # trained in place between validations (--eval-bleu)
    proj.refresh()
    assert not proj.packs.packs
    torch.testing.assert_close(proj(x), lin(x), rtol=1e-5, atol=1e-5)


def test_one_thread_runs_plain_gemms():
    torch.set_num_threads(1)
    packs = RowPacks(4)
    for _ in range(PACK_AFTER + 2):
        assert packs.linear(torch.randn(3, 4), torch.randn(4, 5), None) is None
    assert not packs.packs


def test_no_packs_without_budget_or_mkl(monkeypatch):
    assert packed_gemm.max_packs(0, 10 ** 6) == 0
    assert packed_gemm.max_packs(1, 2 ** 21) == 0  # one row count would outgrow 1 MiB
    monkeypatch.setattr(packed_gemm, "available", lambda: False)
    assert packed_gemm.max_packs(256, 10 ** 6) == 0
    packs = RowPacks(0)
    assert packs.linear(torch.randn(3, 4), torch.randn(4, 5), None) is None
    with pytest.raises(FastGenConfigError, match="packed_gemm_mb"):
        FastGenConfig(packed_gemm_mb=-1)


@needs_mkl
@pytest.mark.parametrize("which", ["postln", "preln", "bart"])
def test_packed_generation_matches_stock(tiny, which, monkeypatch):
    monkeypatch.setattr(packed_gemm, "PACK_AFTER", 1)  # pack from the first use
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    stock, fast = generators(task, models, FastGenConfig(packed_gemm_mb=64), beam=5,
                             max_len_b=30)
    for bsz in (1, 7):
        for b in batches(task, cfg, bsz, limit=3):
            assert_same_hypos(stock.generate(models, b), fast.generate(models, b), bitwise=False)
    stack = fast.decoders()[0].stack
    assert stack.layers[0].fc1.packs.packs, "no row count was packed"


def test_bitwise_and_zero_budget_never_pack(tiny):
    task, models, cfg = load(tiny.data, [tiny.postln])
    for fg in (FastGenConfig(bitwise=True), FastGenConfig(packed_gemm_mb=0)):
        stock, fast = generators(task, models, fg, beam=4, max_len_b=20)
        for b in batches(task, cfg, 5, limit=2):
            assert_same_hypos(stock.generate(models, b), fast.generate(models, b),
                              bitwise=fg.bitwise)
        stack = fast.decoders()[0].stack
        assert all(not getattr(p, "packs", RowPacks(0)).packs
                   for l in stack.layers for p in (l.qkv, l.fc1, l.fc2, l.sa_out))
