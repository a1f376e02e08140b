"""The stock-vs-plugin harness detects planted differences and accepts lossless ones."""
from fairseq_fastgen.compare import compare_outputs

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
