"""oneDNN's GEMM for the decoder projections (models/gemm_kernel.py, --fastgen-tune gemm).

Forced on (``gemm="onednn"``) so that every machine tests it, whatever ``auto`` would
pick there; against stock fairseq in the same test, lossless."""
import time

import pytest
import torch
from torch import nn

from conftest import assert_same_hypos, batches, bundled, generators, load
from fairseq_fastgen.config import FastGenConfig, FastGenConfigError
from fairseq_fastgen.models import gemm_kernel
from fairseq_fastgen.models.linear import TransposedLinear
from fairseq_fastgen.models.padded_projection import PaddedProjection
from fairseq_fastgen.search.continuous import ContinuousBeamSearch

needs_onednn = pytest.mark.skipif(not gemm_kernel.available(),
                                  reason="this torch build has no oneDNN linear op")
ONEDNN = FastGenConfig(gemm="onednn")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_linear_is_addmm_up_to_rounding(rows):
    g = torch.Generator().manual_seed(0)
    x, wt, b = (torch.randn(rows, 48, generator=g), torch.randn(48, 80, generator=g),
                torch.randn(80, generator=g))
    torch.testing.assert_close(gemm_kernel.linear(x, wt, b), torch.addmm(b, x, wt),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemm_kernel.linear(x, wt, None), x @ wt, rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_projection_copies_on_onednn(bias):
    torch.manual_seed(0)
    lins = [nn.Linear(24, 16, bias=bias) for _ in range(3)]
    fused = TransposedLinear(lins, max_packs=4, onednn=True)
    fused.refresh()
    assert fused.packs.max_packs == 0  # MKL packs are for MKL's kernel
    x = torch.randn(6, 24)
    want = torch.cat([l(x) for l in lins], -1)
    torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused(x), gemm_kernel.linear(x, fused.wt, fused.bias))
    out = nn.Linear(24, 37, bias=bias)
    padded = PaddedProjection(out, onednn=True)
    y = padded(x)
    assert y.shape == (6, 64) and torch.isinf(y[:, 37:]).all() and (y[:, 37:] < 0).all()
    torch.testing.assert_close(y[:, :37], out(x), rtol=1e-5, atol=1e-5)
    # not fp32 on CPU: the plain GEMM serves
    xd = x.double()
    fused.wt, fused.bias = fused.wt.double(), None if fused.bias is None else fused.bias.double()
    torch.testing.assert_close(fused(xd), want.double(), rtol=1e-5, atol=1e-5)


def test_modes_and_where_onednn_never_serves(monkeypatch):
    assert FastGenConfig().gemm == "auto"  # oneDNN only under the margin guard
    cpu, f32 = torch.device("cpu"), torch.float32
    assert not gemm_kernel.use_onednn("mkl", 16, 32, cpu, f32)
    assert gemm_kernel.use_onednn("onednn", 16, 32, cpu, f32) == gemm_kernel.available()
    assert not gemm_kernel.use_onednn("onednn", 16, 32, torch.device("cuda"), f32)
    assert not gemm_kernel.use_onednn("auto", 16, 32, cpu, torch.float16)
    monkeypatch.setattr(gemm_kernel, "available", lambda: False)
    assert not gemm_kernel.use_onednn("onednn", 16, 32, cpu, f32)
    with pytest.raises(FastGenConfigError, match="gemm"):
        FastGenConfig(gemm="blas")


@needs_onednn
def test_auto_takes_the_kernel_it_measures_faster(monkeypatch, caplog):
    fast_linear = gemm_kernel.linear

    def slow_linear(x, wt, b):
        time.sleep(0.002)
        return fast_linear(x, wt, b)

    monkeypatch.setattr(gemm_kernel, "linear", slow_linear)
    gemm_kernel._measured_faster.cache_clear()
    with caplog.at_level("INFO", logger="fairseq_fastgen.models.gemm_kernel"):
        assert not gemm_kernel.use_onednn("auto", 64, 96, torch.device("cpu"), torch.float32)
    assert "decoder GEMMs on MKL" in caplog.text
    addmm = torch.addmm

    def slow_addmm(*a):
        time.sleep(0.002)
        return addmm(*a)

    monkeypatch.setattr(gemm_kernel, "linear", fast_linear)
    monkeypatch.setattr(torch, "addmm", slow_addmm)
    gemm_kernel._measured_faster.cache_clear()
    assert gemm_kernel.use_onednn("auto", 64, 96, torch.device("cpu"), torch.float32)
    gemm_kernel._measured_faster.cache_clear()


@needs_onednn
@pytest.mark.parametrize("which", ["postln", "preln", "bart"])
def test_generation_on_onednn_matches_stock(tiny, which):
    """Forced oneDNN runs continuous batching's decoders (under the guard) and leaves the
    batch path, which nothing guards, on MKL: both give stock's hypotheses."""
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    stock, fast = generators(task, models, ONEDNN, beam=5, max_len_b=30)
    for bsz in (1, 7):
        samples = list(batches(task, cfg, bsz, limit=3))
        expected = [stock.generate(models, b) for b in samples]
        for b, e in zip(samples, expected):
            assert_same_hypos(e, fast.generate(models, b), bitwise=False)
        engine = ContinuousBeamSearch(fast, regular=lambda s, p: fast.generate(models, s))
        assert engine.onednn and engine.multiple > 0
        for (_, hypos), e in zip(engine.run(iter([(b, None) for b in samples])), expected):
            assert_same_hypos(e, hypos, bitwise=False)
    assert not fast.decoders()[0].stack.onednn


@needs_onednn
def test_bundled_model_on_onednn_matches_stock_batch_and_stream():
    """The bundled es->en model on oneDNN, batch at a time and continuous (C++ layers
    where built): stock's hypotheses."""
    m = bundled("es-en")
    task, models, cfg = load(m.data, [m.path], extra=["--source-lang", m.src,
                                                       "--target-lang", m.tgt])
    stock, fast = generators(task, models, ONEDNN.replace(continuous="on"), beam=5)
    samples = list(batches(task, cfg, 8, limit=3))
    expected = [stock.generate(models, b) for b in samples]
    for b, e in zip(samples, expected):
        assert_same_hypos(e, fast.generate(models, b), bitwise=False)
    engine = ContinuousBeamSearch(fast, regular=lambda s, p: fast.generate(models, s))
    got = list(engine.run(iter([(b, None) for b in samples])))
    assert len(got) == len(samples)
    for (sample, hypos), e, b in zip(got, expected, samples):
        assert sample is b
        assert_same_hypos(e, hypos, bitwise=False)


def test_bitwise_mode_never_uses_onednn(tiny):
    task, models, cfg = load(tiny.data, [tiny.postln])
    stock, fast = generators(task, models, ONEDNN.replace(bitwise=True), beam=4, max_len_b=20)
    for b in batches(task, cfg, 5, limit=2):
        assert_same_hypos(stock.generate(models, b), fast.generate(models, b), bitwise=True)
    assert not fast.decoders()[0].stack.onednn


def test_cli_flag_and_log_line(tiny):
    from fairseq_fastgen.compare import side_by_side

    args = [str(tiny.data), "--path", str(tiny.preln), "--beam", "4", "--batch-size", "6"]
    res = side_by_side(args, plugin_args=["--fastgen-tune", "gemm=onednn",
                                          "--fastgen-decode-workers", "1"])
    assert res.comparison.lossless, res.comparison.differences[:5]
    assert "gemm=onednn" in res.plugin[0].stderr


@needs_onednn
def test_module_linears_in_the_mode_run_on_onednn():
    """fairseq's encoder and encoder-decoder key/value linears, reached through the mode."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 24)
    x = torch.randn(5, 3, 32)  # (S, bsz, C): the encoder's layout
    onednn = torch.ops.mkldnn._linear_pointwise(x, lin.weight, lin.bias, "none", [], "")
    with torch.no_grad():
        with gemm_kernel.linears(True):
            assert torch.equal(lin(x), onednn)
            lin64 = nn.Linear(32, 24).double()
            assert torch.equal(lin64(x.double()), torch.addmm(  # not fp32: as is
                lin64.bias, x.double().view(15, 32), lin64.weight.t()).view(5, 3, 24))
        torch.testing.assert_close(lin(x), onednn, rtol=1e-5, atol=1e-5)
    with gemm_kernel.linears(True):  # autograd on (training): the module's own GEMM
        y = lin(x)
    assert y.requires_grad and torch.equal(y, lin(x))
