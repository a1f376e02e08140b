"""Safe loading of fairseq checkpoints under torch's ``weights_only`` unpickler.

torch >= 2.6 loads with ``weights_only=True`` by default, and fairseq checkpoints then fail
because they pickle a few plain Python/NumPy objects (``argparse.Namespace`` for old-style
args, NumPy scalars in training metrics, ...).  Rather than switching safe loading off, we
allow-list exactly those classes for the duration of a checkpoint load, and turn torch's
errors into messages that say what the file is and what to do.
"""
import argparse
import collections
import contextlib
import logging
import os
import pickle
import re
from typing import Callable, List

import torch

from . import run_config

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A --path file could not be loaded as a fairseq checkpoint."""


def safe_globals() -> List:
    """Classes a fairseq 0.x checkpoint may pickle besides tensors and containers."""
    allowed = [argparse.Namespace, collections.defaultdict, collections.OrderedDict]
    try:
        import numpy as np

        allowed += [np.dtype, np.ndarray, np.float64, np.float32, np.int64, np.bool_]
        core = getattr(np, "_core", None) or np.core
        allowed += [core.multiarray.scalar, core.multiarray._reconstruct]
        allowed += [type(np.dtype(t)) for t in ("float64", "float32", "int64", "int32", "bool")]
    except (ImportError, AttributeError):  # numpy absent or renamed: nothing to add
        pass
    return allowed


TRUST_HINT = (
    "If you trust this file (only then: unpickling runs whatever it names), load it "
    "with --fastgen-trust-checkpoint (Hydra: +fastgen.trust_checkpoint=true; Python: "
    "fairseq_fastgen.configure(trust_checkpoint=True))."
)

# torch's weights_only unpickler (torch/_weights_only_unpickler.py), what each refusal
# names: a global of a blocked module (os, sys, posix, nt: what a malicious pickle calls),
# one outside torch's and our allow-lists, a function it would call, a class it would build.
_BLOCKED = re.compile(r"unsupported GLOBAL (\S+) whose module (\S+) is blocked")
_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL (\S+) was not an allowed global")
_REDUCE = re.compile(r"Trying to call reduce for unrecognized function (.+)")
_BUILD = re.compile(r"Can only (?:build|create new object).* but got (.+)")
_WEIGHTS_ONLY_ERROR = re.compile(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", re.S)


def trusted_by_run() -> bool:
    """``trust_checkpoint`` of the run in progress (CLI flag, Hydra node or configure())."""
    return run_config.current().trust_checkpoint


def guarded_loader(original: Callable, trust: Callable[[], bool] = trusted_by_run) -> Callable:
    """Wrap fairseq's ``load_checkpoint_to_cpu`` with the allow-list and clear errors.

    ``trust()`` is read at call time: when true (``--fastgen-trust-checkpoint``) this one
    load unpickles without restriction; safe loading stays on everywhere else.
    """

    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        if isinstance(path, (str, os.PathLike)) and "://" not in str(path):
            if not os.path.exists(path):
                raise CheckpointError(f"checkpoint not found: {path}")
            if os.path.isdir(path):
                raise CheckpointError(f"checkpoint path is a directory, not a file: {path}")
        try:
            with _loading_context(trust()):
                state = original(path, arg_overrides, load_on_all_ranks)
        except pickle.UnpicklingError as e:
            raise CheckpointError(_refusal(path, e)) from e
        except CheckpointError:
            raise
        except (RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError,
                AttributeError, AssertionError) as e:
            # torch's unpickler and fairseq's state upgrade fail in many ways on a file
            # that is not a checkpoint; none of them is worth more than this message.
            raise CheckpointError(_damaged(path, e) or f"{path} is not a fairseq checkpoint "
                                  f"({type(e).__name__}: {_summary(e)})") from e
        if not isinstance(state, dict) or "model" not in state:
            raise CheckpointError(
                f"{path} is a torch file but not a fairseq checkpoint (no 'model' entry)"
            )
        return state

    load_checkpoint_to_cpu.__wrapped__ = original
    load_checkpoint_to_cpu.__doc__ = original.__doc__
    return load_checkpoint_to_cpu


@contextlib.contextmanager
def _loading_context(trust: bool):
    if trust:
        # Scoped to this one load: torch reads the variable at each torch.load call.
        old = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
            else:
                os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = old
    elif hasattr(torch.serialization, "safe_globals"):
        with torch.serialization.safe_globals(safe_globals()):
            yield
    else:  # torch < 2.5 loads with weights_only=False by default: nothing to allow
        yield


def _refusal(path, e: pickle.UnpicklingError) -> str:
    """What the safe unpickler refused in ``path``, and the way out."""
    text = str(e)
    m = _BLOCKED.search(text)
    if m is not None:
        return (f"{path} was refused by safe loading: unpickling it would load {m.group(1)} "
                f"(module {m.group(2)}, which runs commands or changes the process), a "
                "function no fairseq checkpoint needs: the file may be malicious. "
                + TRUST_HINT)
    m = _UNSUPPORTED.search(text)
    if m is not None:
        name = m.group(1) if "." in m.group(1) else f"builtins.{m.group(1)}"
        return (f"{path} pickles {name}, a class or function that is not on "
                "fairseq-fastgen's safe-loading allow-list, so it was not loaded. "
                + TRUST_HINT)
    for pattern, what in ((_REDUCE, "would call"), (_BUILD, "would build")):
        m = pattern.search(text)
        if m is not None:
            return (f"{path} was refused by safe loading: unpickling it {what} "
                    f"{m.group(1).strip()}, which is not on the allow-list. " + TRUST_HINT)
    m = _WEIGHTS_ONLY_ERROR.search(text)
    detail = _summary(m.group(1)) if m is not None else _summary(e)
    return (_damaged(path, e) or
            f"{path} is not a fairseq checkpoint (torch's safe unpickler: {detail})")


_ZIP_START, _ZIP_END = b"PK\x03\x04", b"PK\x05\x06"
_UNREAD = re.compile(r"EOF|truncated|corrupt|zip archive|PytorchStreamReader|CRC", re.I)


def _damaged(path, e: Exception) -> str:
    """A complete message when ``path`` looks like a torch file cut short or damaged
    (torch's own stops mid-sentence when shortened); "" when it does not."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(0, size - (1 << 16) - 22))  # a zip's end record is in its last 64 KiB
            tail = f.read()
    except (OSError, TypeError):
        return ""
    if size == 0:
        return (f"{path} is empty (0 bytes): nothing was written to it (an interrupted save, "
                "copy or download?). Save, copy or download it again.")
    zip_file = head == _ZIP_START
    # a torch file: a zip archive (torch >= 1.6), or the legacy pickle (protocol 2 magic)
    legacy = head[:2] == b"\x80\x02"
    unread = isinstance(e, EOFError) or _UNREAD.search(str(e)) is not None
    if zip_file and not _zip_end_complete(tail):
        state = "is truncated (it ends before its zip archive's end record)"
    elif zip_file and unread:
        state = "is corrupt (its zip archive is complete but does not read)"
    elif legacy and unread:
        state = "is truncated or corrupt (its data ends early)"
    else:
        return ""
    return (f"{path} {state}: {size:,} bytes on disk. Copy or download it again, or use "
            f"another checkpoint (torch: {_summary(e, sentences=1)})")


def _zip_end_complete(tail: bytes) -> bool:
    """Whether ``tail`` (a file's last bytes) ends with a whole zip end record: 22 bytes
    from its signature, then the comment whose length the record states."""
    at = tail.rfind(_ZIP_END)
    if at < 0 or len(tail) - at < 22:
        return False
    comment = int.from_bytes(tail[at + 20:at + 22], "little")
    return len(tail) - at >= 22 + comment


def _summary(e, sentences: int = 0) -> str:
    """The first sentences of an error, whole (``sentences``: at most that many): at most
    about 300 characters, cut at a sentence end (or, for one long sentence, at a word
    end marked with "...")."""
    text = " ".join(str(e).split()) or type(e).__name__
    ends = [m.end() for m in re.finditer(r"[.!?](?= |$)", text)]
    if sentences and len(ends) > sentences:
        text = text[: ends[sentences - 1]]
    if len(text) <= 300:
        return text
    cut = max((end for end in ends if end <= 300), default=0)
    if cut:
        return text[:cut]
    space = text.rfind(" ", 0, 300)
    return text[: space if space > 0 else 300] + " ..."
