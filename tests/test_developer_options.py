"""The user surface: a dozen switches, and the two developer options (``--fastgen-disable``,
``--fastgen-tune``) that reach every ablation and knob through the CLI, Hydra and Python."""
import re
from pathlib import Path

import pytest

import fairseq_fastgen
from fairseq_fastgen import config as fg_config
from fairseq_fastgen import config_sources
from fairseq_fastgen.config import FastGenConfig, FastGenConfigError

README = Path(__file__).resolve().parents[1] / "README.md"
DOC = Path(__file__).resolve().parents[1] / "docs" / "developer-options.md"


def _parse(argv):
    import argparse

    parser = argparse.ArgumentParser()
    config_sources.add_args(parser)
    return parser, parser.parse_args(argv)


def test_readme_switch_table_is_the_cli_surface():
    """The README's table lists exactly the flags the parser has, at most 12 of them."""
    rows = re.findall(r"^\| `(--fastgen-[a-z-]+)", README.read_text(), flags=re.M)
    parser, _ = _parse([])
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--fastgen")}
    assert len(rows) <= 12
    assert set(rows) == flags


def test_every_developer_field_is_documented():
    doc = DOC.read_text()
    for name in FastGenConfig.developer_fields():
        assert f"| `{name}` |" in doc, name


def test_cli_disable_and_tune_accumulate_and_coerce():
    _, args = _parse(["--fastgen-disable", "native_step,vocab_pad", "--fastgen-disable", "gemm",
                      "--fastgen-tune", "continuous_rows=8,margin_guard=2e-4",
                      "--fastgen-tune", "attention=true", "--fastgen-bitwise"])
    cfg = config_sources.from_namespace(args)
    assert cfg.bitwise and not cfg.native_step and not cfg.vocab_pad and cfg.gemm == "mkl"
    assert cfg.continuous_rows == 8 and cfg.margin_guard == 2e-4 and cfg.attention is True
    assert cfg.fused_cross_attention and cfg.native_candidates  # the rest untouched
    _, args = _parse(["--fastgen-disable", "ngram_blocker,packed_gemm_mb,margin_guard"])
    cfg = config_sources.from_namespace(args)
    assert (cfg.ngram_blocker, cfg.packed_gemm_mb, cfg.margin_guard) == ("stock", 0, 0.0)


@pytest.mark.parametrize("disable, tune, match", [
    ("kv_cach", None, "'disable': unknown name 'kv_cach'"),
    ("attention", None, "'disable': unknown name 'attention'"),  # off by default: tune it
    ("bitwise", None, "'disable': unknown name 'bitwise'"),  # a user switch, not an ablation
    (None, "gemm", "'tune': 'gemm' is not KEY=VALUE"),
    (None, "gemm=fast", "'gemm': 'fast' is not one of"),
    (None, "continuous_rows=-1", "'continuous_rows' must be a non-negative integer"),
])
def test_bad_items_name_what_is_wrong(disable, tune, match):
    with pytest.raises(FastGenConfigError, match=match):
        FastGenConfig.from_mapping({"disable": disable, "tune": tune})


def test_hydra_and_python_take_the_same_options(tiny):
    from omegaconf import OmegaConf

    root = OmegaConf.create({"generation": {"beam": 5},
                             "fastgen": {"disable": ["native_step", "vocab_pad"],
                                         "tune": "gemm=onednn", "continuous_rows": 16}})
    cfg = config_sources.from_hydra(root.generation)
    assert not cfg.native_step and not cfg.vocab_pad and cfg.gemm == "onednn"
    assert cfg.continuous_rows == 16
    before = fg_config.active()
    try:
        cfg = fairseq_fastgen.configure(disable="fused_cross_attention", tune=["packed_gemm_mb=0"])
        assert not cfg.fused_cross_attention and cfg.packed_gemm_mb == 0
        assert not fg_config.active().fused_cross_attention
    finally:
        fg_config.set_active(before)


def test_the_log_line_says_when_the_guard_is_off():
    assert "mode=lossless" in FastGenConfig(gemm="onednn").describe()
    assert "mode=unguarded" in FastGenConfig.from_mapping({"tune": "gemm=onednn,margin_guard=0"}).describe()
    assert "mode=lossless" in FastGenConfig(margin_guard=0).describe()  # auto: no guard, no oneDNN
