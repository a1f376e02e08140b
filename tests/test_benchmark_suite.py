"""The benchmark suite (benchmarks/suite/): its grid, its report rendered from a small results
dict, and `python benchmarks/suite --quick` end to end (< 5 min).

The end-to-end test checks that the report and plots are produced and that fastgen (all on,
and every ablation) is lossless vs stock fairseq in every cell of the run.  The report tests
compare with tests/data/suite_report_*.md, rendered from the same dicts by the suite's
earlier single-file version (benchmarks/suite.py at a79ea66): a change of the report's text
shows up here.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fairseq_fastgen.compare import Run

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"

# the package only: benchmarks/ itself stays off sys.path for the rest of the session
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    from suite import grid, report
    from suite.runners import ForkServerRunner, ProcessRunner, fairseq_runner, precise_gen_time
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


# ---------------------------------------------------------------- grid

def _specs(mode, ablations=(("fastgen x", ("--fastgen-no-x",)),), variants=(), models=()):
    g = grid.select_grid(mode, models)
    return g, grid.grid_cells(g, grid.SENTENCES[mode], grid.Repeats.of(g), list(ablations), list(variants))


def test_full_grid_cells_in_order():
    g, cells = _specs("full")
    assert len(cells) == 2 * 2 * 2 * 4  # models x beams x ngrams x batches, fp32 only on CPU
    assert [(c.model, c.beam, c.ngram, c.batch) for c in cells[:5]] == [
        ("es-en", 1, 0, 1), ("es-en", 1, 0, 8), ("es-en", 1, 0, 32), ("es-en", 1, 0, 128), ("es-en", 1, 3, 1)]
    assert {c.split for c in cells} == {"n8", "n32", "n128", "n512"}
    assert all(c.split == f"n{grid.SENTENCES['full'][c.batch]}" for c in cells)
    abl = [c for c in cells if c.ablation]
    assert [(c.model, c.beam, c.batch, c.ngram) for c in abl] == [("es-en", 5, 32, 3), ("kjv-web", 5, 32, 3)]
    assert all(c.tag.startswith("ablation ") and ("fastgen x", ("--fastgen-no-x",)) in c.systems for c in abl)
    assert all(c.tag.startswith("grid ") and c.systems == (("fastgen", ()),) for c in cells if not c.ablation)
    assert cells[0].tag == "grid es-en beam1 batch1 ngram0 fp32"
    # --no-repeat-ngram-size cells other than the ablation cell take repeats_ngram rounds
    r = grid.Repeats(grid=3, ngram=1, ct2=1, scaling=1)
    cells = grid.grid_cells(g, grid.SENTENCES["full"], r, [("fastgen x", ("--fastgen-no-x",))], [])
    assert {c.repeats for c in cells if c.ngram and not c.ablation} == {1}
    assert {c.repeats for c in cells if c.ablation or not c.ngram} == {3}


def test_quick_grid_and_no_ablations():
    g, cells = _specs("quick")
    assert [c.tag for c in cells] == ["grid es-en beam5 batch8 ngram0 fp32", "ablation es-en beam5 batch8 ngram3 fp32"]
    _, cells = _specs("quick", ablations=())
    assert not any(c.ablation for c in cells)  # --no-ablation: no cell runs the switches
    g = grid.select_grid("quick", device="cuda")
    assert g.precisions == ("fp32", "fp16")
    cells = grid.grid_cells(g, grid.SENTENCES["quick"], grid.Repeats.of(g), [("fastgen x", ("--x",))], [])
    assert [c.ablation for c in cells] == [False, True, False, False]  # ablations in fp32 only


def test_variants_and_grid_copy():
    v = [grid.Variant.parse("beam1:aggr=--fastgen-aggressive on"), grid.Variant.parse("fastgen w1=--a 1")]
    assert v[0] == grid.Variant("fastgen aggr", ("--fastgen-aggressive", "on"), True)
    assert v[1] == grid.Variant("fastgen w1", ("--a", "1"), False)
    _, cells = _specs("full", variants=v, models=["es-en"])
    for c in cells:
        names = [n for n, _ in c.systems]
        assert ("fastgen aggr" in names) == (c.beam == 1) and "fastgen w1" in names
    with pytest.raises(Exception):
        grid.Variant.parse("no-equals-sign")
    cell = dict(tag="ablation es-en beam5 batch8 ngram3 fp32", systems={
        n: {} for n in ("stock", "fastgen", "fastgen x", "fastgen w1", "ct2-int8")})
    copy = grid.as_grid_cell(cell, ["fastgen w1"])
    assert copy["tag"] == "grid es-en beam5 batch8 ngram3 fp32" and copy["copy"] is True
    assert list(copy["systems"]) == ["stock", "fastgen", "fastgen w1", "ct2-int8"]


def test_repeats():
    g = grid.GRID["full"]
    assert grid.Repeats.of(g) == grid.Repeats(grid=2, ngram=2, ct2=1, scaling=2)
    assert grid.Repeats.of(g, 3) == grid.Repeats(grid=3, ngram=3, ct2=1, scaling=3)
    assert grid.Repeats.of(grid.GRID["quick"]) == grid.Repeats(grid=1, ngram=1, ct2=1, scaling=1)


# ---------------------------------------------------------------- runners (no process started)

def test_precise_gen_time_from_the_rates():
    err = "Translated 16 sentences (412 tokens) in 1.2s (13.41 sentences/s, 345.30 tokens/s)\n"
    r = precise_gen_time(Run.parse("", err, 3.0, 0))
    assert r.gen_time == 412 / 345.30 and r.sentences == 16 and r.tokens == 412
    r = precise_gen_time(Run.parse("", "Translated 16 sentences (412 tokens) in 1.2s\n", 3.0, 0))
    assert r.gen_time == 1.2  # no rates printed: fairseq's own seconds


def test_runner_choice(tmp_path):
    assert isinstance(fairseq_runner("cpu", 2, tmp_path, True), ForkServerRunner)
    assert isinstance(fairseq_runner("cpu", 2, tmp_path, False), ProcessRunner)
    gpu = fairseq_runner("cuda", 2, tmp_path, True)  # CUDA is not fork-safe: fresh processes
    assert isinstance(gpu, ProcessRunner) and gpu.threads is None and gpu.program[:2] == (sys.executable, "-c")
    with fairseq_runner("cpu", 2, tmp_path / "runs", True):  # servers start on first use only
        assert (tmp_path / "runs").is_dir() and not list((tmp_path / "runs").iterdir())


# ---------------------------------------------------------------- report

def _row(sent_per_s, speedup, **kw):
    return dict(dict(gen_s_min=1.0, gen_s_median=1.1, wall_s_min=9.5, sentences=16, tokens=400, peak_rss_mb=812.4,
                     peak_gpu_mb=None, repeats=2, gen_s_all=[1.0, 1.2], sent_per_s=sent_per_s, tok_per_s=25 * sent_per_s,
                     x_limit=12.3, bleu=31.25, speedup=speedup), **kw)


def small_results(device="cpu"):
    """A results.json dict of two grid cells, an ablation cell and its grid copy, and scaling."""
    prec = "fp16" if device == "cuda" else "fp32"
    lossless = dict(lossless=True, identical=False, max_score_diff=1e-6, differences=[], near_ties=0, reference="stock")
    ct2 = dict(agreement=dict(exact=0.75, words=0.9), reference="stock")
    grid0 = dict(model="es-en", split="n16", sentences=16, beam=5, batch=8, ngram=0, precision=prec,
                 tag=f"grid es-en beam5 batch8 ngram0 {prec}", flops=1e9, limit_s=0.05, systems={
                     "stock": _row(10.0, 1.0, peak_gpu_mb=300.0 if device == "cuda" else None),
                     "fastgen": _row(21.5, 2.15, **lossless),
                     "ct2-int8": _row(30.0, 3.0, bleu=None, **ct2), "ct2-float32": _row(25.0, 2.5, **ct2)})
    abl = dict(grid0, ngram=3, tag=f"ablation es-en beam5 batch8 ngram3 {prec}", systems={
        "stock": _row(9.0, 1.0, differs_from_fixed=True),
        "fastgen": _row(18.0, 2.0, **dict(lossless, reference="stock, #4709 fixed", differs_from_shipped_stock=True)),
        "fastgen no-kv-cache": _row(12.0, 1.33, **dict(lossless, lossless=False, differences=["H-1: x"])),
        "fastgen-bitwise": _row(15.0, 1.67, **dict(lossless, identical=True)),
        "ct2-int8": _row(30.0, 3.33, **dict(ct2, reference="stock, #4709 fixed"))})
    copy = dict(grid.as_grid_cell(abl, []))
    scaling = [dict(kind=k, x=x, model="es-en", beam=5, batch=4, sentences=4, lossless=x != 64, precision=prec,
                    stock_s_per_sent=0.03 * x / 16, fastgen_s_per_sent=0.02 * x / 16, stock_ms_per_token=1.71,
                    fastgen_ms_per_token=1.57, stock_tokens=70, fastgen_tokens=70, speedup=1.5)
               for k, x in (("length", 16), ("length", 64), ("beam", 1))]
    machine = dict(date="2026-12-01 10:34 UTC", python="3.11.7", torch="2.13.0+cpu", threads=2, cores=2,
                   device=device, cpu="Intel(R) Xeon(R) Processor", **{"fairseq-fixed": "0.12.3.1"})
    if device == "cuda":
        machine.update(gpu="NVIDIA H200")
    else:
        machine.update(ctranslate2="4.8.5")
    return dict(machine=machine, gemm={prec: dict(shapes={"d x d (attention projections)": 312.4,
                                                          "d x vocab (output projection)": 197.3}, m=2048,
                                                  peak_gflops=312.4)},
                dims={}, cells=[grid0, abl, copy], scaling=scaling if device == "cpu" else [],
                config=dict(mode="quick", fork_server=device == "cpu", repeats=2, repeats_ct2=1, extra_systems=[],
                            repeats_ngram=1, scale_repeats=2, sentences={"8": 16}, grid={}),
                not_covered=["first note", "second note"], elapsed_s=123.4)


def _render(res, files, tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    report.write_report(res, {k: tmp_path / "figs" / v for k, v in files.items()}, path,
                        ["python", "benchmarks/suite", "--quick"])
    return path.read_text()


def test_report_from_small_results_cpu(tmp_path):
    files = dict(throughput="throughput_vs_batch.png", ablation="ablation.png", scaling="scaling.png")
    text = _render(small_results("cpu"), files, tmp_path)
    assert text == (DATA / "suite_report_cpu.md").read_text()
    for heading in ("## Machine", "## Headline (README snippet)", "## How it was measured", "### Physical limit",
                    "## Results", "## Ablation (each optimization off alone)", "## Scaling", "## Not covered"):
        assert f"\n{heading}\n" in text
    assert "![ablation](figs/ablation.png)" in text and "**NOT lossless**" in text and "| **no** |" in text
    assert "forked from a server" in text and "median 20%" in text
    assert text.endswith("* second note\n") and "\n\n\n" not in text


def test_report_from_small_results_cuda_without_figures(tmp_path):
    res = small_results("cuda")
    for c in res["cells"]:
        for r in c["systems"].values():
            r["gen_s_all"] = r["gen_s_all"][:1]
    text = _render(res, {}, tmp_path)
    assert text == (DATA / "suite_report_cuda.md").read_text()
    assert "![" not in text and "## Scaling" not in text and "\n\n\n" not in text
    assert "; GPU: NVIDIA H200" in text and "(GPU 300)" in text and "fastgen fp16" in text
    assert "Run-to-run spread: not measured" in text and "forked from a server" not in text
    assert "ctranslate2 not installed" in text


def test_headline():
    res = small_results()
    h = report.headline(res)
    assert h.startswith("Generation-time speed-up over stock `fairseq-generate`")
    assert "Intel(R) Xeon(R) Processor, 2 threads, 2026-12-01 10:34 UTC" in h and "in every cell" in h
    assert "| es-en | 5 | fp32 | fastgen | 2.15x |" in h and "| es-en | 5 | fp32 | ct2-float32 | 2.50x |" in h
    res["cells"][1]["systems"]["fastgen"]["lossless"] = False
    assert "in NOT every cell" in report.headline(res)
    assert report.headline(dict(res, cells=[])) == "(no grid cells)"


def test_render_drops_absent_optional_paragraphs(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "TEMPLATES", tmp_path)
    (tmp_path / "t.tmpl").write_text("# $title\n\n$figure\n\ntext $x\n\n$tail\n")
    assert report.render("t.tmpl", title="A", figure=None, x="1", tail=None) == "# A\n\ntext 1"
    assert report.render("t.tmpl", title="A", figure="F", x="1", tail="T") == "# A\n\nF\n\ntext 1\n\nT"
    with pytest.raises(KeyError):
        report.render("t.tmpl", title="A", figure=None, x=None, tail=None)  # x is inline: not optional


# ---------------------------------------------------------------- end to end

@pytest.mark.long  # the whole quick suite; grid, report and measure have unit tests here
def test_suite_quick(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "suite"
    # one thread: robust on a shared CI runner (the smoke test checks outputs, not speed)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite"), "--quick", "--threads", "1",
                        "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report_text = (out / "BENCHMARKS.md").read_text()
    assert "## Results" in report_text and "## Headline" in report_text
    for png in ("throughput_vs_batch.png", "ablation.png", "scaling.png"):
        assert (out / png).stat().st_size > 1000, png
    res = json.loads((out / "results.json").read_text())
    assert res["cells"]
    fastgen_rows = 0
    for cell in res["cells"]:
        assert "stock" in cell["systems"]
        for name, row in cell["systems"].items():
            assert row["sent_per_s"] and row["sent_per_s"] > 0, (cell["tag"], name)
            if name.startswith("fastgen"):
                fastgen_rows += 1
                assert row["lossless"], (cell["tag"], name, row.get("differences"))
    assert fastgen_rows >= 3  # all on + ablation switches
    assert any(n.startswith("fastgen ") for c in res["cells"] for n in c["systems"])  # ablations ran
    assert res["scaling"] and all(r["lossless"] for r in res["scaling"])
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        return
    assert any(n.startswith("ct2-") for c in res["cells"] for n in c["systems"])


def test_fixed_reference_on_cuda_only_without_fairseqs_cuda_blocker(monkeypatch):
    """On CUDA stock bans n-grams correctly only with fairseq's CUDA extension; without it
    (the device kit's fairseq wheel) the suite must compare against #4709-fixed stock."""
    import importlib.util

    from benchmarks.suite.measure import stock_blocker_is_buggy

    assert stock_blocker_is_buggy("cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert not stock_blocker_is_buggy("cuda") and stock_blocker_is_buggy("cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert stock_blocker_is_buggy("cuda")
