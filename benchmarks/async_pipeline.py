#!/usr/bin/env python
"""End-to-end wall time of fairseq-generate with the asynchronous pipeline on vs off.

Both sides load the plugin with the same generator flags (other optimizations equal); the
only difference is ``--fastgen-no-pipeline``.  Setting: the bundled es->en model, beam 5,
SentencePiece removal plus Moses detokenization (``--post-process sentencepiece
--tokenizer moses``), sacrebleu.  For each batch size the two sides are interleaved
``--repeats`` times (alternating which goes first); the report gives the min-of-N
whole-process wall time, fairseq's own generation time, the ratio off/on (> 1: the
pipeline is faster) and whether every run's output was byte-identical.

    python benchmarks/async_pipeline.py                          # batch 1 and 64, 3 repeats
    python benchmarks/async_pipeline.py --subset test1 --repeats 1 --out-dir /tmp   # smoke run

Results: <out-dir>/async_pipeline.json and .md (default benchmarks/results/).
"""
import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fastgen.compare import run_generate  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle"


def gen_args(batch, beam, subset, tokenizer):
    d = BUNDLE / "es-en"
    args = [str(d), "--path", str(d / "checkpoint.pt"), "--source-lang", "es", "--target-lang", "en",
            "--beam", str(beam), "--batch-size", str(batch), "--post-process", "sentencepiece",
            "--scoring", "sacrebleu", "--gen-subset", subset]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    return args


def measure(batch, args, plugin_args, workers, repeats, threads):
    sides = {
        "on": plugin_args + (["--fastgen-pipeline-workers", str(workers)] if workers else []),
        "off": plugin_args + ["--fastgen-no-pipeline"],
    }
    runs = {"on": [], "off": []}
    reference = None
    identical = True
    for r in range(repeats):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for side in order:
            run = run_generate(args, plugin=True, plugin_args=sides[side], threads=threads)
            if run.returncode != 0:
                raise SystemExit(f"pipeline {side} failed:\n{run.stderr[-3000:]}")
            if reference is None:
                reference = run.stdout
            identical &= run.stdout == reference
            runs[side].append(run)
            print(f"  batch {batch} pipeline {side}: wall {run.wall:.2f}s, "
                  f"generation {run.gen_time}s", flush=True)
    on_wall = min(x.wall for x in runs["on"])
    off_wall = min(x.wall for x in runs["off"])
    on_gen = min(x.gen_time for x in runs["on"])
    off_gen = min(x.gen_time for x in runs["off"])
    return dict(batch=batch, repeats=repeats, sentences=runs["on"][0].sentences,
                wall_on=round(on_wall, 3), wall_off=round(off_wall, 3),
                ratio_wall=round(off_wall / on_wall, 4),
                gen_on=on_gen, gen_off=off_gen,
                peak_rss_mb_on=round(max(x.peak_rss_mb for x in runs["on"]), 1),
                peak_rss_mb_off=round(max(x.peak_rss_mb for x in runs["off"]), 1),
                identical=identical)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--subset", default="test", help="test (1000 verses), test2 (300), test1 (100)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP/MKL threads of each run (default: torch's default)")
    ap.add_argument("--workers", type=int, default=0, help="--fastgen-pipeline-workers (0: auto)")
    ap.add_argument("--tokenizer", default="moses", help="detokenizer on top of SentencePiece ('' for none)")
    ap.add_argument("--plugin-args", default="", help="extra plugin flags for both sides, e.g. --fastgen-bitwise")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)

    plugin_args = a.plugin_args.split()
    rows = []
    t0 = time.time()
    for batch in a.batch:
        args = gen_args(batch, a.beam, a.subset, a.tokenizer)
        rows.append(measure(batch, args, plugin_args, a.workers, a.repeats, a.threads))
        print(json.dumps(rows[-1]), flush=True)
        report = write_results(a, argv, rows, t0)  # after every row: a cut-short run keeps its rows
    print(report)
    return 0 if all(r["identical"] for r in rows) else 1


def write_results(a, argv, rows, t0):
    meta = dict(task="es-en", beam=a.beam, subset=a.subset, tokenizer=a.tokenizer,
                threads=a.threads, workers=a.workers or "auto", plugin_args=a.plugin_args,
                cores=len(os.sched_getaffinity(0)), machine=platform.machine(),
                python=platform.python_version(), seconds=round(time.time() - t0, 1),
                command="python benchmarks/async_pipeline.py " + " ".join(argv or sys.argv[1:]))
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_pipeline.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    lines = [
        "# fairseq-generate: asynchronous pipeline on vs off",
        "",
        f"es->en bundled model, beam {a.beam}, `--gen-subset {a.subset}`, `--post-process sentencepiece"
        + (f" --tokenizer {a.tokenizer}`" if a.tokenizer else "`")
        + f", sacrebleu; plugin flags on both sides: `{a.plugin_args or '(none)'}`; "
        f"threads: {a.threads or 'default'}; workers: {a.workers or 'auto'}; "
        f"{meta['cores']} cores; min of {a.repeats} interleaved runs.",
        "",
        "| batch | sentences | wall on (s) | wall off (s) | ratio off/on | generation on (s) "
        "| generation off (s) | peak RSS on/off (MiB) | byte-identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['sentences']} | {r['wall_on']:.2f} | {r['wall_off']:.2f} "
                     f"| **{r['ratio_wall']:.3f}** | {r['gen_on']} | {r['gen_off']} "
                     f"| {r['peak_rss_mb_on']:.0f}/{r['peak_rss_mb_off']:.0f} "
                     f"| {'yes' if r['identical'] else 'NO'} |")
    lines += ["", f"Command: `{meta['command']}`", ""]
    (out / "async_pipeline.md").write_text("\n".join(lines))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
