"""The config of the run in progress, resolved once per entry point.

Precedence: the process default (``fairseq_fastgen.configure``, or the last command line
``parse_args_and_arch`` read) < the ``--fastgen-*`` flags a source carries < the Hydra
``fastgen`` node at the root of its config tree.  Each entry point install.py wraps
(``call_main``, ``generate.main``, the hub's ``generate``, the training checkpoint
restore) calls :func:`resolve` once and runs inside ``with run(cfg):``;
the checkpoint loader, the ``batch_by_size`` guard and the generator builder read
:func:`current`, never the process default.
"""
import contextlib
import contextvars
from argparse import Namespace
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

from . import config_sources
from .config import FastGenConfig, active


@dataclass(frozen=True)
class Run:
    """What an entry point resolved: its config, and whether it generates (the
    ``batch_by_size`` guard acts only then, never on fairseq-train's batches)."""

    fastgen: FastGenConfig
    generation: bool = False


# A ContextVar rather than a global: a run's config ends with the run, and forked
# workers inherit it with the rest of the process.
_run: "contextvars.ContextVar[Optional[Run]]" = contextvars.ContextVar(
    "fairseq_fastgen_run", default=None)


def resolve(*sources) -> FastGenConfig:
    """The config of a run: the enclosing run's (else the process default), with the
    options each source carries laid over it in order.

    A source is a :class:`FastGenConfig` (taken whole), an argparse Namespace (its
    ``--fastgen-*`` flags), an OmegaConf node at any depth of a fairseq config (the
    ``fastgen`` node at its root), or a mapping of option names; anything else (None, a
    fairseq config dataclass) carries no options.
    """
    cfg = current()
    for source in sources:
        if isinstance(source, FastGenConfig):
            cfg = source
            continue
        values = None
        if isinstance(source, Namespace):
            values = config_sources.namespace_values(source)
        elif config_sources.is_node(source):
            values = config_sources.hydra_values(source)
        elif isinstance(source, Mapping):
            values = source
        if values:
            cfg = FastGenConfig.from_mapping(values, base=cfg)
    return cfg


@contextlib.contextmanager
def run(fastgen: FastGenConfig, generation: bool = False) -> Iterator[FastGenConfig]:
    """``with run(resolve(cfg)):`` -- ``fastgen`` is :func:`current` until the block ends."""
    token = _run.set(Run(fastgen, generation))
    try:
        yield fastgen
    finally:
        _run.reset(token)


def current() -> FastGenConfig:
    """The config of the run in progress; the process default outside any run."""
    r = _run.get()
    return active() if r is None else r.fastgen


def generating() -> bool:
    """Whether the run in progress is a generation run (generate, interactive, hub)."""
    r = _run.get()
    return r is not None and r.generation


def run_main(main, fastgen: FastGenConfig, generation: bool, cfg, *args, **kwargs):
    """``main(cfg, ...)`` inside ``run(fastgen)``; a module-level function so that
    ``functools.partial(run_main, main, fastgen, generation)`` pickles into the processes
    ``torch.multiprocessing.spawn`` starts (``fairseq.distributed.utils.call_main``)."""
    with run(fastgen, generation):
        return main(cfg, *args, **kwargs)
