"""Which cells the suite measures: models, beams, batches, n-gram sizes, precisions, the
systems of each cell (stock, fastgen, the ablation switches, ``--variant`` systems) and how
many interleaved rounds each gets."""
import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Sequence, Tuple


ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "examples" / "bible" / "bundle"
MODELS = {"es-en": ("es", "en"), "kjv-web": ("kjv", "web")}
MAX_LEN_B = 200  # fairseq's defaults: max_len_a=0, max_len_b=200 (hypothesis tokens before EOS)
# sentences per cell, by batch size: a batch-1 cell is latency-bound, so fewer sentences
# at least 4 batches per cell: two decoding workers get work at every batch size
SENTENCES = {"full": {1: 8, 8: 32, 32: 128, 128: 512}, "quick": {8: 16}}

Flags = Tuple[str, ...]
System = Tuple[str, Flags]  # (name in the report, flags added to the plugin run)


@dataclass(frozen=True)
class Grid:
    """One mode's grid; written to results.json as ``config.grid`` (field order = key order)."""
    models: Tuple[str, ...]
    beams: Tuple[int, ...]
    batches: Tuple[int, ...]
    ngrams: Tuple[int, ...]
    ablation: Dict[str, int]  # the one (beam, batch, ngram) cell per model that runs the ablations
    scale_models: Tuple[str, ...]
    scale_lengths: Tuple[int, ...]
    scale_n: int
    scale_batch: int
    scale_beams: Tuple[int, ...]
    scale_beam_n: int
    scale_beam_batch: int
    repeats: int
    repeats_ngram: int
    repeats_ct2: int
    scale_repeats: int
    precisions: Tuple[str, ...] = ("fp32",)


GRID = {
    "full": Grid(models=("es-en", "kjv-web"), beams=(1, 5), batches=(1, 8, 32, 128), ngrams=(0, 3),
                 ablation=dict(beam=5, batch=32, ngram=3),
                 scale_models=("es-en",), scale_lengths=(16, 64, 256, 512), scale_n=4, scale_batch=4,
                 scale_beams=(1, 4, 8, 12), scale_beam_n=16, scale_beam_batch=16,
                 repeats=2, repeats_ngram=2, repeats_ct2=1, scale_repeats=2),
    "quick": Grid(models=("es-en",), beams=(5,), batches=(8,), ngrams=(0, 3),
                  ablation=dict(beam=5, batch=8, ngram=3),
                  scale_models=("es-en",), scale_lengths=(16, 64), scale_n=4, scale_batch=4,
                  scale_beams=(1, 4), scale_beam_n=16, scale_beam_batch=16,
                  repeats=1, repeats_ngram=1, repeats_ct2=1, scale_repeats=1),
}


def select_grid(mode: str, models: Sequence[str] = (), device: str = "cpu") -> Grid:
    """The mode's grid, restricted to ``models`` if given; fp16 joins fp32 on CUDA."""
    g = GRID[mode]
    if models:
        g = replace(g, models=tuple(models))
    return replace(g, precisions=("fp32", "fp16") if device == "cuda" else ("fp32",))


@dataclass(frozen=True)
class Repeats:
    """Interleaved rounds per system: grid cells, --no-repeat-ngram-size cells other than the
    ablation cell, CTranslate2, the scaling study."""
    grid: int
    ngram: int
    ct2: int
    scaling: int

    @classmethod
    def of(cls, g: Grid, override: int = 0) -> "Repeats":
        grid = override or g.repeats
        # CTranslate2 is a reference point, not the comparison under test: one round fits the budget
        return cls(grid=grid, ngram=override or g.repeats_ngram, ct2=min(grid, g.repeats_ct2),
                   scaling=override or g.scale_repeats)


@dataclass(frozen=True)
class Variant:
    """An extra fastgen system from ``--variant NAME=FLAGS`` ('beam1:NAME': beam-1 cells only)."""
    name: str
    flags: Flags
    beam1_only: bool = False

    @classmethod
    def parse(cls, spec: str) -> "Variant":
        if "=" not in spec:
            raise argparse.ArgumentTypeError(f"--variant {spec!r}: expected NAME=FLAGS")
        name, flags = spec.split("=", 1)
        beam1 = name.startswith("beam1:")
        name = name[len("beam1:"):] if beam1 else name
        return cls(name if name.startswith("fastgen") else "fastgen " + name, tuple(flags.split()), beam1)


@dataclass(frozen=True)
class CellSpec:
    """One group of interleaved runs: stock, then ``systems`` (fastgen and its variants)."""
    model: str
    split: str  # the binarized subset: f"n{sentences}"
    beam: int
    batch: int
    ngram: int
    precision: str
    ablation: bool  # this cell also runs every ablation switch (and serves as the grid cell)
    systems: Tuple[System, ...]
    repeats: int

    @property
    def tag(self) -> str:
        return (("ablation" if self.ablation else "grid")
                + f" {self.model} beam{self.beam} batch{self.batch} ngram{self.ngram} {self.precision}")


def grid_cells(g: Grid, counts: Dict[int, int], repeats: Repeats, ablations: Sequence[System],
               variants: Sequence[Variant]) -> List[CellSpec]:
    """Every cell of the grid in the order it runs (precision, model, beam, ngram, batch)."""
    ab = g.ablation
    cells = []
    for prec in g.precisions:
        for model in g.models:
            for beam in g.beams:
                for ngram in g.ngrams:
                    for batch in g.batches:
                        is_abl = (bool(ablations) and prec == "fp32"
                                  and (beam, batch, ngram) == (ab["beam"], ab["batch"], ab["ngram"]))
                        systems = [("fastgen", ())] + (list(ablations) if is_abl else [])
                        systems += [(v.name, v.flags) for v in variants if beam == 1 or not v.beam1_only]
                        cells.append(CellSpec(model, f"n{counts[batch]}", beam, batch, ngram, prec, is_abl,
                                              tuple(systems),
                                              repeats.grid if (is_abl or not ngram) else repeats.ngram))
    return cells


def as_grid_cell(cell: dict, extra_systems: Sequence[str]) -> dict:
    """The grid cell that an ablation cell's group also measured (same runs, fewer systems)."""
    return dict(cell, tag="grid" + cell["tag"][len("ablation"):], copy=True,
                systems={k: v for k, v in cell["systems"].items()
                         if k in ("stock", "fastgen") or k.startswith("ct2-") or k in extra_systems})


def discover_ablations() -> List[System]:
    """fastgen's ablations: each optimization that ``--fastgen-disable`` switches off (its
    on/off ones, log lines aside), plus bitwise mode, one decoding process and stock's
    n-gram blocker."""
    from fairseq_fastgen.config import FastGenConfig

    names = [n for n, f in FastGenConfig.developer_fields().items()
             if f.type in (bool, "bool") and f.default and n != "log_fallbacks"]
    out = [("fastgen-bitwise", ("--fastgen-bitwise",))]
    out += [(f"fastgen no-{n.replace('_', '-')}", ("--fastgen-disable", n)) for n in sorted(names)]
    out.append(("fastgen decode-workers=1", ("--fastgen-decode-workers", "1")))
    out.append(("fastgen ngram-blocker=stock", ("--fastgen-disable", "ngram_blocker")))
    return out


def grid_notes(g: Grid, counts: Dict[int, int], quick: bool) -> List[str]:
    """The limits of the grid itself (the report's "Not covered" list, after any skips)."""
    notes = []
    if quick:
        notes.append("--quick: es-en only, beam 5, batch 8 on 16 verses, one round per system; "
                     "figures are a smoke test, not a benchmark")
    ab = g.ablation
    return notes + [
        f"Ablations run at one representative cell per model (beam {ab['beam']}, batch "
        f"{ab['batch']}, --no-repeat-ngram-size {ab['ngram']}, so that the n-gram blocker "
        "switch is exercised too) to fit the time budget; the switches are every on/off optimization "
        "`--fastgen-disable` takes (log lines aside), plus `--fastgen-bitwise`, `--fastgen-decode-workers 1` "
        "and `--fastgen-disable ngram_blocker` (stock's blocker).",
        "Cells use the first " + ", ".join(f"{counts[b]} (batch {b})" for b in g.batches) + " test verses rather "
        "than all 1,000, to fit 30 minutes on 2 cores; BLEU therefore differs from the README's 1,000-verse figure "
        "and is noisy on the small cells.",
        "The scaling study runs on " + ", ".join(g.scale_models) + " only, stock vs fastgen (no CTranslate2).",
        "Peak GPU memory is only measured with --device cuda (torch.cuda.max_memory_allocated of the fairseq process; "
        "CTranslate2 has no equivalent call and is left blank).",
    ]
