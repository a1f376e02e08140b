"""``python benchmarks/suite`` or ``python -m suite`` (from benchmarks/)."""
import sys
from pathlib import Path

if not __package__:
    # run as a folder: sys.path[0] is this folder, whose modules must not be importable
    # top-level (grid, data, ...); import them as the package instead
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    sys.path.insert(0, str(here.parents[1]))  # the repo root: fairseq_fastgen
    sys.path.insert(0, str(here.parent))
    from suite.cli import main
else:
    from .cli import main

if __name__ == "__main__":
    sys.exit(main())
