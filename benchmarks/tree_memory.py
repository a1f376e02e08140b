#!/usr/bin/env python
"""Peak memory of a whole fairseq-generate process tree, stock vs plugin.

A process's peak RSS (what the benchmark harness reports) does not see the plugin's
worker processes, and summing RSS would count the model pages they share with the main
process (forked, copy-on-write) once per process.  This samples the tree every 0.2 s and
reports the peak of the summed PSS (proportional set size: shared pages split between the
processes that map them), and the peak summed RSS for reference.

    python benchmarks/tree_memory.py --batch 64 --subset test
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fastgen.compare import generate_command  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle"


def sample_tree(cmd, env, period=0.2):
    """Run cmd; return (exit code, peak summed PSS MiB, peak summed RSS MiB, processes seen)."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = psutil.Process(p.pid)
    peak_pss = peak_rss = 0.0
    seen = set()
    while p.poll() is None:
        pss = rss = 0
        try:
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for q in procs:
            try:
                m = q.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            pss += m.pss
            rss += m.rss
            seen.add(q.pid)
        peak_pss, peak_rss = max(peak_pss, pss / 2**20), max(peak_rss, rss / 2**20)
        time.sleep(period)
    return p.wait(), peak_pss, peak_rss, len(seen)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="es-en", choices=["es-en", "kjv-web"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--subset", default="test")
    a = ap.parse_args()
    src, tgt = a.task.split("-")
    d = BUNDLE / a.task
    args = [str(d), "--path", str(d / "checkpoint.pt"), "--source-lang", src, "--target-lang", tgt,
            "--gen-subset", a.subset, "--beam", str(a.beam), "--batch-size", str(a.batch),
            "--post-process", "sentencepiece", "--scoring", "sacrebleu"]
    for who in ("stock", "plugin"):
        cmd, env = generate_command(args, plugin=who == "plugin")
        code, pss, rss, n = sample_tree(cmd, env)
        print(f"{who}: exit {code}, {n} process(es), peak summed PSS {pss:.0f} MiB, "
              f"peak summed RSS {rss:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
