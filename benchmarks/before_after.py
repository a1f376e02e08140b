#!/usr/bin/env python
"""Before/after: two checkouts of the plugin against each other and stock, interleaved.

    python benchmarks/before_after.py --old /tmp/old [--new .] [--rounds 2] [--cells 0 3]

A change to the decoding core must keep every speed cell (issue 43: "before/after
interleaved in one run on one machine"). Each cell runs stock fairseq-generate once (its
H-lines are the reference) and then each checkout ``--rounds`` times, old and new
alternating which goes first; prints every run (fairseq's generation time, H-lines equal to
stock's) and per cell the minimum of each side. The cells are the bundled models' test sets
(es->en beam 5 at batch 64 and 8 in one process, the batch-at-a-time loop, aggressive greedy
decoding on kjv-web at batch 32 and 1, a batch on its own with attention weights or
sampling, ``--fp16``); ``--cells`` picks some by index.
"""
import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "examples" / "bible" / "bundle"
ONE = ["--fastgen-decode-workers", "1"]
CELLS = [  # (task, batch, beam, plugin flags[, flags of both sides])
    ("es-en", 64, 5, ONE),
    ("es-en", 64, 5, ONE + ["--fastgen-continuous", "off"]),
    ("es-en", 8, 5, ONE),
    ("kjv-web", 32, 1, ONE + ["--fastgen-aggressive", "on"]),
    ("kjv-web", 1, 1, ONE + ["--fastgen-aggressive", "on"]),
    # a batch on its own, every sentence at once (stock's rows): attention, sampling
    ("es-en", 64, 5, ONE, ["--print-alignment"]),
    ("es-en", 64, 2, ONE, ["--sampling", "--sampling-topk", "10", "--seed", "3", "--nbest", "2",
                           "--max-len-b", "60"]),
    # half precision (each side against its own stock: stock --fp16)
    ("es-en", 64, 5, ONE, ["--fp16"]),
]


def run(task: str, batch: int, beam: int, plugin: Path = None, flags=(), common=()):
    """(generation seconds or the error's tail, sorted H-lines) of one fairseq-generate."""
    d = BUNDLE / task
    src, tgt = task.split("-")
    exe = Path(sys.executable).parent / "fairseq-generate"
    args = [str(exe), str(d), "--path", str(d / "checkpoint.pt"), "--source-lang", src,
            "--target-lang", tgt, "--gen-subset", "test", "--beam", str(beam),
            "--batch-size", str(batch), "--post-process", "sentencepiece", "--scoring", "sacrebleu",
            *common]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if plugin is None:
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"  # stock on torch >= 2.6
    else:
        args += ["--user-dir", str(plugin / "fairseq_fastgen"), *flags]
    p = subprocess.run(args, env=env, capture_output=True, text=True)
    m = re.search(r"Translated .* in ([\d.]+)s", p.stderr + p.stdout)
    hyps = sorted(l for l in p.stdout.splitlines() if l.startswith("H-"))
    return (float(m.group(1)) if m else p.stderr[-300:]), hyps


def same_tokens(hyps, ref) -> int:
    """H-lines whose id and text are stock's (scores aside: lossless, not bitwise)."""
    return sum(a.split("\t")[0:3:2] == b.split("\t")[0:3:2] for a, b in zip(hyps, ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="checkout before the change")
    ap.add_argument("--new", type=Path, default=ROOT, help="checkout after (default: this one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cells", type=int, nargs="*", default=None, help="cell indices (default: all)")
    a = ap.parse_args()
    for i, (task, batch, beam, flags, *common) in enumerate(CELLS):
        if a.cells is not None and i not in a.cells:
            continue
        common = common[0] if common else []
        key = f"{task} batch {batch} beam {beam} {' '.join(flags + common)}"
        stock, ref = run(task, batch, beam, common=common)
        times = {"stock": [stock], "old": [], "new": []}
        for r in range(a.rounds):
            sides = [("old", a.old), ("new", a.new)]
            for name, tree in sides if r % 2 == 0 else sides[::-1]:
                t, hyps = run(task, batch, beam, tree.resolve(), flags, common)
                times[name].append(t)
                print(f"{key} | {name} {t} | {same_tokens(hyps, ref)}/{len(ref)} H-lines as stock",
                      flush=True)
        best = {k: min(v) if all(isinstance(x, float) for x in v) else v for k, v in times.items()}
        print(f"RESULT {key} | {best}", flush=True)


if __name__ == "__main__":
    main()
