"""The C++ decoder layers (models/native_step.py, csrc/decoder_layers.cpp) against the
Python step they accelerate (models/slot_decoder.py, the reference).

They make the Python step's ATen calls on the same shapes for the norms, projections, FFN
and batched encoder-decoder attention, so a first step (whose self-attention weighs one
key by exactly 1) is bit-identical; their own attention kernels sum in another order, so
later steps agree within float rounding; against stock the generator tests (which run
with the default config, native step on) hold it lossless.
"""
import logging

import pytest
import torch

from conftest import assert_same_hypos, batches, generators, load
from fairseq_fastgen.config import FastGenConfig
from fairseq_fastgen.models import native_step
from fairseq_fastgen.models.layers import DecoderStack
from fairseq_fastgen.models.slot_decoder import SlotDecoder

needs_native = pytest.mark.skipif(native_step.load() is None,
                                  reason=f"C++ extension not built: {native_step.load_error()}")


@torch.no_grad()
def _steps(model, sample, native: bool, beam: int, steps: int, need_attn: bool,
           drop_at: int = -1, fused_cross: bool = False, gemm: str = "mkl"):
    """lprobs (and attention) of ``steps`` decoder steps over a fixed token sequence
    with a fixed beam reorder, on the native or the Python layers; at step ``drop_at``
    the first sentence finishes (the batch shrinks)."""
    d = SlotDecoder(DecoderStack(model, gemm=gemm), beam, build_native=native,
                    fused_cross=fused_cross)
    assert (d.native() is not None) == native
    assert d.stack.onednn == (gemm == "onednn")
    net = sample["net_input"]
    enc = (model.encoder(net["src_tokens"], src_lengths=net["src_lengths"])
           if getattr(model, "encoder", None) is not None else None)
    bsz = sample["net_input"]["src_tokens"].size(0)
    n = bsz * beam
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, len(model.decoder.dictionary), (n, steps + 1), generator=g)
    tokens[:, 0] = model.decoder.dictionary.eos()
    d.start(enc, bsz, steps + 4)
    out = []
    for t in range(steps):
        o = d.step(tokens[:, t], None, t, need_attn=need_attn)
        out.append((o.lprobs.clone(), None if o.attn is None else o.attn.clone()))
        # each sentence's hypotheses swap places: the caches follow a real reorder
        order = torch.arange(n).view(bsz, beam).flip(1)
        keep = None
        if t == drop_at:
            order, bsz = order[1:], bsz - 1
            keep = torch.arange(1, bsz + 1)
        order = order.reshape(-1)
        d.reorder(order, keep, t + 1)
        tokens = tokens[order]
        n = order.numel()
    return out


@needs_native
@pytest.mark.parametrize("which", ["postln", "preln", "bart"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
def test_native_layers_give_the_python_steps_bits_at_a_first_step(tiny, which, threads, gemm):
    """Everything but the attention kernels: the Python step's bits (one key: weight 1)."""
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    sample = next(iter(batches(task, cfg, 7)))  # sources of different lengths: padding
    assert sample["net_input"]["src_lengths"].unique().numel() > 1
    torch.set_num_threads(threads)
    try:
        for need_attn in (False, True):
            py = _steps(models[0], sample, False, beam=3, steps=1, need_attn=need_attn,
                        gemm=gemm)
            nat = _steps(models[0], sample, True, beam=3, steps=1, need_attn=need_attn,
                         gemm=gemm)
            (lp, a), (lp2, a2) = py[0], nat[0]
            assert torch.equal(lp, lp2)
            assert (a is None) == (a2 is None) and (a is None or torch.equal(a, a2))
    finally:
        torch.set_num_threads(1)


@needs_native
@pytest.mark.parametrize("which", ["postln", "preln", "bart"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fused_cross", [False, True])
def test_native_layers_match_the_python_step(tiny, which, threads, fused_cross):
    """Many steps, beams reordered, a batch that shrinks, padded sources: the ancestor
    table and (fused_cross) the C++ encoder-decoder attention sum in another order, so
    within float rounding; without attention weights asked, the same log-probabilities."""
    task, models, cfg = load(tiny.data, [getattr(tiny, which)])
    sample = next(iter(batches(task, cfg, 7)))
    assert sample["net_input"]["src_lengths"].unique().numel() > 1
    torch.set_num_threads(threads)
    try:
        py = _steps(models[0], sample, False, beam=3, steps=12, need_attn=True, drop_at=5)
        nat = _steps(models[0], sample, True, beam=3, steps=12, need_attn=True, drop_at=5,
                     fused_cross=fused_cross)
        no_attn = _steps(models[0], sample, True, beam=3, steps=12, need_attn=False,
                         drop_at=5, fused_cross=fused_cross)
    finally:
        torch.set_num_threads(1)
    for (lp, a), (lp2, a2), (lp3, a3) in zip(py, nat, no_attn):
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
    assert torch.equal(py[0][0], nat[0][0])
    for a, b in zip(py, nat):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-5)


@needs_native
def test_bundled_model_generation_same_with_and_without(caplog):
    from conftest import bundled
    m = bundled("es-en")
    task, models, cfg = load(m.data, [m.path], extra=["--source-lang", m.src,
                                                       "--target-lang", m.tgt])
    stock, fast = generators(task, models, FastGenConfig(), beam=5)
    _, py = generators(task, models, FastGenConfig(native_step=False), beam=5)
    torch.set_num_threads(2)  # packed GEMMs too (two threads or more)
    try:
        for b in batches(task, cfg, 8, limit=3):
            s, f, p = stock.generate(models, b), fast.generate(models, b), py.generate(models, b)
            assert_same_hypos(s, f, bitwise=False)  # ancestor-indexed caches: lossless
            assert_same_hypos(s, p, bitwise=False)
    finally:
        torch.set_num_threads(1)
    assert fast.decoders()[0].native() is not None
    assert py.decoders()[0].native() is None


@needs_native
def test_bundled_model_buffers_kept_and_native_candidates_lossless():
    """Caches kept in the buffers of batches of other sizes (larger, then smaller, then
    larger again) and the C++ candidates: stock's hypotheses; switched off: too."""
    from conftest import bundled
    m = bundled("es-en")
    task, models, cfg = load(m.data, [m.path], extra=["--source-lang", m.src,
                                                       "--target-lang", m.tgt])
    stock, fast = generators(task, models, FastGenConfig(), beam=5)
    _, off = generators(task, models, FastGenConfig(native_candidates=False), beam=5)
    ptrs = []
    for bsz in (12, 3, 20):
        for b in batches(task, cfg, bsz, limit=1):
            s = stock.generate(models, b)
            assert_same_hypos(s, fast.generate(models, b), bitwise=False)
            assert_same_hypos(s, off.generate(models, b), bitwise=False)
            ptrs.append(fast._batch_engine().decoders[0].k[0].data_ptr())
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
        assert fast.decoders()[0].native() is None
        assert "native decoder step off (activation tanh)" in caplog.text
    finally:
        layer.activation_fn = saved


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
                                     "--fastgen-disable", "native_candidates",
                                     "--fastgen-disable", "fused_cross_attention"])
        active = fg_config.active()
        assert not (active.native_step or active.native_candidates
                    or active.fused_cross_attention)
    finally:
        fg_config.set_active(before)
    assert "native_step" in FastGenConfig().describe()
    assert "native_step" not in FastGenConfig(native_step=False).describe()
    assert "native_step" not in FastGenConfig(bitwise=True).describe()
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
