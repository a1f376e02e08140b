"""The C++ decoder layers (models/native_step.py, csrc/decoder_layers.cpp).

They make the Python step's ATen calls on the same shapes, so every step's
log-probabilities must be bit-identical to the Python step's; against stock the
generator tests (which run with the default config, native step on) hold it lossless.
"""
import logging

import pytest
import torch

from conftest import assert_same_hypos, batches, generators, load
from fairseq_fastgen.config import FastGenConfig
from fairseq_fastgen.models import native_step
from fairseq_fastgen.models.fast_decoder import FastDecoder

needs_native = pytest.mark.skipif(native_step.load() is None,
                                  reason=f"C++ extension not built: {native_step.load_error()}")


@torch.no_grad()
def _steps(model, sample, native: bool, beam: int, steps: int, need_attn: bool,
           ancestor_kv: bool = False, drop_at: int = -1, fused_cross: bool = False,
           gemm: str = "mkl"):
    """lprobs (and attention) of ``steps`` decoder steps over a fixed token sequence
    with a fixed beam reorder, on the native or the Python layers; at step ``drop_at``
    the first sentence finishes (the batch shrinks)."""
    d = FastDecoder(model, native=native, ancestor_kv=ancestor_kv, fused_cross=fused_cross,
                    gemm=gemm)
    d.prepare()
    assert (d._native is not None) == native
    assert d.stack.onednn == (gemm == "onednn")
    net = sample["net_input"]
    enc = (model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])
           if getattr(model, "encoder", None) is not None else None)
    bsz = sample["net_input"]["src_tokens"].size(0)
    n = bsz * beam
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, len(model.decoder.dictionary), (n, steps + 1), generator=g)
    tokens[:, 0] = model.decoder.dictionary.eos()
    d.start(enc, bsz, beam, max_len=steps + 4)
    out = []
    for t in range(steps):
        o = d.step(tokens[:, : t + 1], need_attn)
        out.append((o.lprobs.clone(), None if o.attn is None else o.attn.clone()))
        # each sentence's hypotheses swap places: the caches follow a real reorder
        order = torch.arange(n).view(bsz, beam).flip(1)
        if t == drop_at:
            order, bsz = order[1:], bsz - 1
            d.select_sentences(torch.arange(1, bsz + 1), order.reshape(-1))
        order = order.reshape(-1)
        d.reorder(order)
        tokens = tokens[order]
        n = order.numel()
    return out


@needs_native
@pytest.mark.parametrize("which", ["postln", "preln", "bart"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
def test_native_layers_give_the_python_steps_bits(tiny, which, threads, gemm):
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    sample = next(iter(batches(task, cfg, 7)))  # sources of different lengths: padding
    assert sample["net_input"]["src_lengths"].unique().numel() > 1
    torch.set_num_threads(threads)
    try:
        for need_attn in (False, True):
            py = _steps(models[0], sample, False, beam=3, steps=9, need_attn=need_attn,
                        gemm=gemm)
            nat = _steps(models[0], sample, True, beam=3, steps=9, need_attn=need_attn,
                         gemm=gemm)
            for (lp, a), (lp2, a2) in zip(py, nat):
                assert torch.equal(lp, lp2)
                assert (a is None) == (a2 is None) and (a is None or torch.equal(a, a2))
    finally:
        torch.set_num_threads(1)


@needs_native
@pytest.mark.parametrize("which", ["postln", "preln", "bart"])
def test_ancestor_kv_matches_the_reordered_cache(tiny, which):
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    sample = next(iter(batches(task, cfg, 7)))
    torch.set_num_threads(2)
    try:
        py = _steps(models[0], sample, False, beam=3, steps=12, need_attn=True, drop_at=5)
        anc = _steps(models[0], sample, True, beam=3, steps=12, need_attn=True, drop_at=5,
                     ancestor_kv=True)
    finally:
        torch.set_num_threads(1)
    for (lp, a), (lp2, a2) in zip(py, anc):
        assert lp.shape == lp2.shape
        torch.testing.assert_close(lp, lp2, rtol=0, atol=1e-5)  # attention summed otherwise
        torch.testing.assert_close(a, a2, rtol=0, atol=1e-6)


@needs_native
@pytest.mark.parametrize("which", ["postln", "preln", "bart"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_cross_attention_matches_the_batched_gemms(tiny, which, threads):
    """The C++ encoder-decoder attention (padded sources, a batch that shrinks) against
    the Python step's; it sums in another order, so within float rounding."""
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    sample = next(iter(batches(task, cfg, 7)))
    assert sample["net_input"]["src_lengths"].unique().numel() > 1
    torch.set_num_threads(threads)
    try:
        py = _steps(models[0], sample, False, beam=3, steps=10, need_attn=True, drop_at=4)
        fused = _steps(models[0], sample, True, beam=3, steps=10, need_attn=True, drop_at=4,
                       fused_cross=True)
        no_attn = _steps(models[0], sample, True, beam=3, steps=10, need_attn=False,
                         drop_at=4, fused_cross=True)
    finally:
        torch.set_num_threads(1)
    for (lp, a), (lp2, a2), (lp3, a3) in zip(py, fused, no_attn):
        assert lp.shape == lp2.shape and not torch.equal(lp, torch.zeros_like(lp))
        torch.testing.assert_close(lp, lp2, rtol=0, atol=1e-5)
        torch.testing.assert_close(a, a2, rtol=0, atol=1e-6)
        assert a3 is None and torch.equal(lp2, lp3)


@needs_native
def test_native_layers_decoder_only_lm(tiny_lm):
    task, models, cfg = load(tiny_lm.data, [tiny_lm.path], task="language_modeling",
                             extra=["--tokens-per-sample", "64"])
    sample = next(iter(batches(task, cfg, 3)))
    py = _steps(models[0], sample, False, beam=2, steps=6, need_attn=False)
    nat = _steps(models[0], sample, True, beam=2, steps=6, need_attn=False)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(py, nat))


@needs_native
def test_bundled_model_generation_same_with_and_without(caplog):
    from conftest import bundled
    m = bundled("es-en")
    task, models, cfg = load(m.data, [m.path], extra=["--source-lang", m.src,
                                                       "--target-lang", m.tgt])
    stock, fast = generators(task, models, FastGenConfig(), beam=5)
    _, reordered = generators(task, models, FastGenConfig(ancestor_kv=False,
                                                          fused_cross_attention=False), beam=5)
    _, py = generators(task, models, FastGenConfig(native_step=False), beam=5)
    torch.set_num_threads(2)  # packed GEMMs too (two threads or more)
    try:
        for b in batches(task, cfg, 8, limit=3):
            s, f, p = stock.generate(models, b), fast.generate(models, b), py.generate(models, b)
            assert_same_hypos(s, f, bitwise=False)  # ancestor-indexed caches: lossless
            r = reordered.generate(models, b)
            assert_same_hypos(p, r, bitwise=True)  # native == Python step, bit for bit
    finally:
        torch.set_num_threads(1)
    assert fast.decoders()[0]._native is not None
    assert py.decoders()[0]._native is None


@needs_native
def test_bundled_model_kv_reuse_and_native_candidates_lossless():
    """Caches taking over the buffers of batches of other sizes (larger, then smaller,
    then larger again) and the C++ candidates: stock's hypotheses; switched off: too."""
    from conftest import bundled
    m = bundled("es-en")
    task, models, cfg = load(m.data, [m.path], extra=["--source-lang", m.src,
                                                       "--target-lang", m.tgt])
    stock, fast = generators(task, models, FastGenConfig(), beam=5)
    _, off = generators(task, models, FastGenConfig(kv_reuse=False, native_candidates=False),
                        beam=5)
    ptrs = []
    for bsz in (12, 3, 20):
        for b in batches(task, cfg, bsz, limit=1):
            s = stock.generate(models, b)
            assert_same_hypos(s, fast.generate(models, b), bitwise=False)
            assert_same_hypos(s, off.generate(models, b), bitwise=False)
            ptrs.append(fast.decoders()[0].self_kv[0].k.data_ptr())
    assert ptrs[1] == ptrs[0]  # the batch of 3 decoded in the batch of 12's buffers


def test_unsupported_models_and_modes_run_the_python_step(tiny, caplog):
    task, models, cfg = load(tiny.data, [tiny.postln])
    layer = models[0].decoder.layers[0]
    saved = layer.activation_fn
    layer.activation_fn = torch.tanh  # no C++ mirror of it
    try:
        stock, fast = generators(task, models, FastGenConfig(), beam=3)
        with caplog.at_level(logging.INFO):
            for b in batches(task, cfg, 4, limit=2):
                assert_same_hypos(stock.generate(models, b), fast.generate(models, b),
                                  bitwise=False)
        assert fast.decoders()[0]._native is None
        assert "native decoder step off (activation tanh)" in caplog.text
    finally:
        layer.activation_fn = saved
    _, bitwise = generators(task, models, FastGenConfig(bitwise=True), beam=3)
    bitwise.prepare()
    assert bitwise.decoders()[0]._native is None


def test_without_a_compiler_the_python_step_serves(tiny, caplog, monkeypatch):
    monkeypatch.setattr(native_step, "_module", None)
    monkeypatch.setattr(native_step, "_load_error", "RuntimeError: no g++")
    task, models, cfg = load(tiny.data, [tiny.preln])
    stock, fast = generators(task, models, FastGenConfig(), beam=2)
    with caplog.at_level(logging.INFO):
        b = next(iter(batches(task, cfg, 3)))
        assert_same_hypos(stock.generate(models, b), fast.generate(models, b), bitwise=False)
    assert "C++ extension unavailable (RuntimeError: no g++)" in caplog.text
    assert "native candidates off (C++ extension unavailable (RuntimeError: no g++))" \
        in caplog.text


def test_switch_on_the_command_line_and_in_the_log_line(tiny):
    from fairseq import options
    from fairseq_fastgen import config as fg_config
    assert FastGenConfig().native_step is True
    before = fg_config.active()
    try:
        options.parse_args_and_arch(options.get_generation_parser(),
                                    [str(tiny.data), "--fastgen-disable", "native_step",
                                     "--fastgen-disable", "native_candidates", "--fastgen-disable", "kv_reuse",
                                     "--fastgen-disable", "fused_cross_attention"])
        active = fg_config.active()
        assert not (active.native_step or active.native_candidates or active.kv_reuse
                    or active.fused_cross_attention)
    finally:
        fg_config.set_active(before)
    assert "native_step" in FastGenConfig().describe()
    assert "native_step" not in FastGenConfig(native_step=False).describe()
    assert "native_step" not in FastGenConfig(bitwise=True).describe()
    assert "ancestor_kv" in FastGenConfig().describe()
    assert "ancestor_kv" not in FastGenConfig(native_step=False).describe()
    assert "fused_cross_attention" in FastGenConfig().describe()
    assert "fused_cross_attention" not in FastGenConfig(bitwise=True).describe()


def test_a_broken_build_is_built_again(tmp_path, monkeypatch):
    """A build that exists but does not import (a link cut short) is removed and rebuilt,
    not taken as 'no extension' for good."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    name = next(iter(_build_names(monkeypatch)))
    (tmp_path / f"{name}.so").write_bytes(b"not an ELF file")
    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(kw["name"]) or "module")
    assert native_step._import_or_build() == "module"
    assert built == [name] and not (tmp_path / f"{name}.so").exists()


def _build_names(monkeypatch):
    """The extension's build name for this source and CPU (as _import_or_build names it)."""
    from torch.utils import cpp_extension

    names = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: names.append(kw["name"]))
    native_step._import_or_build()
    return names
