"""Benchmark suite: stock fairseq-generate vs fairseq-fastgen (all on, and each optimization
off alone) vs CTranslate2 (fp32, int8), side by side in one run, with a physical limit.

    python benchmarks/suite                    # full CPU suite (< 30 min on 2 cores)
    python benchmarks/suite --quick --out /tmp/s   # smoke version (< 5 min)
    python benchmarks/suite --device cuda      # GPU variant: fp32 and fp16 (skips without CUDA)

Per cell (model x beam x batch x --no-repeat-ngram-size) every system runs as its own process
(CTranslate2 too), interleaved over ``--repeats`` rounds with the order rotated each round;
figures are min (and median) of fairseq's own generation time ("Translated ... in Xs") or of
CTranslate2's ``translate_batch`` call, and the peak RSS of the process (os.wait4).  fastgen's
output is checked against stock's with ``fairseq_fastgen.compare.compare_outputs`` (lossless);
CTranslate2's agreement with stock is reported (exact-match rate of the output sentences).

Inputs are the first N verses of the bundled binarized test sets (N per batch size, see
``grid.SENTENCES``), written as binarized subsets under OUT/work/data; the scaling study
binarizes synthetic sources of exactly L tokens (test verses concatenated).

Outputs: OUT/results.json, OUT/*.png, and the report (BENCHMARKS.md at the repo root for a
full run; OUT/BENCHMARKS.md for --quick unless --report says otherwise).
"""
import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .data import prepare_data
from .grid import (
    MODELS, ROOT, SENTENCES, Grid, Repeats, Variant, as_grid_cell, discover_ablations, grid_cells, grid_notes,
    select_grid)
from .machine import gemm_throughput, machine_info, model_dims, same_shapes
from .measure import SuiteContext, measure_cell, scaling
from .plots import plots
from .progress import log
from .report import update_readme, write_report
from .runners import Ct2Runner, fairseq_runner

COMMAND = ["python", "benchmarks/suite"]


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=" ".join(COMMAND), description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--quick", action="store_true", help="smoke version: es-en, beam 5, batch 8, 16 verses (< 5 min)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "suite")
    p.add_argument("--report", type=Path, default=None,
                   help="markdown report (default: BENCHMARKS.md at the repo root; OUT/BENCHMARKS.md with --quick)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=None, help="interleaved rounds per cell (full: 2, quick: 1)")
    p.add_argument("--models", nargs="*", choices=sorted(MODELS), default=None)
    p.add_argument("--no-ct2", action="store_true", help="skip CTranslate2")
    p.add_argument("--no-scaling", action="store_true", help="skip the scaling study")
    p.add_argument("--no-ablation", action="store_true", help="skip the ablation cells")
    p.add_argument("--no-fork-server", action="store_true",
                   help="CPU: start every fairseq-generate as a fresh process (imports included, "
                        "~7 s more per run) instead of forking it from benchmarks/fork_server.py")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS", type=Variant.parse,
                   help="extra fastgen system in every grid cell, e.g. 'fastgen aggressive=--fastgen-aggressive on' "
                        "(beam-1-only switches: prefix NAME with 'beam1:'); repeatable")
    p.add_argument("--update-readme", action="store_true",
                   help="replace README.md's bench-suite block with this run's headline table and plot")
    return p.parse_args(argv)


def prepare_inputs(work: Path, g: Grid, counts: Dict[int, int], with_scaling: bool):
    """Binarized inputs and shapes of every model: (data dirs, split meta, dims)."""
    data, meta, dims = {}, {}, {}
    need = [counts[b] for b in g.batches] + [g.scale_beam_n]
    for model in g.models:
        dims[model] = model_dims(model)
        data[model], meta[model] = prepare_data(work, model, need, g.scale_lengths if with_scaling else [],
                                                g.scale_n, dims[model]["max_positions"])
    return data, meta, dims


def convert_ct2(ct2: Ct2Runner, models) -> Tuple[Optional[Dict[Tuple[str, str], Path]], Optional[str]]:
    """The converted CTranslate2 models, or None and why CTranslate2 is skipped."""
    try:
        import ctranslate2  # noqa: F401

        return {(model, q): ct2.convert(model, q) for model in models for q in ("float32", "int8")}, None
    except Exception as e:  # noqa: BLE001
        return None, f"CTranslate2 skipped: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def save_partial(out: Path, cells) -> None:
    """The cells measured so far (OUT/cells.partial.json): a run cut short keeps its figures."""
    slim = [dict(c, systems={n: {k: v for k, v in r.items() if k != "stdout"}
                             for n, r in c["systems"].items()}) for c in cells]
    (out / "cells.partial.json").write_text(json.dumps(slim, indent=1, default=str))


def run_grid(ctx: SuiteContext, specs, out: Path, extra_systems: List[str], t_start: float) -> List[dict]:
    """Every cell in order; an ablation cell's group is also the grid cell (a copy, fewer systems)."""
    cells = []
    t_grid = time.time()
    for spec in specs:
        cell = measure_cell(ctx, spec)
        cells.append(cell)
        save_partial(out, cells)
        done = len([c for c in cells if c["tag"].startswith(("ablation", "grid")) and not c.get("copy")])
        log(f"  cell {done}/{len(specs)}, grid elapsed {(time.time() - t_grid) / 60:.1f} min, "
            f"suite elapsed {(time.time() - t_start) / 60:.1f} min")
        if spec.ablation:
            cells.append(as_grid_cell(cell, extra_systems))
    return cells


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    mode = "quick" if a.quick else "full"
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("suite: --device cuda but CUDA is not available here: nothing to do (skipped)")
            return 0
    g = select_grid(mode, a.models or (), a.device)
    t_start = time.time()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    report_path = (a.report or (out / "BENCHMARKS.md" if a.quick else ROOT / "BENCHMARKS.md")).resolve()
    # inputs binarized here and the converted CTranslate2 models (~70 MB): not for git
    work = out / "work"
    work.mkdir(exist_ok=True)
    (work / ".gitignore").write_text("*\n")
    with fairseq_runner(a.device, a.threads, work / "runs", not a.no_fork_server) as runner:
        res = measure(a, g, mode, runner, out, work, t_start)
    files = plots(res, out)
    res["elapsed_s"] = time.time() - t_start
    (out / "results.json").write_text(json.dumps(res, indent=1, default=str))
    write_report(res, files, report_path, [*COMMAND, *argv])
    if a.update_readme:
        update_readme(res, files)
    lossy = [(c["tag"], n) for c in res["cells"] for n, r in c["systems"].items() if r.get("lossless") is False]
    lossy += [("scaling", f"{r['kind']}={r['x']}") for r in res["scaling"] if not r["lossless"]]
    log(f"done in {res['elapsed_s'] / 60:.1f} min: {report_path}, {out}/results.json"
        + (f"; NOT lossless: {lossy}" if lossy else "; fastgen lossless in every cell"))
    return 1 if lossy else 0


def measure(a: argparse.Namespace, g: Grid, mode: str, runner, out: Path, work: Path, t_start: float) -> dict:
    """Everything the run measures, as results.json's dict (stdout of the runs dropped)."""
    repeats = Repeats.of(g, a.repeats or 0)
    counts = SENTENCES[mode]
    data, meta, dims = prepare_inputs(work, g, counts, not a.no_scaling)
    machine = machine_info(a.threads, a.device)
    log(f"suite ({mode}, {a.device}): {machine['cpu']}, {a.threads} threads, {repeats.grid} repeats "
        f"({repeats.ngram} with --no-repeat-ngram-size, {repeats.scaling} in the scaling study)")
    if not same_shapes(dims):
        log("note: models differ in shape; GEMM throughput measured at the first model's shapes")
    gemm = {prec: gemm_throughput(dims[g.models[0]], a.device, prec, a.threads) for prec in g.precisions}
    log(f"GEMM peak: " + ", ".join(f"{p} {v['peak_gflops']} GFLOP/s" for p, v in gemm.items()))
    not_covered = []
    ct2 = None if a.no_ct2 else Ct2Runner(work, a.threads, a.device)
    ct2_dirs = {}
    if ct2 is not None:
        ct2_dirs, skipped = convert_ct2(ct2, g.models)
        if skipped:
            ct2, ct2_dirs = None, {}
            not_covered.append(skipped)
            log(skipped)
    ct2_types = {"fp32": ["float32"] if a.device == "cuda" else ["float32", "int8"],
                 "fp16": ["float16", "int8_float16"]}
    ctx = SuiteContext(work=work, device=a.device, threads=a.threads, repeats=repeats, runner=runner, ct2=ct2,
                       ct2_types=ct2_types, ct2_dirs=ct2_dirs, data=data, meta=meta, dims=dims, gemm=gemm)
    ablations = [] if a.no_ablation else discover_ablations()
    extra_systems = [v.name for v in a.variant]
    cells = run_grid(ctx, grid_cells(g, counts, repeats, ablations, a.variant), out, extra_systems, t_start)
    sc = []
    if not a.no_scaling:
        for model in [m for m in g.scale_models if m in g.models]:
            sc += scaling(ctx, model, g, "fp16" if a.device == "cuda" else "fp32")
    not_covered += grid_notes(g, counts, a.quick)
    res = dict(machine=machine, gemm=gemm, dims=dims, cells=cells, scaling=sc,
               config=dict(mode=mode, fork_server=a.device == "cpu" and not a.no_fork_server, repeats=repeats.grid,
                           repeats_ct2=repeats.ct2, extra_systems=extra_systems, repeats_ngram=repeats.ngram,
                           scale_repeats=repeats.scaling, sentences={b: counts[b] for b in g.batches},
                           grid=asdict(g)),
               not_covered=not_covered, elapsed_s=time.time() - t_start)
    for c in res["cells"]:
        for r in c["systems"].values():
            r.pop("stdout", None)
    return res
