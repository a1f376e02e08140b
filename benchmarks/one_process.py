"""What the one-process benchmarks share: the bundled es->en model, their command line,
and the interleaved, lossless-checked timing of several generators over the same batches.

Used by benchmarks/packed_gemm.py and benchmarks/gemm_limit.py.
"""
import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import assert_same_hypos, load  # noqa: E402


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform
    return platform.processor()


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--subset", default="test")
    p.add_argument("--limit", type=int, default=None, help="batches per run (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    return p


def load_es_en():
    """(task, models, cfg) of the bundled es->en model, as fairseq-generate loads them."""
    d = ROOT / "examples" / "bible" / "bundle" / "es-en"
    return load(d, [d / "checkpoint.pt"], extra=["--source-lang", "es", "--target-lang", "en"])


def interleaved(gens: Dict[str, object], models, bs: List[dict], rounds: int,
                first_round: Optional[Callable[[str], contextlib.AbstractContextManager]] = None
                ) -> Dict[str, float]:
    """Best seconds of each generator over batches ``bs``, the generators interleaved round
    after round; every hypothesis of the first round checked against ``gens["stock"]``'s
    (tokens identical, scores within 1e-4).  first_round(name): a context each generator's
    first round runs in (instrumentation)."""
    best: Dict[str, float] = {}
    outs = {}
    for r in range(rounds):
        for name, g in gens.items():
            ctx = first_round(name) if first_round and r == 0 else contextlib.nullcontext()
            with ctx:
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = [g.generate(models, b) for b in bs]
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
            if r == 0:
                outs[name] = out
    for name in gens:
        for s, f in zip(outs["stock"], outs[name]):
            assert_same_hypos(s, f, bitwise=False)
    return best


def write_rows(a: argparse.Namespace, rows: List[dict]) -> None:
    """The run's result (machine, settings, rows) to ``--out``, if given."""
    result = {"cpu": cpu_name(), "threads": a.threads, "beam": a.beam, "subset": a.subset,
              "rounds": a.rounds, "lossless": True, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
