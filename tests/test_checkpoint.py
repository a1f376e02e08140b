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


# ---- what the messages say (issue 18) ---------------------------------------------------

class RunsACommand:
    """What a malicious checkpoint pickles: unpickling it would call os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class CallsEval:
    def __reduce__(self):
        return (eval, ("1 + 1",))


def test_malicious_pickle_names_the_global_and_the_way_out(tiny, tmp_path):
    state = torch.load(tiny.postln, weights_only=False)
    marker = tmp_path / "pwned"
    state["extra_state"] = {"payload": RunsACommand(marker)}
    path = tmp_path / "malicious.pt"
    torch.save(state, path)  # pickling only records the call; nothing runs here
    with pytest.raises(CheckpointError) as e:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    msg = str(e.value)
    assert not marker.exists()  # refused before anything was called
    assert str(path) in msg
    assert f"would load {os.system.__module__}.system" in msg  # posix.system on Linux
    assert "may be malicious" in msg
    assert "--fastgen-trust-checkpoint" in msg and "+fastgen.trust_checkpoint=true" in msg
    assert "Weights only load failed" not in msg  # torch's preamble, which names nothing


def test_unlisted_function_is_named_with_its_module(tiny, tmp_path):
    state = torch.load(tiny.postln, weights_only=False)
    state["extra_state"] = {"payload": CallsEval()}
    path = tmp_path / "eval.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"pickles builtins\.eval, a class or function "
                                              r"that is not on .*--fastgen-trust-checkpoint"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))


def _complete(msg):
    """A message that ends a sentence: not cut mid-way as torch's first 200 chars were."""
    return msg.rstrip().endswith((".", ")")) and "checkpoint file is)" not in msg


def _load_error(path, data: bytes) -> str:
    """The loader's message for a file holding ``data``."""
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as e:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    return str(e.value)


@pytest.mark.parametrize("cut", [100, 0.5, -10, -1000])
def test_truncated_zip_checkpoint_says_so_with_path_and_size(tiny, tmp_path, cut):
    data = tiny.postln.read_bytes()
    n = int(len(data) * cut) if isinstance(cut, float) else (cut if cut > 0 else len(data) + cut)
    path = tmp_path / "cut.pt"
    msg = _load_error(path, data[:n])
    assert msg.startswith(f"{path} is truncated (it ends before its zip archive's end record): "
                          f"{n:,} bytes on disk. Copy or download it again"), msg
    assert _complete(msg), msg


def test_truncated_legacy_checkpoint_and_empty_file(tiny, tmp_path):
    state = torch.load(tiny.postln, weights_only=False)
    legacy = tmp_path / "legacy.pt"
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    data = legacy.read_bytes()
    for n in (20, len(data) // 2, len(data) - 10):
        path = tmp_path / f"legacy_{n}.pt"
        msg = _load_error(path, data[:n])
        assert msg.startswith(f"{path} is truncated or corrupt (its data ends early): "
                              f"{n:,} bytes on disk."), msg
        assert _complete(msg), msg
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty\.pt is empty \(0 bytes\)"):
        checkpoint_utils.load_checkpoint_to_cpu(str(empty))


def test_random_bytes_are_not_called_truncated(tmp_path):
    path = tmp_path / "noise.pt"
    path.write_bytes(bytes(range(256)) * 20)
    with pytest.raises(CheckpointError) as e:
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path} is not a fairseq checkpoint"), msg
    assert "truncated" not in msg and "Check the documentation" not in msg
    assert _complete(msg), msg
