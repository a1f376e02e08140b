"""One config per run: resolve() and the run scope, and every key that acts outside the
generator honoured when only a Hydra ``fastgen`` node sets it (issue 15, item 1)."""
import functools
import logging
import pickle
import re
from argparse import Namespace

import numpy as np
import pytest
import torch

import fairseq_fastgen
from fairseq_fastgen import config as fg_config
from fairseq_fastgen import config_sources
from fairseq_fastgen import run_config
from fairseq_fastgen.checkpoint import CheckpointError
from fairseq_fastgen.config import FastGenConfig


@pytest.fixture(autouse=True)
def process_default(monkeypatch):
    """parse_args_and_arch writes the process default: put it back after each test."""
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    before = fg_config.active()
    yield
    fg_config.set_active(before)


class Custom:  # a class no allow-list knows: the checkpoint needs trust_checkpoint
    pass


def _stock_batch_by_size():
    import sys

    from fairseq.data import data_utils

    stock = sys.modules["fairseq_fastgen.install"]._originals[(data_utils, "batch_by_size")]
    if sum(map(len, stock(np.arange(64), lambda i: 1, max_sentences=24,
                          required_batch_size_multiple=24))) == 64:
        pytest.skip("this fairseq keeps the last batch (0.12.2)")
    return stock


def _hydra(cfg, **fastgen):
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.fastgen = fastgen
    return cfg


def _generate_cfg(data, path, results, *extra):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_generation_parser(), [
        str(data), "--path", str(path), "--results-path", str(results), *extra])
    return convert_namespace_to_omegaconf(args)


def _generate(cfg):
    """fairseq_cli.generate.main(cfg) in this process; the S-line ids it wrote."""
    from fairseq_cli import generate

    generate.main(cfg)
    text = (cfg.common_eval.results_path and open(
        f"{cfg.common_eval.results_path}/generate-{cfg.dataset.gen_subset}.txt").read())
    return [int(m) for m in re.findall(r"^S-(\d+)\t", text, re.M)]


# ---- resolve() and the scope -----------------------------------------------------------

def test_precedence_default_then_flags_then_hydra_node(tiny):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    fairseq_fastgen.configure(attention=True)
    assert run_config.resolve().attention
    assert run_config.resolve(None, {"vocab_pad": False}).to_dict() == FastGenConfig(
        attention=True, vocab_pad=False).to_dict()
    ns = Namespace(fastgen_bitwise=True, fastgen_ngram_blocker="torch")
    got = run_config.resolve(ns)
    assert got.bitwise and got.ngram_blocker == "torch" and got.attention
    args = options.parse_args_and_arch(options.get_generation_parser(),
                                       [str(tiny.data), "--fastgen-bitwise"])
    assert fg_config.active().bitwise  # the command line replaced the Python default
    cfg = _hydra(convert_namespace_to_omegaconf(args), bitwise=False, vocab_pad="false")
    for node in (cfg, cfg.generation, cfg.task):  # any depth of the tree
        got = run_config.resolve(args, node)
        assert not got.bitwise and not got.vocab_pad
    assert run_config.resolve(args, cfg.generation) == config_sources.from_hydra(cfg.generation)
    whole = FastGenConfig(enabled=False)
    assert run_config.resolve(cfg, whole) is whole
    assert run_config.resolve(object(), 3) == fg_config.active()  # carry nothing


def test_run_scope_is_current_until_it_ends():
    outer, inner = FastGenConfig(bitwise=True), FastGenConfig(vocab_pad=False)
    assert run_config.current() is fg_config.active() and not run_config.generating()
    with run_config.run(outer) as got:
        assert got is outer and run_config.current() is outer
        assert not run_config.generating()
        assert run_config.resolve({"vocab_pad": False}) == FastGenConfig(bitwise=True,
                                                                         vocab_pad=False)
        with run_config.run(inner, generation=True):
            assert run_config.current() is inner and run_config.generating()
        assert run_config.current() is outer and not run_config.generating()
    assert run_config.current() is fg_config.active()
    with pytest.raises(RuntimeError):
        with run_config.run(outer):
            raise RuntimeError
    assert run_config.current() is fg_config.active()  # ended by the error too


def test_call_main_runs_main_in_the_resolved_config(tiny):
    """call_main (train, hydra-train, interactive, eval-lm) resolves once, before any
    spawn, and main runs in that config; interactive's main as a generation run."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils

    args = options.parse_args_and_arch(options.get_training_parser(),
                                       [str(tiny.data), "--arch", "transformer", "--cpu"])
    cfg = _hydra(convert_namespace_to_omegaconf(args), trust_checkpoint=True)
    seen = []

    def main(cfg, **kwargs):
        seen.append((run_config.current(), run_config.generating(), kwargs))

    distributed_utils.call_main(cfg, main, extra=1)
    (got, generation, kwargs), = seen
    assert got.trust_checkpoint and not generation and kwargs == {"extra": 1}
    assert not run_config.current().trust_checkpoint
    main.__module__, main.__qualname__ = "fairseq_cli.interactive", "main"
    distributed_utils.call_main(cfg, main)
    assert seen[-1][1]
    # what torch.multiprocessing.spawn hands the processes it starts
    scoped = functools.partial(run_config.run_main, print, got, False)
    assert pickle.loads(pickle.dumps(scoped)).args == (print, got, False)


# ---- keys acting outside the generator, set only in a Hydra node -----------------------

def _custom_checkpoint(tiny):
    state = torch.load(tiny.postln, weights_only=False)
    state["extra_state"] = {"obj": Custom()}
    path = tiny.root / "custom_hydra.pt"
    torch.save(state, path)
    return path


def test_hydra_only_trust_checkpoint_in_generate(tiny, tmp_path):
    path = _custom_checkpoint(tiny)
    extra = ["--beam", "2", "--batch-size", "8", "--max-len-b", "5"]
    cfg = _generate_cfg(tiny.data, path, tmp_path / "a", *extra)
    with pytest.raises(CheckpointError, match="Custom.*trust_checkpoint=true"):
        _generate(cfg)
    cfg = _hydra(_generate_cfg(tiny.data, path, tmp_path / "b", *extra),
                 trust_checkpoint=True)
    assert len(_generate(cfg)) == 40
    assert not fg_config.active().trust_checkpoint  # the run's, not the process's


def test_hydra_only_trust_checkpoint_in_training_restore(tiny, tmp_path):
    """fairseq-hydra-train imports the plugin inside its main (common.user_dir), after
    call_main: the restore (checkpoint_utils.load_checkpoint) resolves from its cfg."""
    from fairseq import checkpoint_utils, options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    path = _custom_checkpoint(tiny)
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(tiny.data), "--arch", "transformer", "--cpu", "--restore-file", str(path),
        "--save-dir", str(tmp_path)])

    class Trainer:  # the three calls load_checkpoint makes of fairseq's Trainer
        checkpoint_suffix = ""

        def load_checkpoint(self, filename, *args, **kwargs):
            self.state = checkpoint_utils.load_checkpoint_to_cpu(filename)

        def get_train_iterator(self, epoch, **kwargs):
            return Namespace(epoch=epoch)

        def lr_step(self, epoch):
            pass

    cfg = convert_namespace_to_omegaconf(args)
    with pytest.raises(CheckpointError, match="Custom"):
        checkpoint_utils.load_checkpoint(cfg.checkpoint, Trainer())
    trainer = Trainer()
    checkpoint_utils.load_checkpoint(_hydra(cfg, trust_checkpoint=True).checkpoint, trainer)
    assert isinstance(trainer.state["extra_state"]["obj"], Custom)


def test_hydra_only_keep_last_batch_in_generate(tiny, tmp_path):
    _stock_batch_by_size()
    # 40 test sentences in batches of 16 that must be multiples of 16: fairseq drops 8
    extra = ["--beam", "1", "--batch-size", "16", "--required-batch-size-multiple", "16",
             "--max-len-b", "5"]
    dropped = _generate(_generate_cfg(tiny.data, tiny.postln, tmp_path / "a", *extra))
    cfg = _hydra(_generate_cfg(tiny.data, tiny.postln, tmp_path / "b", *extra),
                 keep_last_batch=True)
    kept = _generate(cfg)
    assert len(dropped) == 32 and sorted(kept) == list(range(40))


def test_hydra_only_pipeline_keys_in_generate(tiny, tmp_path, caplog):
    extra = ["--beam", "2", "--batch-size", "4", "--max-len-b", "5"]
    runs = {"off": dict(pipeline=False),
            "workers": dict(decode_workers=1, pipeline_workers=2),
            "decoders": dict(decode_workers=2)}
    ids = {}
    for name, keys in runs.items():
        caplog.clear()
        with caplog.at_level(logging.INFO):
            ids[name] = _generate(_hydra(_generate_cfg(
                tiny.data, tiny.postln, tmp_path / name, *extra), **keys))
        ids[name + " log"] = caplog.text
    assert "generate pipeline off: switched off (--fastgen-disable pipeline)" in ids["off log"]
    assert "generate pipeline: 2 postprocessing worker(s)" in ids["workers log"]
    assert "generate pipeline: 2 decoding worker(s)" in ids["decoders log"]
    assert sorted(ids["off"]) == sorted(ids["workers"]) == sorted(ids["decoders"])


# ---- the batch_by_size guard acts on generation only -----------------------------------

def test_training_batches_untouched_by_the_guard(tiny, caplog):
    """keep_last_batch on, yet a training run (call_main, as fairseq-train) gets fairseq's
    batches, tail dropped and no warning; the same batching in a generation run keeps it."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils

    stock = _stock_batch_by_size()
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(tiny.data), "--arch", "transformer", "--cpu", "--fastgen-keep-last-batch"])
    cfg = convert_namespace_to_omegaconf(args)
    got = {}

    def batches(cfg):
        task = tasks.setup_task(cfg.task)
        task.load_dataset("train")
        itr = task.get_batch_iterator(dataset=task.dataset("train"), max_sentences=24,
                                      required_batch_size_multiple=24, seed=1)
        return [list(b) for b in itr.frozen_batches]

    def train_main(cfg):
        got["train"] = batches(cfg)

    with caplog.at_level(logging.INFO):
        distributed_utils.call_main(cfg, train_main)
        with run_config.run(run_config.resolve(cfg), generation=True):
            got["generate"] = batches(cfg)
    idx = np.arange(64)
    assert sum(map(len, stock(idx, lambda i: 1, max_sentences=24,
                              required_batch_size_multiple=24))) == 48  # drops 16
    assert sum(map(len, got["train"])) == 48
    assert got["generate"][:-1] == got["train"] and len(got["generate"][-1]) == 16
    assert caplog.text.count("fairseq-fastgen: kept the last batch of 16") == 1
    assert "fairseq drops the last" not in caplog.text


def test_uninstall_restores_the_entry_points():
    from fairseq import checkpoint_utils, hub_utils
    from fairseq.data import data_utils
    from fairseq.distributed import utils as distributed_utils
    from fairseq_cli import generate

    def patched():
        return [distributed_utils.call_main, checkpoint_utils.load_checkpoint,
                generate.main, hub_utils.GeneratorHubInterface.generate,
                data_utils.batch_by_size]

    assert all(hasattr(fn, "__wrapped__") for fn in patched())
    fairseq_fastgen.uninstall()
    try:
        for fn in patched():
            assert not hasattr(fn, "__wrapped__"), fn
    finally:
        fairseq_fastgen.install()
    assert all(hasattr(fn, "__wrapped__") for fn in patched())


def test_hub_generate_is_a_generation_run_in_the_hub_config(tiny, monkeypatch):
    from fairseq import hub_utils

    from conftest import load

    task, models, cfg = load(tiny.data, [tiny.postln], load_data=False)
    hub = hub_utils.GeneratorHubInterface(_hydra(cfg, keep_last_batch=True), task, models)
    seen = []

    def inference_step(generator, models, batch, **kwargs):
        seen.append((run_config.current(), run_config.generating(), generator.fastgen))
        return [[] for _ in batch["id"]]

    monkeypatch.setattr(task, "inference_step", inference_step)
    hub.generate([torch.tensor([5, 6, 7, 2])], beam=2)
    (fastgen, generation, of_generator), = seen
    assert fastgen.keep_last_batch and generation and of_generator.keep_last_batch
    assert not run_config.generating() and run_config.current() is fg_config.active()
