#!/usr/bin/env python
"""fairseq-generate over torchrun ranks (issue 17): the default single process, 1 rank and
2 ranks under torchrun, side by side in one run, the bundled es->en test set.

Per system: wall time of the whole command (start-up included), fairseq's generation time
(under torchrun: the slowest rank's), sentences per second of generation, and from rank
0's closing lines each rank's time waiting for the others (at the window exchanges, and at
the end).  Runs are interleaved (order rotated per round), min over rounds; every output is
checked lossless against the single process's of the same round.

    python benchmarks/ranks_scaling.py [--beam 5] [--batch 64] [--subset test] [--rounds 2]
"""
import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fastgen.compare import compare_outputs, run_generate  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle" / "es-en"
GENERATE = str(Path(sys.executable).parent / "fairseq-generate")


def torchrun(n: int):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(n), GENERATE]


SYSTEMS = {"one process": None, "torchrun, 1 rank": torchrun(1), "torchrun, 2 ranks": torchrun(2)}
WAIT = re.compile(r"rank (\d+): (\d+) batch\(es\), (\d+) sentence\(s\), ([\d.]+)s generating, "
                  r"([\d.]+)s waiting for other ranks \(([\d.]+)s at the end\)")


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def measure(beam: int, batch: int, subset: str, rounds: int) -> dict:
    args = [str(BUNDLE), "--path", str(BUNDLE / "checkpoint.pt"), "--source-lang", "es",
            "--target-lang", "en", "--gen-subset", subset, "--beam", str(beam),
            "--batch-size", str(batch), "--required-batch-size-multiple", "1",
            "--post-process", "sentencepiece", "--cpu"]
    names = list(SYSTEMS)
    best = {n: {"wall_s": float("inf"), "gen_s": float("inf")} for n in names}
    lossless = {n: True for n in names[1:]}
    for r in range(rounds):
        outs = {}
        for n in names[r % len(names):] + names[: r % len(names)]:
            run = run_generate(args, plugin=True, program=SYSTEMS[n])
            if run.returncode != 0:
                raise RuntimeError(f"{n} failed:\n{run.stderr[-3000:]}")
            outs[n] = run.stdout
            if run.gen_time < best[n]["gen_s"]:
                waits = [dict(rank=int(m[0]), batches=int(m[1]), sentences=int(m[2]),
                              gen_s=float(m[3]), waited_s=float(m[4]), waited_end_s=float(m[5]))
                         for m in WAIT.findall(run.stderr + run.stdout)]
                best[n] = {"wall_s": run.wall, "gen_s": run.gen_time,
                           "sentences": run.sentences,
                           "sentences_per_s": run.sentences / run.gen_time, "ranks": waits}
        for n in names[1:]:
            lossless[n] &= compare_outputs(outs["one process"], outs[n]).lossless
        print(f"round {r}: " + ", ".join(f"{n} {best[n]['gen_s']:.1f}s" for n in names),
              flush=True)
    return {"beam": beam, "batch": batch, "subset": subset, "rounds": rounds,
            "systems": best, "lossless_vs_one_process": lossless}


def report(res: dict) -> str:
    lines = [f"# fairseq-generate over torchrun ranks ({res['cpu']})", "",
             f"`python benchmarks/ranks_scaling.py --beam {res['beam']} --batch {res['batch']} "
             f"--subset {res['subset']} --rounds {res['rounds']}`: bundled es->en, "
             "`--cpu --post-process sentencepiece`, min over interleaved rounds.", "",
             "| system | wall s | generation s | sentences/s | vs one process | lossless | "
             "per rank: generating s / waiting s (at the end) |", "|---|---|---|---|---|---|---|"]
    one = res["systems"]["one process"]["gen_s"]
    for n, s in res["systems"].items():
        ranks = "; ".join(f"rank {w['rank']}: {w['gen_s']:.1f} / {w['waited_s']:.1f} "
                          f"({w['waited_end_s']:.1f})" for w in s.get("ranks", [])) or "-"
        ok = res["lossless_vs_one_process"].get(n, "reference")
        lines.append(f"| {n} | {s['wall_s']:.1f} | {s['gen_s']:.1f} | {s['sentences_per_s']:.1f} "
                     f"| {one / s['gen_s']:.2f}x | {ok} | {ranks} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--subset", default="test", help="test: 1,000 verses; test1: 100")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ranks_scaling"))
    a = p.parse_args()
    res = measure(a.beam, a.batch, a.subset, a.rounds)
    res["cpu"] = cpu_name()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
