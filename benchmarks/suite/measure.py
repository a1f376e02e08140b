"""Measuring one cell: every system interleaved over the rounds, figures summarized against
stock (speed-up, physical limit, BLEU), fastgen checked lossless against its reference; and
the scaling study (stock vs fastgen over source length and beam size)."""
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from fairseq_fastgen.compare import compare_outputs, parse_output
from fairseq_fastgen.rescore import model_rescorer

from .grid import BUNDLE, CellSpec, Grid, Repeats
from .machine import matmul_flops
from .progress import log
from .runners import Ct2Runner, FairseqRunner, fairseq_args

FIXED = "stock, #4709 fixed"


@dataclass
class SuiteContext:
    """What every measurement of one suite run shares."""
    work: Path  # OUT/work: binarized inputs, converted CTranslate2 models, run scratch
    device: str
    threads: int
    repeats: Repeats
    runner: FairseqRunner
    ct2: Optional[Ct2Runner]  # None: CTranslate2 not measured
    ct2_types: Dict[str, List[str]]  # compute types by precision
    ct2_dirs: Dict[Tuple[str, str], Path]  # converted model by (model, quantization)
    data: Dict[str, Path]  # binarized data dir by model
    meta: Dict[str, Dict[str, dict]]  # by model and split: source lengths (and pieces)
    dims: Dict[str, dict]  # model shapes by model
    gemm: Dict[str, dict]  # GEMM peak by precision
    rescorers: Dict[str, Callable] = field(default_factory=dict)  # by model, built on first need


def hyps_refs(stdout: str):
    """{id: detokenized hypothesis}, {id: reference}, {id: hypothesis tokens incl. EOS}."""
    recs, _ = parse_output(stdout)
    hyps = {sid: v[0].split("\t", 1)[1] for (k, sid), v in recs.items() if k == "D"}
    refs = {sid: v[0] for (k, sid), v in recs.items() if k == "T"}
    plen = {sid: len(v[0].split()) for (k, sid), v in recs.items() if k == "P"}
    return hyps, refs, plen


def bleu(hyps: Dict[int, str], refs: Dict[int, str]) -> Optional[float]:
    import sacrebleu

    ids = sorted(refs)
    if not ids:
        return None
    return round(sacrebleu.corpus_bleu([hyps.get(i, "") for i in ids], [[refs[i] for i in ids]]).score, 2)


def agreement(stock: Dict[int, str], other: Dict[int, str]) -> Dict[str, float]:
    """Share of sentences equal to stock's, and share of word positions that match."""
    ids = sorted(stock)
    exact = sum(stock[i] == other.get(i) for i in ids)
    words = match = 0
    for i in ids:
        a, b = stock[i].split(), other.get(i, "").split()
        words += max(len(a), len(b))
        match += sum(x == y for x, y in zip(a, b))
    return dict(exact=exact / max(1, len(ids)), words=match / max(1, words))


def summarize(times):
    times = [t for t in times if t is not None]
    return (min(times), statistics.median(times)) if times else (None, None)


def measure_cell(ctx: SuiteContext, spec: CellSpec) -> dict:
    """One cell: every system interleaved over the repeats (order rotated each round)."""
    a = fairseq_args(ctx.data[spec.model], spec.model, spec.split, spec.beam, spec.batch, spec.ngram, ctx.device,
                     spec.precision)
    systems = [("stock", None), *spec.systems]
    if ctx.ct2 is not None:
        systems += [(f"ct2-{ct}", ct) for ct in ctx.ct2_types[spec.precision]]
    runs = _interleaved(ctx, spec, a, systems)
    stock_out = runs["stock"][0]["stdout"]
    fixed_out = _fixed_reference(ctx, spec, a) if spec.ngram and stock_blocker_is_buggy(ctx.device) else None
    s_hyps, refs, plen = hyps_refs(stock_out)
    src_lens = ctx.meta[spec.model][spec.split]["src_lens"]
    ids = sorted(s_hyps)
    flops = matmul_flops(ctx.dims[spec.model], [src_lens[i] for i in ids], [plen[i] for i in ids], spec.beam)
    limit_s = flops / (ctx.gemm[spec.precision]["peak_gflops"] * 1e9)
    cell = dict(model=spec.model, split=spec.split, sentences=len(ids), beam=spec.beam, batch=spec.batch,
                ngram=spec.ngram, precision=spec.precision, tag=spec.tag, flops=flops, limit_s=limit_s, systems={})
    ref_hyps = hyps_refs(fixed_out)[0] if fixed_out else s_hyps
    for name, _ in systems:
        row = _timing_row(runs[name], limit_s)
        if name.startswith("ct2-"):
            texts = dict(enumerate(runs[name][0]["texts"]))
            row["bleu"] = bleu(texts, refs)
            row["agreement"] = agreement(ref_hyps, texts)
            row["reference"] = FIXED if fixed_out else "stock"
        else:
            out = runs[name][0]["stdout"]
            row["bleu"] = bleu(hyps_refs(out)[0], refs)
            if name != "stock":
                row.update(_lossless(ctx, spec.model, a, stock_out, fixed_out, runs[name][0]["flags"], out))
        if fixed_out and name == "stock":
            row["differs_from_fixed"] = not compare_outputs(fixed_out, stock_out).lossless
        cell["systems"][name] = row
    st = cell["systems"]["stock"]["gen_s_min"]
    for name, row in cell["systems"].items():
        row["speedup"] = st / row["gen_s_min"] if row["gen_s_min"] else None
    brief = ", ".join(f"{n} {r['sent_per_s']:.1f}/s ({r['wall_s_min']:.0f}s)" + (" LOSSY" if r.get("lossless") is False else "")
                      for n, r in cell["systems"].items() if r["sent_per_s"])
    log(f"{spec.tag}: {brief}")
    return cell


def _interleaved(ctx: SuiteContext, spec: CellSpec, a: List[str], systems) -> Dict[str, List[dict]]:
    """{system: [one dict per round]}; CTranslate2 stops after ctx.repeats.ct2 rounds."""
    runs = {name: [] for name, _ in systems}
    for rep in range(spec.repeats):
        k = rep % len(systems)
        for name, flags in systems[k:] + systems[:k]:
            if name.startswith("ct2-") and len(runs[name]) >= ctx.repeats.ct2:
                continue
            runs[name].append(_run_system(ctx, spec, a, name, flags))
    return runs


def _run_system(ctx: SuiteContext, spec: CellSpec, a: List[str], name: str, flags) -> dict:
    if name.startswith("ct2-"):
        md = ctx.ct2_dirs[(spec.model, "int8" if flags.startswith("int8") else "float32")]
        return ctx.ct2.translate(md, flags, ctx.meta[spec.model][spec.split]["src_pieces"], spec.beam, spec.batch,
                                 spec.ngram)
    r, gpu = ctx.runner.generate(a, name != "stock", flags or [])
    if r.returncode != 0:
        raise RuntimeError(f"{name} failed ({r.returncode}) on {spec.tag}:\n{r.stderr[-3000:]}")
    return dict(gen_time=r.gen_time, wall=r.wall, sentences=r.sentences, tokens=r.tokens,
                peak_rss_mb=r.peak_rss_mb, peak_gpu_mb=gpu, stdout=r.stdout, flags=flags or [])


def stock_blocker_is_buggy(device: str) -> bool:
    """Whether stock's n-gram ban is its pure-Python one, which bans nothing (#4709): always
    on CPU, and on CUDA when fairseq was built without its CUDA extension (the device kit's
    wheel is)."""
    import importlib.util

    return device == "cpu" or importlib.util.find_spec("fairseq.ngram_repeat_block_cuda") is None


def _fixed_reference(ctx: SuiteContext, spec: CellSpec, a: List[str]) -> str:
    """The lossless reference for fastgen with --no-repeat-ngram-size on CPU (runners.FIXED_NGRAM_PROGRAM)."""
    fr = ctx.runner.fixed_reference(a)
    if fr.returncode != 0:
        raise RuntimeError(f"stock with #4709 fixed failed on {spec.tag}:\n{fr.stderr[-3000:]}")
    return fr.stdout


def _timing_row(rs: Sequence[dict], limit_s: float) -> dict:
    tmin, tmed = summarize([r["gen_time"] for r in rs])
    row = dict(gen_s_min=tmin, gen_s_median=tmed, wall_s_min=min(r["wall"] for r in rs),
               sentences=rs[0]["sentences"], tokens=rs[0]["tokens"],
               peak_rss_mb=max(r["peak_rss_mb"] for r in rs),
               peak_gpu_mb=max((r.get("peak_gpu_mb") or 0) for r in rs) or None,
               repeats=len(rs), gen_s_all=[r["gen_time"] for r in rs])
    if rs[0].get("threads"):  # CTranslate2: its fastest thread setting (ct2_worker.py)
        row["ct2_threads"] = sorted({r["threads"] for r in rs})
    row["sent_per_s"] = row["sentences"] / tmin if tmin else None
    row["tok_per_s"] = row["tokens"] / tmin if tmin else None
    row["x_limit"] = tmin / limit_s if tmin else None
    return row


def _lossless(ctx: SuiteContext, model: str, a: List[str], stock_out: str, fixed_out: Optional[str],
              flags: Sequence[str], out: str) -> dict:
    """A fastgen system's output against its reference: #4709-fixed stock where there is one,
    except for --fastgen-disable ngram_blocker (stock's own blocker), stock as shipped otherwise."""
    stock_blocker = ("--fastgen-disable", "ngram_blocker") in zip(flags, flags[1:])
    ref = fixed_out if fixed_out and not stock_blocker else stock_out
    c = compare_outputs(ref, out)
    if not c.lossless and all(d.startswith(("H-", "D-", "P-", "A-")) for d in c.differences):
        c = compare_outputs(ref, out, _rescorer(ctx, model, a))
    row = dict(lossless=c.lossless, identical=c.identical, max_score_diff=c.max_score_diff,
               differences=c.differences[:5], near_ties=len(c.near_ties),
               reference=FIXED if ref is fixed_out else "stock")
    if fixed_out and ref is fixed_out:
        row["differs_from_shipped_stock"] = not compare_outputs(stock_out, out).lossless
    return row


def _rescorer(ctx: SuiteContext, model: str, args: List[str]) -> Callable:
    if model not in ctx.rescorers:
        keep = []
        for flag in ("--source-lang", "--target-lang", "--gen-subset", "--post-process"):
            i = args.index(flag)
            keep += args[i:i + 2]
        ctx.rescorers[model] = model_rescorer(args[0], str(BUNDLE / model / "checkpoint.pt"), keep)
    return ctx.rescorers[model]


def scaling(ctx: SuiteContext, model: str, g: Grid, precision: str) -> List[dict]:
    """Stock vs fastgen over source length (synthetic sources) and over beam size."""
    rows = []
    ov = ["--model-overrides", "{'max_source_positions': 1024}"]
    for L in g.scale_lengths:
        rows.append(_scale_point(ctx, model, f"len{L}", 5, g.scale_batch, precision, ov, "length", L))
    split = f"n{g.scale_beam_n}"
    for beam in g.scale_beams:
        rows.append(_scale_point(ctx, model, split, beam, g.scale_beam_batch, precision, [], "beam", beam))
    return rows


def _scale_point(ctx: SuiteContext, model: str, split: str, beam: int, batch: int, precision: str,
                 extra: Sequence[str], kind: str, x: int) -> dict:
    a = fairseq_args(ctx.data[model], model, split, beam, batch, 0, ctx.device, precision, extra)
    res = {"stock": [], "fastgen": []}
    for rep in range(ctx.repeats.scaling):
        for name in (("stock", "fastgen") if rep % 2 == 0 else ("fastgen", "stock")):
            r, _ = ctx.runner.generate(a, name == "fastgen", [])
            if r.returncode != 0:
                raise RuntimeError(f"scaling {kind}={x} {name} failed:\n{r.stderr[-3000:]}")
            res[name].append(r)
    c = compare_outputs(res["stock"][0].stdout, res["fastgen"][0].stdout)
    row = dict(kind=kind, x=x, model=model, beam=beam, batch=batch, sentences=res["stock"][0].sentences,
               lossless=c.lossless, precision=precision)
    for name, rs in res.items():
        tmin, tmed = summarize([r.gen_time for r in rs])
        row[f"{name}_s_per_sent"] = tmin / rs[0].sentences
        row[f"{name}_ms_per_token"] = 1000 * tmin / rs[0].tokens
        row[f"{name}_tokens"] = rs[0].tokens
    row["speedup"] = row["stock_s_per_sent"] / row["fastgen_s_per_sent"]
    log(f"scaling {model} {kind}={x}: stock {row['stock_s_per_sent']:.3f}s/sent, "
        f"fastgen {row['fastgen_s_per_sent']:.3f}s/sent, lossless {c.lossless}")
    return row
