#!/usr/bin/env python
"""Side-by-side speed of stock fairseq-generate vs fairseq-fastgen (same run, same data).

For each setting, stock and plugin processes are interleaved ``--repeats`` times; the
report gives min-of-N generation time (fairseq's own "Translated ... in Xs"), whole-process
wall time, the ratios, peak RSS, and whether the plugin's output was lossless (and, for
bitwise mode, byte-identical).  Results: benchmarks/results/<name>.json and .md.

    python benchmarks/generate_speed.py                       # default grid
    python benchmarks/generate_speed.py --batch 64 --threads 1 --repeats 3
"""
import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fastgen.compare import side_by_side  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle"
ABLATIONS = {
    "all on (lossless)": [],
    "bitwise": ["--fastgen-bitwise"],
    "no native step": ["--fastgen-disable", "native_step"],
    "no fast decoder": ["--fastgen-disable", "fast_decoder"],
}


def gen_args(task, beam, batch, subset):
    d = BUNDLE / task
    src, tgt = ("es", "en") if task == "es-en" else ("kjv", "web")
    args = [str(d), "--path", str(d / "checkpoint.pt"), "--source-lang", src, "--target-lang", tgt,
            "--beam", str(beam), "--batch-size", str(batch), "--post-process", "sentencepiece",
            "--scoring", "sacrebleu"]
    if subset != "test":
        args += ["--gen-subset", subset]
    return args


def measure(task, beam, batch, threads, plugin_args, repeats, subset):
    t0 = time.time()
    res = side_by_side(gen_args(task, beam, batch, subset), plugin_args, repeats, threads=threads)
    r = res.ratios()
    row = dict(task=task, beam=beam, batch=batch, threads=threads, subset=subset,
               plugin_args=" ".join(plugin_args), lossless=res.comparison.lossless,
               identical=res.comparison.identical, sentences=res.stock[0].sentences,
               max_score_diff=res.comparison.max_score_diff,
               seconds=time.time() - t0, **r)
    print(json.dumps(row), flush=True)
    return row


def table(rows):
    head = ("| task | beam | batch | threads | plugin flags | sentences | stock sent/s | fastgen sent/s "
            "| gen ratio | process ratio | lossless | byte-identical |")
    out = [head, "|" + "---|" * 12]
    for r in rows:
        out.append(f"| {r['task']} | {r['beam']} | {r['batch']} | {r['threads']} | "
                   f"{r['plugin_args'] or '(default)'} | {r['sentences']} | "
                   f"{r.get('stock_sent_per_s', 0):.1f} | {r.get('plugin_sent_per_s', 0):.1f} | "
                   f"{r.get('gen_ratio', 0):.2f}x | {r['wall_ratio']:.2f}x | "
                   f"{'yes' if r['lossless'] else 'NO'} | {'yes' if r['identical'] else 'no'} |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="es-en")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32, 64, 128])
    p.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ablation-batch", type=int, default=64, help="batch for the ablation rows (0: none)")
    p.add_argument("--subset", default="test",
                   help="test (1,000 verses), test2 (first 300) or test1 (first 100)")
    p.add_argument("--subset-batch1", default="test1", help="subset for batch size 1")
    p.add_argument("--ablation-repeats", type=int, default=None)
    p.add_argument("--name", default="generate_speed")
    a = p.parse_args()
    rows = []
    for threads in a.threads:
        for batch in a.batch:
            subset = a.subset_batch1 if batch == 1 else a.subset
            rows.append(measure(a.task, a.beam, batch, threads, [], a.repeats, subset))
        if a.ablation_batch:
            for name, flags in ABLATIONS.items():
                if flags:
                    rows.append(measure(a.task, a.beam, a.ablation_batch, threads, flags,
                                        a.ablation_repeats or a.repeats, a.subset))
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.processor() or platform.machine(),
                python=platform.python_version(), repeats=a.repeats)
    (out / f"{a.name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (out / f"{a.name}.md").write_text(f"Measured {meta['date']} on {meta['machine']}, min of "
                                      f"{a.repeats} interleaved runs.\n\n" + table(rows) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
