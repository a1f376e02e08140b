"""Inputs a generation run skips as longer than the model's max positions, announced.

fairseq filters such inputs in ``FairseqTask.filter_indices_by_size`` when it is asked to
(``--skip-invalid-size-inputs-valid-test`` in fairseq-generate and fairseq-interactive,
``skip_invalid_size_inputs=True`` on the hub's ``generate``/``translate``), and says no
more than "N samples have invalid sizes and will be skipped, max_positions=..., first few
sample ids=[...]": the first ten ids only, relative to fairseq-interactive's buffer (not
the input line), and nothing at all on the hub, whose caller gets 3 outputs for 4 inputs.

With the plugin, a generation run counts what it skips (:func:`counting`, opened by the
entry points in install.py): the filter names every skipped id in one log line
(truncated after :data:`SHOWN` with a count) and the run ends with one summary line
(:func:`summary`).  What is generated, and every output line, stays stock's.
"""
import contextlib
import contextvars
import functools
import logging
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence

import numpy as np

logger = logging.getLogger("fairseq_fastgen")

SHOWN = 50  # ids named in one line; the rest are counted


@dataclass
class Tally:
    """What one generation run skipped.

    ``lines``: the run reads input lines (fairseq-interactive), reported 1-based beside
    the ids.  ``detail``: one log line per filtered dataset besides the summary (off on
    the hub, where the two would say the same).  ``offset``: the run-wide id of the first input of the dataset filtered next
    (fairseq-interactive builds one dataset per buffer of lines, numbered from 0).
    """

    lines: bool = False
    detail: bool = True
    offset: int = 0
    seen: int = 0
    skipped: List[int] = field(default_factory=list)
    max_positions: object = None


# Per run, as run_config's: a run's tally ends with it, and nested runs (the hub's
# generate calling itself) keep their own.
_tally: "contextvars.ContextVar[Optional[Tally]]" = contextvars.ContextVar(
    "fairseq_fastgen_drops", default=None)


@contextlib.contextmanager
def counting(lines: bool = False, detail: bool = True,
             announce: bool = True) -> Iterator[Tally]:
    """Count the inputs skipped inside the block; ``announce``: log :func:`summary` when
    the block ends normally (off where the caller logs it in its own summary, e.g. while
    the log stream is still open); ``detail``: one line per filtered dataset as well."""
    tally = Tally(lines=lines, detail=detail)
    token = _tally.set(tally)
    try:
        yield tally
        if announce:
            log_summary(tally)
    finally:
        _tally.reset(token)


def run_counted(main, lines: bool, *args, **kwargs):
    """``main(*args, **kwargs)`` inside :func:`counting` (module level, so that a
    ``functools.partial`` of it pickles into the processes fairseq's ``call_main`` spawns)."""
    with counting(lines=lines):
        return main(*args, **kwargs)


def current() -> Optional[Tally]:
    """The tally of the run in progress; None outside a counting run."""
    return _tally.get()


def set_offset(offset: int) -> None:
    """The run-wide id of the next dataset's first input (fairseq-interactive's reader)."""
    tally = _tally.get()
    if tally is not None:
        tally.offset = offset


def record(ignored: Sequence[int], total: int, max_positions=None) -> None:
    """``ignored`` (dataset ids) of ``total`` inputs were skipped; log them when asked."""
    tally = _tally.get()
    if tally is None:
        return
    ids = sorted(tally.offset + int(i) for i in ignored)
    tally.seen += total
    tally.skipped.extend(ids)
    tally.max_positions = max_positions
    if ids and tally.detail:
        verb = "is" if len(ids) == 1 else "are"
        logger.warning(f"fairseq-fastgen: {len(ids)} of {total} inputs {verb} longer than "
                       f"max_positions={max_positions} and skipped: "
                       f"{describe(ids, tally.lines)}")


def guard_filter(original):
    """Wrap ``FairseqTask.filter_indices_by_size``: the same indices; inside a counting
    run, the ones it removed are recorded (and named in the log)."""

    @functools.wraps(original)
    def filter_indices_by_size(self, indices, dataset, max_positions=None,
                               ignore_invalid_inputs=False):
        kept = original(self, indices, dataset, max_positions, ignore_invalid_inputs)
        if _tally.get() is not None:
            given = np.asarray(indices)
            record(np.setdiff1d(given, np.asarray(kept)), len(given), max_positions)
        return kept

    return filter_indices_by_size


def describe(ids: Sequence[int], lines: bool) -> str:
    """``ids [2, 5]`` (interactive: ``input lines [3, 6] (ids [2, 5])``), cut after
    :data:`SHOWN` with a count of the rest."""
    def shown(values):
        head = ", ".join(str(v) for v in values[:SHOWN])
        more = f", ... ({len(values) - SHOWN} more)" if len(values) > SHOWN else ""
        return f"[{head}{more}]"

    if lines:
        return f"input lines {shown([i + 1 for i in ids])} (ids {shown(list(ids))})"
    return f"ids {shown(list(ids))}"


def share() -> tuple:
    """What the run in progress skipped, to hand to the process that writes the summary
    (a torchrun rank, an interactive decoding worker); the local tally is then emptied."""
    tally = _tally.get()
    if tally is None:
        return (0, [], None)
    out = (tally.seen, list(tally.skipped), tally.max_positions)
    tally.seen, tally.skipped = 0, []
    return out


def merge(shares) -> None:
    """Fold other processes' :func:`share` results into the run in progress."""
    tally = _tally.get()
    if tally is None:
        return
    for seen, skipped, max_positions in shares:
        tally.seen += seen
        tally.skipped.extend(skipped)
        if max_positions is not None:
            tally.max_positions = max_positions
    tally.skipped.sort()


def summary(tally: Tally) -> Optional[str]:
    """The run's closing line, or None when nothing was skipped."""
    if not tally.skipped:
        return None
    noun = "input lines" if tally.lines else "inputs"
    return (f"fairseq-fastgen: skipped {len(tally.skipped)} of {tally.seen} {noun} over max "
            f"positions (max_positions={tally.max_positions}): "
            f"{describe(tally.skipped, tally.lines)}")


def log_summary(tally: Optional[Tally] = None) -> None:
    """Log :func:`summary` of ``tally`` (default: the run in progress), if any."""
    tally = tally if tally is not None else _tally.get()
    line = summary(tally) if tally is not None else None
    if line:
        logger.warning(line)
