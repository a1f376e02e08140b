"""The benchmark suite's ``--quick`` run on a smaller grid, for device_check.sh's CPU dry run.

    python benchmarks/device/suite_tiny.py SUITE_ARGS...   (the suite's own arguments)

The quick grid (16 verses, n-gram sizes 0 and 3, several processes per cell) takes minutes
on two shared CPU cores; the dry run only has to prove the suite's code path still runs in
the kit's environment.  This runs the suite's own ``main`` after narrowing its quick grid to
one batch of 8 verses with ``--no-repeat-ngram-size 3`` (which also exercises the #4709-fixed
reference).  If the suite's grid names change, this fails loudly: the dry run should then be
updated, not skipped.
"""
import sys
from dataclasses import replace
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS.parent))  # fairseq_fastgen
sys.path.insert(0, str(BENCHMARKS))  # the suite package, as benchmarks/suite/__main__.py imports it

from suite import cli, grid  # noqa: E402


def main(argv=None) -> int:
    grid.SENTENCES["quick"] = {8: 8}  # the dict cli.py reads (same object)
    grid.GRID["quick"] = replace(grid.GRID["quick"], batches=(8,), ngrams=(3,))
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
