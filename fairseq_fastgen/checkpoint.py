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


_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


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
            m = _UNSUPPORTED.search(str(e))
            if m is None:
                raise CheckpointError(f"{path} is not a fairseq checkpoint ({_first_line(e)})") from e
            raise CheckpointError(
                f"{path} pickles an object of type {m.group(1)}, which is not on "
                "fairseq-fastgen's safe-loading allow-list. If you trust this file, load it "
                "with --fastgen-trust-checkpoint (Hydra: +fastgen.trust_checkpoint=true; "
                "Python: fairseq_fastgen.configure(trust_checkpoint=True))."
            ) from e
        except CheckpointError:
            raise
        except (RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError,
                AttributeError, AssertionError) as e:
            # torch's unpickler and fairseq's state upgrade fail in many ways on a file
            # that is not a checkpoint; none of them is worth more than this message.
            raise CheckpointError(f"{path} is not a fairseq checkpoint "
                                  f"({type(e).__name__}: {_first_line(e)})") from e
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


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
