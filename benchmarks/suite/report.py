"""The suite's report (BENCHMARKS.md) and README headline, rendered from results.json's dict
with the templates in ``templates/`` (string.Template): the prose lives there, the tables
are built here."""
import os
import re
import statistics
from pathlib import Path
from string import Template
from typing import Dict, Optional, Sequence

from .grid import MAX_LEN_B, ROOT
from .progress import log

TEMPLATES = Path(__file__).resolve().parent / "templates"
SYSTEM_ORDER = ["stock", "fastgen", "ct2-float32", "ct2-int8", "ct2-float16", "ct2-int8_float16"]


def render(name: str, **values: Optional[str]) -> str:
    """templates/NAME with the values substituted.  A value of None drops the paragraph that is
    only its placeholder (an optional figure or section), with the blank line that separates it."""
    paragraphs = _read(name).split("\n\n")
    kept = [p for p in paragraphs if not (p.startswith("$") and p[1:] in values and values[p[1:]] is None)]
    return Template("\n\n".join(kept)).substitute({k: v for k, v in values.items() if v is not None})


def fragment(name: str, **values: str) -> str:
    """One run-dependent phrase of templates/fragments.tmpl."""
    lines = (line.split(": ", 1) for line in _read("fragments.tmpl").splitlines()
             if line.strip() and not line.startswith("#"))
    return Template(dict(lines)[name]).substitute(values)


def _read(name: str) -> str:
    # a template file's last newline is the file's, not the text's
    return (TEMPLATES / name).read_text().removesuffix("\n")


def _f(x, fmt="{:.1f}"):
    return "–" if x is None else fmt.format(x)


def _order(name):
    return (0 if name == "stock" else 1 if name == "fastgen" else 3 if name.startswith("ct2-") else 2,
            SYSTEM_ORDER.index(name) if name in SYSTEM_ORDER else 0)


def cell_table(cells: Sequence[dict]) -> str:
    """One row per system of each cell, stock first, then fastgen, its variants, CTranslate2."""
    head = ("| model | beam | batch | ngram | sent. | system | sent/s | tok/s | speed-up | x limit | process s "
            "| peak RSS MiB | BLEU | vs stock |")
    out = [head, "|" + "---|" * 14]
    for c in cells:
        for name in sorted(c["systems"], key=_order):
            r = c["systems"][name]
            mem = _f(r["peak_rss_mb"], "{:.0f}") + (f" (GPU {r['peak_gpu_mb']:.0f})" if r.get("peak_gpu_mb") else "")
            out.append(f"| {c['model']} | {c['beam']} | {c['batch']} | {c['ngram'] or '–'} | {c['sentences']} | {name}"
                       + (f" {c['precision']}" if c["precision"] != "fp32" else "")
                       + f" | {_f(r['sent_per_s'])} | {_f(r['tok_per_s'], '{:.0f}')} | {_f(r['speedup'], '{:.2f}x')} "
                       f"| {_f(r['x_limit'])} | {_f(r['wall_s_min'])} | {mem} | {_f(r['bleu'])} | {_vs_stock(name, r)} |")
    return "\n".join(out)


def _vs_stock(name: str, r: dict) -> str:
    fixed = " vs #4709-fixed stock" if r.get("reference") == "stock, #4709 fixed" else ""
    if name == "stock":
        return "(reference)" + (" ≠ #4709-fixed stock" if r.get("differs_from_fixed") else "")
    if "agreement" in r:
        return f"agree {100 * r['agreement']['exact']:.0f}% sent., {100 * r['agreement']['words']:.0f}% words{fixed}"
    return ("lossless" if r["lossless"] else "**NOT lossless**") + (", byte-identical" if r["identical"] else "") + fixed


def _ratio(cell: Optional[dict], a: str, b: str) -> Optional[float]:
    """System a's speed-up over stock divided by system b's in ``cell`` (None: not both)."""
    sa, sb = ((cell or {}).get("systems", {}).get(s, {}).get("speedup") for s in (a, b))
    return sa / sb if sa and sb else None


def headline(res: dict) -> str:
    """README-ready snippet: fastgen and CTranslate2 speed-up over stock, per model/beam/batch."""
    grid = [c for c in res["cells"] if c["tag"].startswith("grid") and not c["ngram"]]
    if not grid:
        return "(no grid cells)"
    batches = sorted({c["batch"] for c in grid})
    ct2 = [s for s in SYSTEM_ORDER if s.startswith("ct2-") and any(s in c["systems"] for c in grid)]
    lines = ["| model | beam | precision | system | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|" + "---|" * (4 + len(batches))]
    for model, beam, prec in sorted({(c["model"], c["beam"], c["precision"]) for c in grid}):
        cells = [next((c for c in grid if (c["model"], c["beam"], c["precision"], c["batch"])
                       == (model, beam, prec, b)), None) for b in batches]
        for sysname in ["fastgen"] + ct2:
            vals = []
            for c in cells:
                r = c["systems"].get(sysname) if c else None
                vals.append(_f(r["speedup"], "{:.2f}x") if r else "–")
            lines.append(f"| {model} | {beam} | {prec} | {sysname} | " + " | ".join(vals) + " |")
        ref = "ct2-float32" if prec == "fp32" else "ct2-float16"
        if ref in ct2:  # fastgen's speed as a multiple of CTranslate2's at the same precision
            vals = [_f(_ratio(c, "fastgen", ref), "{:.2f}x") for c in cells]
            lines.append(f"| {model} | {beam} | {prec} | fastgen / {ref} | " + " | ".join(vals) + " |")
    m = res["machine"]
    ok = all(c["systems"]["fastgen"]["lossless"] for c in res["cells"] if "fastgen" in c["systems"])
    cpu = m["device"] == "cpu"
    ct2_note = (f" CTranslate2 at its best thread setting for the same cores, per cell: one pool of "
                f"{m['threads']} threads or {m['threads']} replicas of one thread (`inter_threads`)."
                if cpu and ct2 and m["threads"] > 1 else "")
    return render("headline.md.tmpl", machine=m["cpu"] if cpu else m.get("gpu"),
                  threads=m["threads"], date=m["date"], every="every" if ok else "NOT every",
                  ct2_note=ct2_note, table="\n".join(lines))


def spread_line(res: dict) -> str:
    """How far repeated runs of the same system in the same cell disagree: the yardstick for
    reading a speed-up (a difference smaller than this is not a measured effect)."""
    spreads = sorted(max(r["gen_s_all"]) / min(r["gen_s_all"]) - 1
                     for c in res["cells"] if not c.get("copy") for r in c["systems"].values()
                     if len([t for t in r.get("gen_s_all", []) if t]) > 1 and all(r["gen_s_all"]))
    if not spreads:
        return fragment("spread_unmeasured")
    med, p90 = statistics.median(spreads), spreads[int(0.9 * (len(spreads) - 1))]
    return fragment("spread", n=len(spreads), median=f"{100 * med:.0f}", p90=f"{100 * p90:.0f}",
                    largest=f"{100 * spreads[-1]:.0f}")


def _ablation_section(cells: Sequence[dict], figure: Optional[str]) -> Optional[str]:
    if not cells:
        return None
    where = ", ".join(f"{c['model']}: beam {c['beam']}, batch {c['batch']}, ngram {c['ngram']}" for c in cells)
    return render("ablation.md.tmpl", cells=where, table=cell_table(cells),
                  figure=figure and f"![ablation]({figure})")


def _scaling_section(rows: Sequence[dict], figure: Optional[str]) -> Optional[str]:
    if not rows:
        return None
    lines = [f"| {r['model']} | {r['kind']} | {r['x']} | {r['batch']} | {r['sentences']} | "
             f"{1000 * r['stock_s_per_sent']:.1f} | {1000 * r['fastgen_s_per_sent']:.1f} | {r['speedup']:.2f}x | "
             f"{r['stock_ms_per_token']:.2f} | {r['fastgen_ms_per_token']:.2f} | {'yes' if r['lossless'] else '**no**'} |"
             for r in rows]
    return render("scaling.md.tmpl", max_len_b=MAX_LEN_B, rows="\n".join(lines),
                  figure=figure and f"![scaling]({figure})")


def render_report(res: dict, files: Dict[str, Path], path: Path, argv: Sequence[str]) -> str:
    """The markdown report of one run; figure links relative to the report's folder."""
    m, cfg = res["machine"], res["config"]
    figs = {k: os.path.relpath(p, path.parent) for k, p in files.items()}
    forked = bool(cfg.get("fork_server"))
    return render(
        "report.md.tmpl", device=m["device"], command=" ".join(argv), date=m["date"],
        elapsed_min=f"{res['elapsed_s'] / 60:.1f}", cpu=m["cpu"], cores=m["cores"], threads=m["threads"],
        gpu=f"; GPU: {m['gpu']}" if m.get("gpu") else "", python=m["python"], torch=m["torch"],
        fairseq=m.get("fairseq-fixed", m.get("fairseq", "?")), ctranslate2=m.get("ctranslate2", "not installed"),
        gemm="; ".join(f"{p}: " + ", ".join(f"{k} {v}" for k, v in g["shapes"].items())
                       for p, g in res["gemm"].items()),
        headline=headline(res),
        throughput_figure=f"![throughput vs batch]({figs['throughput']})" if "throughput" in figs else None,
        sentences=", ".join(f"{n} at batch {b}" for b, n in cfg["sentences"].items()),
        fork_server=" " + fragment("fork_server") if forked else "",
        repeats=cfg["repeats"], repeats_ngram=cfg["repeats_ngram"], scale_repeats=cfg["scale_repeats"],
        repeats_ct2=cfg.get("repeats_ct2", cfg["repeats"]),
        process_time=fragment("process_time_forked" if forked else "process_time_fresh"),
        spread=spread_line(res), max_decoding_length=MAX_LEN_B + 1,
        results=cell_table([c for c in res["cells"] if c["tag"].startswith("grid")]),
        ablation=_ablation_section([c for c in res["cells"] if c["tag"].startswith("ablation")], figs.get("ablation")),
        scaling=_scaling_section(res.get("scaling") or [], figs.get("scaling")),
        not_covered="\n".join(f"* {x}" for x in res["not_covered"])) + "\n"


def write_report(res: dict, files: Dict[str, Path], path: Path, argv: Sequence[str]) -> None:
    path.write_text(render_report(res, files, path, argv))


def update_readme(res: dict, files: Dict[str, Path]) -> None:
    """Replace README.md's bench-suite block with this run's headline table and plot."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    m = re.search(r"(<!-- bench-suite:begin[^\n]*-->\n)(.*?)(<!-- bench-suite:end -->)", text, re.S)
    if not m:
        log("README.md has no bench-suite block: not updated")
        return
    body = headline(res) + "\n"
    if "throughput" in files:
        body += f"\n![throughput vs batch]({os.path.relpath(files['throughput'], ROOT)})\n"
    readme.write_text(text[:m.start(2)] + body + text[m.end(2):])
    log("README.md benchmark block updated")
