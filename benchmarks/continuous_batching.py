#!/usr/bin/env python
"""Continuous batching ablation (issue 16): stock vs fastgen with and without
``--fastgen-continuous`` and its row bound, side by side in one run.

The "one process" systems decode in the main process (``--fastgen-decode-workers 1``), so
the figure is the engine's, not the decoding workers'; the "workers" systems are fastgen's
defaults (decoding workers, each decoding its batches as one stream) with the engine off,
on without a row bound below the batch, and on with the default bound.  Runs are interleaved (order rotated per
round), times are fairseq's own generation time (min over rounds), and each fastgen
output is checked lossless against stock's output of the same round.

    python benchmarks/continuous_batching.py [--batches 8 64] [--beam 5] [--subset test]
        [--rounds 2] [--out benchmarks/results/continuous_batching]
"""
import argparse
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fastgen.compare import compare_outputs, run_generate  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle" / "es-en"
ONE = ["--fastgen-decode-workers", "1"]
WHOLE = ["--fastgen-tune", "continuous_rows=100000"]  # no bound below the largest batch
SYSTEMS = {
    "stock": None,
    "one process, continuous off": ONE + ["--fastgen-continuous", "off"],
    "one process, whole batches": ONE + ["--fastgen-continuous", "on"] + WHOLE,
    "one process, default": ONE,
    "workers, continuous off": ["--fastgen-continuous", "off"],
    "workers, whole batches": WHOLE,
    "workers, default": [],
}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cell(batch: int, beam: int, subset: str, rounds: int, systems=SYSTEMS) -> dict:
    args = [str(BUNDLE), "--path", str(BUNDLE / "checkpoint.pt"), "--source-lang", "es",
            "--target-lang", "en", "--gen-subset", subset, "--beam", str(beam),
            "--batch-size", str(batch), "--post-process", "sentencepiece", "--cpu"]
    names = list(systems)
    best = {n: float("inf") for n in names}
    lossless = {n: True for n in names[1:]}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        outs = {}
        for n in order:
            extra = systems[n]
            run = run_generate(args, plugin=extra is not None, plugin_args=extra or ())
            if run.returncode != 0:
                raise RuntimeError(f"{n} failed:\n{run.stderr[-2000:]}")
            best[n] = min(best[n], run.gen_time)
            outs[n] = run.stdout
        for n in names[1:]:
            lossless[n] &= compare_outputs(outs["stock"], outs[n]).lossless
        print(f"batch {batch} round {r}: " + ", ".join(f"{n} {best[n]:.2f}s" for n in names),
              flush=True)
    return {"batch": batch, "beam": beam, "subset": subset, "gen_s": best,
            "speedup": {n: best["stock"] / best[n] for n in names[1:]}, "lossless": lossless}


def main(systems=SYSTEMS, title="Continuous batching ablation", doc=__doc__,
         out_name="continuous_batching") -> int:
    """Runs ``systems`` (name -> plugin flags, None: stock) in every cell of the command
    line; writes <out>.json and <out>.md; 0 if every run was lossless."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--subset", default="test", help="test: 1,000 verses; test1: 100")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / out_name))
    a = p.parse_args()
    cells = [cell(b, a.beam, a.subset, a.rounds, systems) for b in a.batches]
    res = {"cpu": cpu_name(), "threads": "torch default (all cores)", "cells": cells,
           "systems": systems}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [f"# {title} ({res['cpu']})", "",
             "Generation time (fairseq's own), min of interleaved rounds; speed-up over stock.",
             "", "| batch | beam | " + " | ".join(systems) + " | lossless |",
             "|---|---|" + "---|" * (len(systems) + 1)]
    for c in cells:
        row = [f"{c['gen_s']['stock']:.2f}s"] + [
            f"{c['gen_s'][n]:.2f}s ({c['speedup'][n]:.2f}x)" for n in list(systems)[1:]]
        lines.append(f"| {c['batch']} | {c['beam']} | " + " | ".join(row) + " | "
                     + ("yes" if all(c["lossless"].values()) else "NO") + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(all(c["lossless"].values()) for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
