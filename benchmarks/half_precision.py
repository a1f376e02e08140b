"""--fp16 and --bf16 on a bundled model, side by side with stock in one run.

For each precision: fairseq's generation time of stock and the plugin (interleaved, min of
``--rounds``), how many best hypotheses agree with stock in the same precision and with
fp32 stock, the noise floor (stock in that precision at ``--floor-batch`` against itself)
and each side's BLEU.  Stock ignores --bf16: its reference is stock's modules and loop
under the same precision (the plugin's bitwise mode, models/precision.py); "whole-model
bf16" rows are not measured here.

    python benchmarks/half_precision.py [--model es-en] [--batch 64] [--rounds 2]
        [--subset test] [--out benchmarks/results/half_precision_CPU.md]
"""
import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fastgen.agreement import agreement  # noqa: E402
from fairseq_fastgen.compare import run_generate  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="es-en", choices=["es-en", "kjv-web"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--floor-batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--subset", default="test")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    d = BUNDLE / a.model
    src, tgt = ("es", "en") if a.model == "es-en" else ("kjv", "web")
    base = [str(d), "--path", str(d / "checkpoint.pt"), "--source-lang", src, "--target-lang", tgt,
            "--post-process", "sentencepiece", "--beam", "5", "--gen-subset", a.subset,
            "--required-batch-size-multiple", "1", "--scoring", "sacrebleu"]

    def run(batch, plugin, flags=(), plugin_args=()):
        r = run_generate(base + ["--batch-size", str(batch), *flags], plugin, list(plugin_args))
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        return r

    cells = {  # name: (flags, reference is stock (else bitwise plugin), plugin args)
        "fp32": ([], True, []),
        "fp16": (["--fp16"], True, []),
        "bf16": (["--bf16"], False, []),
    }
    fp32 = run(a.batch, False)
    rows = []
    for name, (flags, stock_ref, pargs) in cells.items():
        ref_args = () if stock_ref else ("--fastgen-bitwise",)
        times = {"stock": [], "fastgen": []}
        ref = fast = None
        for i in range(a.rounds):
            for who in (("stock", "fastgen") if i % 2 == 0 else ("fastgen", "stock")):
                if who == "stock":
                    ref = run(a.batch, not stock_ref, flags, ref_args)
                    times[who].append(ref.gen_time)
                else:
                    fast = run(a.batch, True, flags, pargs)
                    times[who].append(fast.gen_time)
        floor = run(a.floor_batch, not stock_ref, flags, ref_args)
        same, noise, vs32 = (agreement(ref.stdout, fast.stdout), agreement(ref.stdout, floor.stdout),
                             agreement(fp32.stdout, fast.stdout))
        s, f = min(times["stock"]), min(times["fastgen"])
        rows.append(f"| {name} | {'stock' if stock_ref else 'stock modules (bitwise)'} | {s:.1f} s | "
                    f"{f:.1f} s | {s / f:.2f}x | {fp32.gen_time / f:.2f}x | {same.same}/{same.sentences} | "
                    f"{noise.same}/{noise.sentences} | {vs32.same}/{vs32.sentences} | "
                    f"{same.bleu_a:.2f} / {same.bleu_b:.2f} |")
        print(rows[-1], flush=True)
    head = (f"# Half precision, {a.model}, beam 5, batch {a.batch}, {a.subset} "
            f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})\n\n"
            f"CPU: {_cpu()}; fairseq's generation time, min of {a.rounds} interleaved rounds; "
            f"noise floor: the reference at batch {a.floor_batch} against itself.\n\n"
            "| precision | reference | reference time | fastgen | vs reference | vs stock fp32 "
            "(one run) | agree with reference | noise floor | agree with fp32 stock | "
            "BLEU reference / fastgen |\n|---|---|---|---|---|---|---|---|---|---|\n")
    text = head + "\n".join(rows) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
