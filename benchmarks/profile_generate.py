#!/usr/bin/env python
"""Where generation time goes, stock SequenceGenerator vs FastSequenceGenerator.

Runs both generators in one process on the bundled es->en test set (torch.profiler, CPU),
interleaved, and writes the top operators of each to benchmarks/results/profile_<b>.txt.

    python benchmarks/profile_generate.py --batch 64 --batches 4 --threads 1
"""
import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from conftest import batches, generators, load  # noqa: E402
from fairseq_fastgen.config import FastGenConfig  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=18)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    d = ROOT / "examples" / "bible" / "bundle" / "es-en"
    task, models, cfg = load(d, [d / "checkpoint.pt"], extra=["--source-lang", "es", "--target-lang", "en"])
    stock, fast = generators(task, models, FastGenConfig(), beam=a.beam)
    bs = list(batches(task, cfg, a.batch, limit=a.batches))
    times = {"stock": [], "fastgen": []}
    for _ in range(2):
        for name, g in (("stock", stock), ("fastgen", fast)):
            t0 = time.perf_counter()
            for b in bs:
                g.generate(models, b)
            times[name].append(time.perf_counter() - t0)
    out = [f"batch {a.batch} x {len(bs)} batches, beam {a.beam}, {a.threads} thread(s); "
           f"min time stock {min(times['stock']):.2f}s, fastgen {min(times['fastgen']):.2f}s, "
           f"ratio {min(times['stock']) / min(times['fastgen']):.2f}x\n"]
    for name, g in (("stock", stock), ("fastgen", fast)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for b in bs:
                g.generate(models, b)
        out.append(f"== {name}\n" + prof.key_averages().table(sort_by="self_cpu_time_total",
                                                              row_limit=a.rows))
    text = "\n".join(out)
    res = ROOT / "benchmarks" / "results"
    res.mkdir(parents=True, exist_ok=True)
    (res / f"profile_b{a.batch}_t{a.threads}.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
