"""The suite's figures: throughput vs batch per grid combination, the ablation bars, the
scaling curves (PNG, matplotlib's Agg backend)."""
from pathlib import Path
from typing import Dict

from .report import SYSTEM_ORDER


def plots(res: dict, out: Path) -> Dict[str, Path]:
    """Write the figures the results have data for; {"throughput"|"ablation"|"scaling": path}.
    Each figure function returns its figure, or None without data for it."""
    import matplotlib

    matplotlib.use("Agg")
    import logging

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib.pyplot as plt

    files = {}
    for key, name, draw in (("throughput", "throughput_vs_batch.png", _throughput),
                            ("ablation", "ablation.png", _ablation), ("scaling", "scaling.png", _scaling)):
        fig = draw(plt, res)
        if fig is None:
            continue
        fig.tight_layout()
        files[key] = out / name
        fig.savefig(files[key], dpi=110)
        plt.close(fig)
    return files


def _throughput(plt, res: dict):
    """Sentences/s against batch size, one panel per (model, beam, ngram, precision)."""
    grid = [c for c in res["cells"] if c["tag"].startswith("grid")]
    combos = sorted({(c["model"], c["beam"], c["ngram"], c["precision"]) for c in grid})
    if combos:
        ncol = min(4, len(combos))
        nrow = (len(combos) + ncol - 1) // ncol
        fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.4 * nrow), squeeze=False)
        for ax, (model, beam, ngram, prec) in zip(axes.flat, combos):
            cs = sorted((c for c in grid if (c["model"], c["beam"], c["ngram"], c["precision"]) == (model, beam, ngram, prec)),
                        key=lambda c: c["batch"])
            for sysname in SYSTEM_ORDER[:2] + res["config"].get("extra_systems", []) + SYSTEM_ORDER[2:]:
                pts = [(c["batch"], c["systems"][sysname]["sent_per_s"]) for c in cs if sysname in c["systems"]]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=sysname)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (sentences)")
            ax.set_ylabel("sentences / s")
            ax.set_title(f"{model} beam {beam}" + (f" ngram {ngram}" if ngram else "") + (f" {prec}" if prec != "fp32" else ""),
                         fontsize=9)
            ax.grid(alpha=.3)
        for ax in list(axes.flat)[len(combos):]:
            ax.axis("off")
        axes.flat[0].legend(fontsize=7)
        return fig
    return None


def _ablation(plt, res: dict):
    """Speed-up over stock of each ablation variant, one panel per ablation cell."""
    abl = [c for c in res["cells"] if c["tag"].startswith("ablation")]
    if abl:
        fig, axes = plt.subplots(1, len(abl), figsize=(5.5 * len(abl), 3.8), squeeze=False)
        for ax, c in zip(axes.flat, abl):
            names = [n for n in c["systems"] if not n.startswith("ct2-")]
            vals = [c["systems"][n]["speedup"] for n in names]
            ax.barh(names, vals, color=["grey" if n == "stock" else "tab:blue" for n in names])
            ax.axvline(1.0, color="k", lw=.8)
            ax.set_xlabel("generation speed-up vs stock (same run)")
            ax.set_title(f"{c['model']} beam {c['beam']} batch {c['batch']} ngram {c['ngram']}", fontsize=9)
            ax.invert_yaxis()
        return fig
    return None


def _scaling(plt, res: dict):
    """ms per sentence against source length and beam size, stock and fastgen."""
    sc = res.get("scaling") or []
    if sc:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for ax, kind, xl in ((axes[0], "length", "source length (tokens)"), (axes[1], "beam", "beam size")):
            for model in sorted({r["model"] for r in sc}):
                rows = sorted((r for r in sc if r["kind"] == kind and r["model"] == model), key=lambda r: r["x"])
                for name, style in (("stock", "--"), ("fastgen", "-")):
                    ax.plot([r["x"] for r in rows], [1000 * r[f"{name}_s_per_sent"] for r in rows], style,
                            marker="o", label=f"{name} {model}")
            ax.set_xlabel(xl)
            ax.set_ylabel("ms per sentence")
            if kind == "length":
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
            ax.grid(alpha=.3)
            ax.legend(fontsize=7)
        return fig
    return None
