#!/usr/bin/env python
"""fairseq-interactive --input FILE, stock vs the plugin's loops, side by side in one run.

The bundled es->en test set's 1,000 source verses as raw text (decoded from the binarized
set: dictionary symbols, then sentencepiece), translated with the same command by stock and
by the plugin: its default (forked decoding workers on CPU), one process with continuous
batching (``--fastgen-decode-workers 1 --fastgen-continuous on``) and one process with
fairseq's loop (``--fastgen-decode-workers 1``).  Runs are interleaved, order rotated per
round; the time is interactive's own ``Total time`` (model loading included, imports
excluded), min over rounds; each plugin output is checked lossless against stock's of the
same round (``W-`` lines are times and are not compared).

    python benchmarks/interactive_speed.py [--beam 5] [--buffer-size 64] [--batch-size 32]
        [--rounds 2] [--out benchmarks/results/interactive_speed]
"""
import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from continuous_batching import cpu_name  # noqa: E402
from fairseq_fastgen.compare import compare_outputs, run_generate  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle"
SYSTEMS = {
    "stock": None,
    "fastgen (default: decoding workers)": [],
    "fastgen (one process, continuous)": ["--fastgen-decode-workers", "1",
                                          "--fastgen-continuous", "on"],
    "fastgen (one process, fairseq's loop)": ["--fastgen-decode-workers", "1"],
}
TOTAL = re.compile(r"Total time: ([\d.]+) seconds")


def source_text(subset: str) -> str:
    """The subset's Spanish verses as raw text, one per line."""
    import sentencepiece as spm
    from fairseq.data import Dictionary, data_utils

    d = Dictionary.load(str(BUNDLE / "es-en" / "dict.es.txt"))
    ds = data_utils.load_indexed_dataset(str(BUNDLE / "es-en" / f"{subset}.es-en.es"), d)
    sp = spm.SentencePieceProcessor(model_file=str(BUNDLE / "spm.model"))
    return "".join(sp.decode(d.string(ds[i]).split()) + "\n" for i in range(len(ds)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--subset", default="test")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--buffer-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "interactive_speed"))
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fastgen-interactive-"))
    src = tmp / "input.es"
    src.write_text(source_text(a.subset))
    args = [str(BUNDLE / "es-en"), "--path", str(BUNDLE / "es-en" / "checkpoint.pt"),
            "--source-lang", "es", "--target-lang", "en", "--bpe", "sentencepiece",
            "--sentencepiece-model", str(BUNDLE / "spm.model"), "--input", str(src),
            "--beam", str(a.beam), "--buffer-size", str(a.buffer_size),
            "--batch-size", str(a.batch_size), "--cpu"]
    names = list(SYSTEMS)
    best = {n: float("inf") for n in names}
    lossless = {n: True for n in names[1:]}
    for r in range(a.rounds):
        outs = {}
        for n in names[r % len(names):] + names[: r % len(names)]:
            run = run_generate(args, plugin=SYSTEMS[n] is not None, plugin_args=SYSTEMS[n] or (),
                               entry="fairseq-interactive")
            m = TOTAL.search(run.stderr)
            if run.returncode != 0 or m is None:
                raise RuntimeError(f"{n} failed:\n{run.stderr[-2000:]}")
            best[n] = min(best[n], float(m[1]))
            outs[n] = run.stdout
        for n in names[1:]:
            lossless[n] &= compare_outputs(outs["stock"], outs[n]).lossless
        print(f"round {r}: " + ", ".join(f"{n} {best[n]:.2f}s" for n in names), flush=True)
    res = {"cpu": cpu_name(), "args": vars(a), "total_s": best,
           "speedup": {n: best["stock"] / best[n] for n in names[1:]}, "lossless": lossless}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [f"# fairseq-interactive --input FILE ({res['cpu']})", "",
             f"{a.subset} (es->en), beam {a.beam}, --buffer-size {a.buffer_size}, --batch-size "
             f"{a.batch_size}; interactive's Total time (model loading included), min of "
             f"{a.rounds} interleaved rounds.", "", "| system | total s | speed-up | lossless |",
             "|---|---|---|---|", f"| stock | {best['stock']:.2f} | 1.00x | |"]
    for n in names[1:]:
        lines.append(f"| {n} | {best[n]:.2f} | {res['speedup'][n]:.2f}x | "
                     f"{'yes' if lossless[n] else 'NO'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(lossless.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
