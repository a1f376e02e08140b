"""Checkpoint loading under torch's weights_only default, with clear errors."""
import argparse
import os

import pytest
import torch

from fairseq import checkpoint_utils
from fairseq_fastgen.checkpoint import CheckpointError
import fairseq_fastgen


@pytest.fixture(autouse=True)
def no_env_workaround(monkeypatch):
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)


def test_stock_loader_fails_without_plugin(tiny):
    """The problem being solved: plain torch.load refuses a fairseq checkpoint state."""
    state = torch.load(tiny.postln, weights_only=False)
    state["args"] = argparse.Namespace(arch="transformer")
    path = tiny.root / "ns_stock.pt"
    torch.save(state, path)
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        checkpoint_utils.load_checkpoint_to_cpu.__wrapped__(str(path))


def test_loads_checkpoint_with_namespace_args(tiny):
    state = torch.load(tiny.postln, weights_only=False)
    state["args"] = None
    state["extra_state"] = {"ns": argparse.Namespace(a=1)}
    path = tiny.root / "ns.pt"
    torch.save(state, path)
    loaded = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert loaded["extra_state"]["ns"].a == 1
    assert set(loaded["model"]) == set(state["model"])


def test_safe_loading_stays_on_globally(tiny):
    checkpoint_utils.load_checkpoint_to_cpu(str(tiny.postln))
    path = tiny.root / "ns2.pt"
    torch.save({"x": argparse.Namespace(a=1)}, path)
    with pytest.raises(Exception):
        torch.load(path)  # outside our loader, torch's default is untouched
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in os.environ


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "nope.pt"))


def test_not_a_checkpoint(tmp_path):
    p = tmp_path / "text.pt"
    p.write_text("hello, I am not a model\n")
    with pytest.raises(CheckpointError, match="is not a fairseq checkpoint"):
        checkpoint_utils.load_checkpoint_to_cpu(str(p))
    q = tmp_path / "tensor.pt"
    torch.save({"weights": torch.zeros(2)}, q)
    with pytest.raises(CheckpointError, match="is not a fairseq checkpoint"):
        checkpoint_utils.load_checkpoint_to_cpu(str(q))


class Custom:  # a class no allow-list knows
    pass


def test_unknown_class_names_it_and_trust_flag_loads(tiny):
    state = torch.load(tiny.postln, weights_only=False)
    state["extra_state"] = {"obj": Custom()}
    path = tiny.root / "custom.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="Custom.*--fastgen-trust-checkpoint"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    before = fairseq_fastgen.config.active()
    try:
        fairseq_fastgen.configure(trust_checkpoint=True)
        loaded = checkpoint_utils.load_checkpoint_to_cpu(str(path))
        assert isinstance(loaded["extra_state"]["obj"], Custom)
    finally:
        fairseq_fastgen.config.set_active(before)
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in os.environ
