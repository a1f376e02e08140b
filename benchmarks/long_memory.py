#!/usr/bin/env python
"""Memory of a long fairseq-generate run over time, stock vs plugin (issue 18).

The bundled es->en test set (1,000 verses) is repeated to N sentences (default 100,000)
in a binarized copy cached under benchmarks/out/long_memory/.  Stock fairseq-generate and
the plugin run one after the other at each beam (``--cpu``, ``--post-process
sentencepiece``, output to a file under the work dir, which also tells how many sentences
are done).  Every ``--period`` seconds the summed PSS of the whole process tree is sampled
(PSS, not RSS: pages a forked worker shares with its parent count once, split between
them; see benchmarks/tree_memory.py).  Reported per run: peak PSS, PSS when 10/50/90% of
the sentences were written, the slope (MB per 10,000 sentences, least squares over the
second half of the sentences, after warm-up), wall time, the tree's process count and
each process's peak PSS and USS (private memory: a worker with its own copy of the
weights would show it there).

fairseq orders a run's batches by source length, so a repeated test set is decoded from
its shortest verses to its longest: a slope also contains the cost of longer sentences.
Stock, beside the plugin, shows how much of it a stock run has too.

    python benchmarks/long_memory.py                      # 100,000 sentences, beams 1 and 5
    python benchmarks/long_memory.py --sentences 20000 --beams 5
    python benchmarks/long_memory.py --tiny --out /tmp/lm  # seconds: the test's run
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fairseq_fastgen.compare import generate_command  # noqa: E402

BUNDLE = ROOT / "examples" / "bible" / "bundle" / "es-en"
WORK = ROOT / "benchmarks" / "out" / "long_memory"
SRC, TGT, SUBSET = "es", "en", "test"
MB = 1e6  # figures in MB (10^6 bytes), as the issue's


# ---- the data set ------------------------------------------------------------------

def build_dataset(n: int, work: Path) -> Path:
    """A data dir whose ``test`` subset is the bundle's test set repeated to ``n``
    sentences (whole copies, then the first verses), binarized by concatenation; cached."""
    from fairseq.data import indexed_dataset as ixd

    out = work / f"data-{n}"
    done = out / "complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for lang in (SRC, TGT):
        shutil.copy(BUNDLE / f"dict.{lang}.txt", out / f"dict.{lang}.txt")
        stem = f"{SUBSET}.{SRC}-{TGT}.{lang}"
        base = str(BUNDLE / stem)
        index = ixd.MMapIndexedDataset.Index(ixd.index_file_path(base))
        builder = ixd.MMapIndexedDatasetBuilder(str(out / f"{stem}.bin"), dtype=index.dtype)
        size = len(index.sizes)
        for _ in range(n // size):
            builder.merge_file_(base)
        if n % size:
            ds = ixd.MMapIndexedDataset(base)
            for i in range(n % size):
                builder.add_item(ds[i])
        builder.finalize(str(out / f"{stem}.idx"))
    done.write_text(f"{n}\n")
    return out


def generate_args(data: Path, beam: int, batch: int, results: Path) -> List[str]:
    return [str(data), "--path", str(BUNDLE / "checkpoint.pt"), "--source-lang", SRC,
            "--target-lang", TGT, "--gen-subset", SUBSET, "--beam", str(beam),
            "--batch-size", str(batch), "--cpu", "--post-process", "sentencepiece",
            "--scoring", "sacrebleu", "--results-path", str(results)]


# ---- sampling ----------------------------------------------------------------------

def tree_snapshot(root: psutil.Process) -> Dict[str, Dict[str, float]]:
    """{pid: {name, pss, uss, rss} in MB} of ``root`` and its descendants now."""
    procs = [root] + root.children(recursive=True)
    snap = {}
    for q in procs:
        try:
            m = q.memory_full_info()
            name = q.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        snap[str(q.pid)] = dict(name=name, pss=m.pss / MB, uss=m.uss / MB, rss=m.rss / MB)
    return snap


class LineCounter:
    """Hypothesis lines ("H-") in a file that another process is writing."""

    def __init__(self, path: Path):
        self.path, self.offset, self.count, self.tail = path, 0, 0, b""

    def update(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.count
        self.offset += len(chunk)
        data = self.tail + chunk
        cut = data.rfind(b"\n") + 1  # whole lines only; the rest waits for its end
        whole, self.tail = data[:cut], data[cut:]
        self.count += whole.count(b"\nH-") + whole.startswith(b"H-")
        return self.count


def sample_run(cmd: List[str], env: Dict[str, str], output: Path, period: float) -> dict:
    """Run ``cmd``; every ``period`` s the tree's memory and the sentences written."""
    counter = LineCounter(output)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root = psutil.Process(p.pid)
    samples, seen = [], {}
    while p.poll() is None:
        t = time.perf_counter() - t0
        try:
            snap = tree_snapshot(root)
        except psutil.NoSuchProcess:
            break
        if snap:
            for pid, m in snap.items():
                seen[pid] = m["name"]
            samples.append(dict(t=round(t, 2), done=counter.update(),
                                pss=sum(m["pss"] for m in snap.values()),
                                rss=sum(m["rss"] for m in snap.values()), procs=snap))
        time.sleep(max(0.0, period - (time.perf_counter() - t0 - t)))
    stderr = p.stderr.read().decode(errors="replace")
    code = p.wait()
    return dict(exit=code, wall_s=time.perf_counter() - t0, samples=samples,
                processes=seen, written=counter.update(), stderr_tail=stderr[-2000:])


# ---- figures -----------------------------------------------------------------------

def least_squares(xs: List[float], ys: List[float]) -> Optional[float]:
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return None if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def slope_per_10k(samples: List[dict], n: int) -> Optional[float]:
    """MB per 10,000 sentences over the second half of the sentences (until the last is
    written: not the exit): the least-squares slope of PSS over time, divided by the
    sentences per second of that stretch (written output comes in steps, time does not)."""
    window = [s for s in samples if n / 2 <= s["done"] < n]
    slope = _slope(window)
    if slope is None:
        # output in bursts (continuous batching holds a batch whose sentences the margin
        # guard decodes again): the second half in time of the writing, up to the last line
        end = next((i for i, s in enumerate(samples) if s["done"] >= n), None)
        start = next((i for i, s in enumerate(samples) if s["done"] > 0), None)
        if end is None or start is None:
            return None
        writing = samples[start:end + 1]
        mid = (writing[0]["t"] + writing[-1]["t"]) / 2
        slope = _slope([s for s in writing if s["t"] >= mid])
    return slope


def _slope(window: List[dict]) -> Optional[float]:
    """MB per 10,000 sentences over ``window``: PSS's least-squares slope over time over
    the sentences per second written in it; None: too few samples or nothing written."""
    if len(window) < 2:
        return None
    per_s = least_squares([s["t"] for s in window], [s["pss"] for s in window])
    dt = window[-1]["t"] - window[0]["t"]
    rate = (window[-1]["done"] - window[0]["done"]) / dt if dt > 0 else 0
    if per_s is None or rate <= 0:
        return None
    return per_s / rate * 10000


def at_fraction(samples: List[dict], n: int, frac: float) -> Optional[float]:
    """PSS of the first sample taken once ``frac`` of the sentences were written."""
    for s in samples:
        if s["done"] >= frac * n:
            return s["pss"]
    return None


def per_process(samples: List[dict]) -> Dict[str, dict]:
    """Peak PSS and USS of each process, by name (workers: fastgen-dec-0, ...)."""
    out: Dict[str, dict] = {}
    for s in samples:
        for m in s["procs"].values():
            d = out.setdefault(m["name"], dict(peak_pss=0.0, peak_uss=0.0, peak_rss=0.0))
            d["peak_pss"] = max(d["peak_pss"], m["pss"])
            d["peak_uss"] = max(d["peak_uss"], m["uss"])
            d["peak_rss"] = max(d["peak_rss"], m["rss"])
    return {k: {f: round(v, 1) for f, v in d.items()} for k, d in out.items()}


def summarize(run: dict, n: int) -> dict:
    s = run["samples"]
    peak = max(s, key=lambda x: x["pss"]) if s else None
    return dict(
        exit=run["exit"], wall_s=round(run["wall_s"], 1), sentences_written=run["written"],
        samples=len(s), peak_pss_mb=round(peak["pss"], 1) if peak else None,
        peak_at_done=peak["done"] if peak else None,
        peak_rss_mb=round(max(x["rss"] for x in s), 1) if s else None,
        pss_10_50_90_mb=[None if v is None else round(v, 1)
                         for v in (at_fraction(s, n, f) for f in (0.1, 0.5, 0.9))],
        slope_mb_per_10k=_round(slope_per_10k(s, n), 2),
        processes_max=max((len(x["procs"]) for x in s), default=0),
        processes_seen=len(run["processes"]), per_process=per_process(s))


def _round(v, k):
    return None if v is None else round(v, k)


def series(samples: List[dict], points: int = 200) -> List[list]:
    """[t, sentences done, PSS MB] downsampled to about ``points`` samples."""
    step = max(1, len(samples) // points)
    keep = samples[::step]
    if keep and keep[-1] is not samples[-1]:
        keep.append(samples[-1])
    return [[s["t"], s["done"], round(s["pss"], 1)] for s in keep]


# ---- the runs and the report -------------------------------------------------------

def run_one(system: str, data: Path, beam: int, batch: int, work: Path, period: float,
            plugin_args: List[str], stock_threads: Optional[int] = None) -> dict:
    results = work / f"out-{system}-beam{beam}"
    shutil.rmtree(results, ignore_errors=True)
    cmd, env = generate_command(generate_args(data, beam, batch, results),
                                plugin=system == "plugin", plugin_args=plugin_args,
                                threads=None if system == "plugin" else stock_threads)
    run = sample_run(cmd, env, results / f"generate-{SUBSET}.txt", period)
    text = (results / f"generate-{SUBSET}.txt").read_text(errors="replace") \
        if (results / f"generate-{SUBSET}.txt").exists() else ""
    run["log"] = [ln for ln in text.splitlines()
                  if ln[:2] not in ("S-", "T-", "H-", "D-", "P-")][-12:]
    shutil.rmtree(results, ignore_errors=True)  # 100,000 sentences of text: ~100 MB
    return run


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        f"# Long-run memory: stock vs plugin, {res['sentences']:,} sentences",
        "",
        f"`python benchmarks/long_memory.py {' '.join(res['argv'])}`. Bundled es->en model, "
        f"test set repeated to {res['sentences']:,} sentences, batch {res['batch_size']}, "
        f"`--cpu --post-process sentencepiece`, output to a file; summed PSS of the "
        f"process tree sampled every {res['period_s']} s. Machine: {m['cpus']} CPU(s), "
        f"{m['memory_gb']} GB, shared with other work while this ran (load average at "
        f"the start {m['load_start']}): wall times are not speed figures. Stock's torch "
        f"threads: {res['stock_threads'] or 'its default'}; the plugin's: its default.",
        "",
        "Slope: MB of PSS per 10,000 sentences, least squares over the second half of the "
        "sentences (PSS over time divided by that stretch's sentences per second). "
        "PSS at 10/50/90%: when that share of the sentences was written. fairseq decodes "
        "the shortest verses first, so a slope includes longer sentences' activations.",
        "",
        "| beam | system | peak PSS MB | PSS 10% / 50% / 90% MB | slope MB/10k sent. "
        "| peak RSS MB (summed) | wall s | processes | exit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["runs"]:
        s = r["summary"]
        mid = " / ".join("-" if v is None else f"{v:.0f}" for v in s["pss_10_50_90_mb"])
        slope = "-" if s["slope_mb_per_10k"] is None else f"{s['slope_mb_per_10k']:+.2f}"
        lines.append(f"| {r['beam']} | {r['system']} | {s['peak_pss_mb']:.0f} | {mid} | "
                     f"{slope} | {s['peak_rss_mb']:.0f} | {s['wall_s']:.0f} | "
                     f"{s['processes_max']} | {s['exit']} |")
    lines += ["", "Per process (peak PSS / peak USS MB; USS: pages no other process maps):", ""]
    for r in res["runs"]:
        procs = ", ".join(f"{k} {v['peak_pss']:.0f} / {v['peak_uss']:.0f}"
                          for k, v in r["summary"]["per_process"].items())
        lines.append(f"* beam {r['beam']} {r['system']}: {procs}")
    if res.get("notes"):
        lines += ["", *res["notes"]]
    return "\n".join(lines) + "\n"


def machine() -> dict:
    return dict(cpus=psutil.cpu_count(), memory_gb=round(psutil.virtual_memory().total / 1e9, 1),
                load_start=" ".join(f"{x:.2f}" for x in os.getloadavg()))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=100_000)
    ap.add_argument("--beams", default="1,5", help="comma-separated, e.g. 1,5")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--systems", default="stock,plugin")
    ap.add_argument("--period", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--plugin-args", default="", help="extra flags of the plugin's runs")
    ap.add_argument("--stock-threads", type=int, default=None,
                    help="OMP/MKL threads of stock's runs (default: torch's own choice); on a "
                         "loaded machine 2 OpenMP threads can run stock many times slower")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                    help="folder of <name>.json and <name>.md")
    ap.add_argument("--name", default=None, help="report name (default long_memory[_tiny])")
    ap.add_argument("--work", type=Path, default=WORK, help="cached data and run output")
    ap.add_argument("--note", action="append", default=[], help="a line for the report")
    ap.add_argument("--tiny", action="store_true",
                    help="seconds-long: 256 sentences, beam 1, batch 16, samples every 0.2 s")
    a = ap.parse_args(argv)
    if a.tiny:
        a.sentences, a.beams, a.batch_size, a.period = 256, "1", 16, 0.2
    a.name = a.name or ("long_memory_tiny" if a.tiny else "long_memory")
    return a


def main(argv=None):
    a = parse(argv)
    res = dict(argv=sys.argv[1:] if argv is None else list(argv), sentences=a.sentences,
               batch_size=a.batch_size, period_s=a.period, machine=machine(),
               plugin_args=a.plugin_args, stock_threads=a.stock_threads, notes=a.note,
               runs=[])
    data = build_dataset(a.sentences, a.work)
    a.out.mkdir(parents=True, exist_ok=True)
    for beam in (int(b) for b in a.beams.split(",")):
        for system in a.systems.split(","):
            run = run_one(system, data, beam, a.batch_size, a.work, a.period,
                          a.plugin_args.split(), a.stock_threads)
            summary = summarize(run, a.sentences)
            res["runs"].append(dict(system=system, beam=beam, summary=summary,
                                    series=series(run["samples"]), log=run["log"],
                                    stderr_tail=run["stderr_tail"] if run["exit"] else ""))
            print(f"beam {beam} {system}: exit {summary['exit']}, {summary['wall_s']} s, "
                  f"peak PSS {summary['peak_pss_mb']} MB, 10/50/90% "
                  f"{summary['pss_10_50_90_mb']}, slope {summary['slope_mb_per_10k']} "
                  f"MB/10k, {summary['processes_max']} process(es)", flush=True)
            # written after every run: a long benchmark cut short keeps what it measured
            (a.out / f"{a.name}.json").write_text(json.dumps(res, indent=1) + "\n")
            (a.out / f"{a.name}.md").write_text(markdown(res))
    return 0 if all(r["summary"]["exit"] == 0 for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
