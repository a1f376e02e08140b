#!/usr/bin/env python
"""Demo: stock fairseq vs fairseq-fastgen on the bundled es->en Bible model, beam 5.

Prints BLEU, sentences/s of both, the speed ratio and whether the output is lossless.
"""
import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fastgen.compare import side_by_side  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="es-en", choices=["es-en", "kjv-web"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--subset", default="test", choices=["test", "test2", "test1"],
                   help="test: 1,000 verses; test2: the first 300; test1: the first 100")
    a = p.parse_args()
    src, tgt = ("es", "en") if a.task == "es-en" else ("kjv", "web")
    data = BUNDLE / a.task
    args = [str(data), "--path", str(data / "checkpoint.pt"), "--source-lang", src,
            "--target-lang", tgt, "--gen-subset", a.subset, "--beam", str(a.beam),
            "--batch-size", str(a.batch_size), "--post-process", "sentencepiece",
            "--scoring", "sacrebleu"]
    print(f"fairseq-generate {' '.join(args)}\n  stock vs --user-dir fairseq_fastgen ...", flush=True)
    res = side_by_side(args, repeats=a.repeats)
    bleu = re.search(r"^Generate .*$", res.stock[0].stdout, re.M)
    r = res.ratios()
    print(bleu.group(0) if bleu else "(no BLEU line)")
    print(f"stock:   {r.get('stock_sent_per_s', float('nan')):8.1f} sentences/s "
          f"(generation {r.get('stock_gen_s', float('nan')):.1f}s, process {r['stock_wall_s']:.1f}s)")
    print(f"fastgen: {r.get('plugin_sent_per_s', float('nan')):8.1f} sentences/s "
          f"(generation {r.get('plugin_gen_s', float('nan')):.1f}s, process {r['plugin_wall_s']:.1f}s)")
    print(f"speed-up: {r.get('gen_ratio', float('nan')):.2f}x generation, "
          f"{r['wall_ratio']:.2f}x whole process")
    print(f"lossless: {'yes' if res.comparison.lossless else 'no'} "
          f"(byte-identical: {'yes' if res.comparison.identical else 'no'})")
    for d in res.comparison.differences[:5]:
        print("  diff:", d)
    return 0 if res.comparison.lossless else 1


if __name__ == "__main__":
    sys.exit(main())
