#!/usr/bin/env python
"""Packed GEMM ablation: stock vs fastgen with and without MKL packed weights, one process.

Each generator decodes the same batches of the bundled es->en test set in this process
(2 torch threads by default, the decoding of ``--fastgen-decode-workers 1``), interleaved,
min of ``--rounds``; every fastgen hypothesis of the first round is checked against stock's (tokens
identical, scores within 1e-4).

    python benchmarks/packed_gemm.py --batch 8 64 --out benchmarks/results/packed_gemm.json
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import assert_same_hypos, batches, generators, load  # noqa: E402
from fairseq_fastgen.config import FastGenConfig  # noqa: E402


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--subset", default="test")
    p.add_argument("--limit", type=int, default=None, help="batches per run (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    d = ROOT / "examples" / "bible" / "bundle" / "es-en"
    task, models, cfg = load(d, [d / "checkpoint.pt"], extra=["--source-lang", "es", "--target-lang", "en"])
    systems = {"stock": None, "fastgen packed off": 0, "fastgen packed 256 MiB": 256}
    gens = {}
    for name, mb in systems.items():
        stock, fast = generators(task, models, FastGenConfig(packed_gemm_mb=mb or 0), beam=a.beam)
        gens[name] = stock if mb is None else fast
    rows = []
    for bsz in a.batch:
        bs = list(batches(task, cfg, bsz, subset=a.subset, limit=a.limit))
        best, outs = {}, {}
        for r in range(a.rounds):
            for name, g in gens.items():
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = [g.generate(models, b) for b in bs]
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t0)
                if r == 0:
                    outs[name] = out
        for name in systems:  # the first round's hypotheses, against stock's
            for s, f in zip(outs["stock"], outs[name]):
                assert_same_hypos(s, f, bitwise=False)
        row = {"batch": bsz, "sentences": sum(b["id"].numel() for b in bs),
               "seconds": {k: round(v, 2) for k, v in best.items()},
               "vs_stock": {k: round(best["stock"] / v, 3) for k, v in best.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"cpu": cpu_name(), "threads": a.threads, "beam": a.beam, "subset": a.subset,
              "rounds": a.rounds, "lossless": True, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
