"""Package import, registration, install()/uninstall() and the FastGenConfig surfaces."""
import argparse
import importlib
import subprocess
import sys

import pytest

import fairseq_fastgen
from fairseq_fastgen import config as fg_config
from fairseq_fastgen import config_sources
from fairseq_fastgen.config import FastGenConfig, FastGenConfigError


def test_import_twice_is_harmless():
    from fairseq.tasks import FairseqTask
    patched = FairseqTask.build_generator
    importlib.reload(fairseq_fastgen)
    fairseq_fastgen.install()
    assert FairseqTask.build_generator is patched  # not wrapped twice
    assert FairseqTask.build_generator.__wrapped__.__module__ == "fairseq.tasks.fairseq_task"


def test_uninstall_restores_fairseq():
    from fairseq import checkpoint_utils, options
    from fairseq.tasks import FairseqTask
    fairseq_fastgen.uninstall()
    try:
        for fn in (FairseqTask.build_generator, checkpoint_utils.load_checkpoint_to_cpu,
                   options.add_checkpoint_args, options.parse_args_and_arch):
            assert not hasattr(fn, "__wrapped__"), fn
    finally:
        fairseq_fastgen.install()
    assert hasattr(FairseqTask.build_generator, "__wrapped__")


def test_flags_on_fairseq_parsers():
    from fairseq import options
    for make in (options.get_generation_parser, options.get_interactive_generation_parser,
                 options.get_training_parser):
        parser = make()
        dests = {a.dest for a in parser._actions}
        assert {"fastgen_bitwise", "fastgen_disable", "fastgen_tune"} <= dests
        assert "fastgen_vocab_pad" not in dests  # a developer option: --fastgen-disable


def test_flags_reach_active_config(tiny):
    from fairseq import options
    before = fg_config.active()
    try:
        parser = options.get_generation_parser()
        options.parse_args_and_arch(parser, [str(tiny.data), "--fastgen-bitwise",
                                             "--fastgen-disable", "vocab_pad", "--fastgen-tune", "ngram_blocker=torch"])
        cfg = fg_config.active()
        assert cfg.bitwise and not cfg.vocab_pad and cfg.ngram_blocker == "torch"
    finally:
        fg_config.set_active(before)


def test_bad_cli_value_is_rejected(tiny):
    p = subprocess.run([sys.executable, "-m", "fairseq_cli.generate", str(tiny.data),
                        "--user-dir", fairseq_fastgen.__path__[0], "--fastgen-tune", "ngram_blocker=fast"],
                       capture_output=True, text=True)
    assert p.returncode != 0
    assert "error: fastgen option 'ngram_blocker': 'fast' is not one of" in p.stderr
    assert "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "fairseq_cli.generate", str(tiny.data),
                        "--user-dir", fairseq_fastgen.__path__[0], "--fastgen-disable", "kv_cach"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "'disable': unknown name 'kv_cach'" in p.stderr


def test_unknown_and_bad_keys_name_the_key():
    with pytest.raises(FastGenConfigError, match="unknown fastgen option 'bitwize'"):
        FastGenConfig.from_mapping({"bitwize": True})
    with pytest.raises(FastGenConfigError, match="'vocab_pad' must be true/false"):
        FastGenConfig.from_mapping({"vocab_pad": "maybe"})
    with pytest.raises(FastGenConfigError, match="'ngram_blocker'"):
        FastGenConfig(ngram_blocker="fast")
    with pytest.raises(FastGenConfigError, match="unknown fastgen option"):
        fairseq_fastgen.configure(nope=1)


def test_python_configure_and_describe():
    before = fg_config.active()
    try:
        cfg = fairseq_fastgen.configure(bitwise=True)
        assert fg_config.active() is cfg and cfg.bitwise
        assert "mode=bitwise" in cfg.describe() and "merged_beam_gemm" not in cfg.describe()
        assert "mode=off" in FastGenConfig(enabled=False).describe()
    finally:
        fg_config.set_active(before)


def test_hydra_fastgen_node_is_read(tiny):
    """A top-level ``fastgen`` node (what ``+fastgen.<key>=...`` adds to a fairseq Hydra
    config) reaches generator builders, which fairseq hands only ``cfg.generation``."""
    from omegaconf import OmegaConf, open_dict
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_generation_parser(), [str(tiny.data)])
    cfg = convert_namespace_to_omegaconf(args)
    with open_dict(cfg):
        cfg.fastgen = {"bitwise": True, "vocab_pad": "false"}
    got = config_sources.from_hydra(cfg.generation)
    assert got.bitwise and not got.vocab_pad
    with open_dict(cfg):
        cfg.fastgen = {"bitwize": True}
    with pytest.raises(FastGenConfigError, match="bitwize"):
        config_sources.from_hydra(cfg.generation)
    with open_dict(cfg):
        del cfg["fastgen"]
    assert config_sources.from_hydra(cfg.generation) is None


def test_print_user_dir():
    out = subprocess.run([sys.executable, "-m", "fairseq_fastgen"], capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.strip() == fairseq_fastgen.__path__[0]


def test_one_log_line_on_import():
    code = "import logging; logging.basicConfig(level=logging.INFO); import fairseq_fastgen; import fairseq_fastgen"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = [l for l in p.stderr.splitlines() if "fairseq-fastgen: mode=" in l]
    assert len(lines) == 1, p.stderr
    assert "fast_decoder" in lines[0] and "native_step" in lines[0]


def test_import_leaves_logging_alone():
    """install() knows fairseq-interactive's main by name: importing fairseq_cli.interactive
    would run its logging.basicConfig (to stdout) in every process that loads the plugin."""
    code = ("import logging, sys; import fairseq, fairseq_cli.generate; "
            "before = list(logging.getLogger().handlers); import fairseq_fastgen; "
            "assert 'fairseq_cli.interactive' not in sys.modules; "
            "assert logging.getLogger().handlers == before; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "ok"
