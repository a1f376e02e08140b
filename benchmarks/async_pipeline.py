#!/usr/bin/env python
"""End-to-end wall time of fairseq-generate with the asynchronous pipeline on vs off.

All sides load the plugin with the same generator flags (other optimizations equal): off
is ``--fastgen-disable pipeline`` (fairseq's loop), on is the pipeline with decoding in the main
process (``--fastgen-decode-workers 1``), on+dw the default (batches also decoded side by
side in worker processes).  Setting: the bundled es->en model, beam 5,
SentencePiece removal plus Moses detokenization (``--post-process sentencepiece
--tokenizer moses``), sacrebleu.  For each batch size the two sides are interleaved
``--repeats`` times (alternating the order); the report gives the min-of-N
whole-process wall time, fairseq's own generation time, the ratios off/on and off/on+dw
(> 1: faster than the loop), whether on was byte-identical to off and on+dw lossless.

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


SIDES = ("off", "on", "on+dw")


def measure(batch, args, plugin_args, workers, repeats, threads):
    """Three sides, interleaved: fairseq's loop (off), the pipeline with decoding in the
    main process (on: the postprocessing overlap alone), and the default with decoding
    workers as well (on+dw, see tasks/decode_workers.py)."""
    from fairseq_fastgen.compare import compare_outputs

    sides = {
        "off": plugin_args + ["--fastgen-disable", "pipeline"],
        "on": plugin_args + ["--fastgen-decode-workers", "1"]
        + (["--fastgen-tune", f"pipeline_workers={workers}"] if workers else []),
        "on+dw": list(plugin_args),
    }
    runs = {k: [] for k in SIDES}
    reference = None
    identical, lossless_dw = True, True
    for r in range(repeats):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for side in order:
            run = run_generate(args, plugin=True, plugin_args=sides[side], threads=threads)
            if run.returncode != 0:
                raise SystemExit(f"pipeline {side} failed:\n{run.stderr[-3000:]}")
            if side == "off" and reference is None:
                reference = run.stdout
            runs[side].append(run)
            print(f"  batch {batch} pipeline {side}: wall {run.wall:.2f}s, "
                  f"generation {run.gen_time}s", flush=True)
    for run in runs["on"]:
        identical &= run.stdout == reference
    for run in runs["on+dw"]:
        lossless_dw &= compare_outputs(reference, run.stdout).lossless
    wall = {k: min(x.wall for x in v) for k, v in runs.items()}
    gen = {k: min(x.gen_time for x in v) for k, v in runs.items()}
    return dict(batch=batch, repeats=repeats, sentences=runs["on"][0].sentences,
                wall_on=round(wall["on"], 3), wall_off=round(wall["off"], 3),
                wall_on_dw=round(wall["on+dw"], 3),
                ratio_wall=round(wall["off"] / wall["on"], 4),
                ratio_wall_dw=round(wall["off"] / wall["on+dw"], 4),
                gen_on=gen["on"], gen_off=gen["off"], gen_on_dw=gen["on+dw"],
                peak_rss_mb_on=round(max(x.peak_rss_mb for x in runs["on"]), 1),
                peak_rss_mb_off=round(max(x.peak_rss_mb for x in runs["off"]), 1),
                identical=identical, lossless_dw=lossless_dw)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--subset", default="test", help="test (1000 verses), test2 (300), test1 (100)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP/MKL threads of each run (default: torch's default)")
    ap.add_argument("--workers", type=int, default=0, help="--fastgen-tune pipeline_workers (0: auto)")
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
    return 0 if all(r["identical"] and r["lossless_dw"] for r in rows) else 1


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
        "# fairseq-generate: asynchronous pipeline on vs off (and with decoding workers)",
        "",
        f"es->en bundled model, beam {a.beam}, `--gen-subset {a.subset}`, `--post-process sentencepiece"
        + (f" --tokenizer {a.tokenizer}`" if a.tokenizer else "`")
        + f", sacrebleu; plugin flags on both sides: `{a.plugin_args or '(none)'}`; "
        f"threads: {a.threads or 'default'}; workers: {a.workers or 'auto'}; "
        f"{meta['cores']} cores; min of {a.repeats} interleaved runs.",
        "",
        "on = pipeline with decoding in the main process (`--fastgen-decode-workers 1`): the "
        "postprocessing overlap alone, byte-identical to the loop; on+dw = the default, batches "
        "also decoded side by side in worker processes (another thread count per GEMM: lossless, "
        "not byte-identical); off = fairseq's loop (`--fastgen-disable pipeline`), same generator.",
        "",
        "| batch | sentences | wall off (s) | wall on (s) | ratio off/on | byte-identical "
        "| wall on+dw (s) | ratio off/on+dw | lossless | generation off/on/on+dw (s) "
        "| peak RSS off/on (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['sentences']} | {r['wall_off']:.2f} | {r['wall_on']:.2f} "
                     f"| **{r['ratio_wall']:.3f}** | {'yes' if r['identical'] else 'NO'} "
                     f"| {r['wall_on_dw']:.2f} | **{r['ratio_wall_dw']:.3f}** "
                     f"| {'yes' if r['lossless_dw'] else 'NO'} "
                     f"| {r['gen_off']} / {r['gen_on']} / {r['gen_on_dw']} "
                     f"| {r['peak_rss_mb_off']:.0f}/{r['peak_rss_mb_on']:.0f} |")
    lines += ["", f"Command: `{meta['command']}`", ""]
    (out / "async_pipeline.md").write_text("\n".join(lines))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
