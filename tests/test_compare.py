"""The stock-vs-plugin harness detects planted differences and accepts lossless ones; its
commands, environments and the parse of fairseq's summary line."""
import os
import sys
from pathlib import Path

from fairseq_fastgen import compare
from fairseq_fastgen.compare import PLUGIN_DIR, Run, compare_outputs, generate_command, run_measured

BASE = """S-0\tuno dos
T-0\tone two
H-0\t-0.5123456789\tone two
D-0\t-0.5123456789\tone two
P-0\t-0.1000 -0.2000 -1.2370
Generate test with beam=5: BLEU4 = 12.34, 50.0/20.0/10.0/5.0 (BP=1.000, ratio=1.000, syslen=2, reflen=2)
"""


def test_identical():
    c = compare_outputs(BASE, BASE)
    assert c.identical and c.lossless and not c.differences


def test_score_within_tolerance_is_lossless_not_identical():
    other = BASE.replace("-0.5123456789", "-0.5123466789").replace("-0.2000", "-0.2001")
    c = compare_outputs(BASE, other)
    assert not c.identical and c.lossless
    assert 0 < c.max_score_diff <= 1e-4


def test_printed_positional_scores_two_roundings_apart_are_lossless():
    """4-decimal P values 2e-4 apart (two roundings of scores within 1e-4) pass, whatever
    binary rounding does to their float difference; 3e-4 apart does not."""
    base = BASE.replace("-1.2370", "-26.2598")
    assert abs(float("-26.2598") - float("-26.2600")) > 2e-4  # the float pitfall itself
    assert compare_outputs(base, base.replace("-26.2598", "-26.2600")).lossless
    assert not compare_outputs(base, base.replace("-26.2598", "-26.2601")).lossless


def test_planted_score_difference():
    c = compare_outputs(BASE, BASE.replace("D-0\t-0.5123456789", "D-0\t-0.5133456789"))
    assert not c.lossless and any(d.startswith("D-0") for d in c.differences)


def test_planted_token_difference_without_tie():
    c = compare_outputs(BASE, BASE.replace("\tone two\nD", "\tone three\nD"))
    assert not c.lossless


def test_token_difference_proven_near_tie_is_reported():
    other = BASE.replace("H-0\t-0.5123456789\tone two", "H-0\t-0.5123456789\tone too").replace(
        "D-0\t-0.5123456789\tone two", "D-0\t-0.5123456789\tone too")
    c = compare_outputs(BASE, other, rescore=lambda sid, a, b: (-0.51234, -0.51236))
    assert c.lossless and len(c.near_ties) == 1
    c = compare_outputs(BASE, other, rescore=lambda sid, a, b: (-0.5, -0.6))
    assert not c.lossless


def test_planted_bleu_difference():
    c = compare_outputs(BASE, BASE.replace("BLEU4 = 12.34", "BLEU4 = 12.35"))
    assert not c.lossless


def test_missing_line():
    c = compare_outputs(BASE, BASE.replace("T-0\tone two\n", ""))
    assert not c.lossless


def test_source_text_difference():
    c = compare_outputs(BASE, BASE.replace("S-0\tuno dos", "S-0\tuno tres"))
    assert not c.lossless


def test_generate_command_stock_and_plugin(monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.setattr(compare, "stock_needs_route_around", lambda: False)
    exe = str(Path(sys.executable).parent / "fairseq-generate")
    cmd, env = generate_command(["DATA", "--beam", "5"], False, threads=3)
    assert cmd == [exe, "DATA", "--beam", "5"]
    assert env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1" and env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    cmd, env = generate_command(["DATA"], True, ["--fastgen-disable", "vocab_pad"], env={"PYTHONWARNINGS": "default"})
    assert cmd == [exe, "DATA", "--user-dir", PLUGIN_DIR, "--fastgen-disable", "vocab_pad"]
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in env and env["PYTHONWARNINGS"] == "default"
    assert "OMP_NUM_THREADS" not in env or env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS")


def test_generate_command_program_is_not_routed_around(monkeypatch):
    monkeypatch.setattr(compare, "stock_needs_route_around", lambda: True)  # stack B
    cmd, _ = generate_command(["DATA"], False, entry="fairseq-interactive")
    assert cmd[1:] == ["DATA", "--user-dir", PLUGIN_DIR, "--fastgen-off"]
    assert cmd[0].endswith("fairseq-interactive")
    cmd, env = generate_command(["DATA"], False, program=["python", "launch.py"])
    assert cmd == ["python", "launch.py", "DATA"] and env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"
    cmd, _ = generate_command(["DATA"], True, ["--x"], program=["python", "launch.py"])
    assert cmd == ["python", "launch.py", "DATA", "--user-dir", PLUGIN_DIR, "--x"]


def test_translated_line():
    err = ("INFO | fairseq_cli.generate | NOTE: hypothesis and token scores are output in base 2\n"
           "INFO | fairseq_cli.generate | Translated 1,000 sentences (28,467 tokens) in 12.3s "
           "(81.30 sentences/s, 2314.40 tokens/s)\n")
    r = Run.parse("out", err, 20.0, 0, 512.0)
    assert (r.sentences, r.tokens, r.gen_time, r.wall, r.returncode, r.peak_rss_mb) == (1000, 28467, 12.3, 20.0, 0, 512.0)
    m = compare.TRANSLATED.search(err)
    assert m["sent_per_s"] == "81.30" and m["tok_per_s"] == "2314.40"
    m = compare.TRANSLATED.search("Translated 8 sentences (90 tokens) in 0.4s")
    assert m["seconds"] == "0.4" and m["tok_per_s"] is None
    r = Run.parse("", "no summary", 1.0, 1)
    assert r.gen_time is None and r.sentences is None and r.tokens is None


def test_run_measured():
    code = "import sys; sys.stdout.write(sys.stdin.read().upper()); sys.stderr.write('e'); sys.exit(3)"
    out, err, rc, rss = run_measured([sys.executable, "-c", code], dict(os.environ), "abc")
    assert (out, err, rc) == ("ABC", "e", 3) and rss > 1


def test_score_tolerance_is_two_float32_units_past_1024():
    """1e-4 below |1,024|; past it, two units in the last place (one unit is 1.2e-4 there),
    so a long hypothesis' score rounded once otherwise is lossless, and two units more is not."""
    assert compare.score_tolerance(-5.0) == compare.SCORE_TOL
    assert compare.score_tolerance(float("-inf")) == compare.SCORE_TOL
    tol = compare.score_tolerance(-1198.1165771484375)
    assert tol == 2 ** -12
    a = "-1198.1165771484375\tx"
    assert compare._close("H", a, "-1198.11669921875\tx")[0]  # one unit apart
    assert not compare._close("H", a, "-1198.1169433594\tx")[0]  # three units apart
