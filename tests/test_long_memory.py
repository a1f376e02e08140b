"""benchmarks/long_memory.py: the repeated data set, the figures it derives from samples,
and ``--tiny`` end to end (stock and plugin sampled, a report with peak and slope); and the
pipeline pool's fix it led to (objects frozen out of the collector while workers live)."""
import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "long_memory.py"

# the script's own module, imported without running it (benchmarks/ stays off sys.path)
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import long_memory as lm
finally:
    while str(ROOT / "benchmarks") in sys.path:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_dataset_repeats_the_test_set(tmp_path):
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    data = lm.build_dataset(2345, tmp_path)
    base = MMapIndexedDataset(str(lm.BUNDLE / "test.es-en.es"))
    for lang in ("es", "en"):
        orig = MMapIndexedDataset(str(lm.BUNDLE / f"test.es-en.{lang}"))
        rep = MMapIndexedDataset(str(data / f"test.es-en.{lang}"))
        assert len(rep) == 2345
        for i in (0, 999, 1000, 1999, 2000, 2344):
            assert rep[i].tolist() == orig[i % len(orig)].tolist(), (lang, i)
    assert len(base) == 1000
    assert (data / "dict.es.txt").read_text() == (lm.BUNDLE / "dict.es.txt").read_text()
    assert lm.build_dataset(2345, tmp_path) == data  # cached


def test_line_counter_counts_whole_hypothesis_lines(tmp_path):
    f = tmp_path / "out.txt"
    c = lm.LineCounter(f)
    assert c.update() == 0  # not written yet
    f.write_bytes(b"S-1\tx\nH-1\t-0.1\ty\nD-1\t-0.1\ty\nH-")
    assert c.update() == 1  # the cut line waits for its end
    with open(f, "ab") as h:
        h.write(b"2\t-0.2\tz\nP-2\t-0.2\nH-3\t0\tw\n")
    assert c.update() == 3


def _samples(pss_of_done, n, per_s=10.0):
    return [dict(t=i, done=min(n, int(i * per_s)), pss=pss_of_done(min(n, int(i * per_s))))
            for i in range(int(n / per_s) + 5)]


def test_slope_is_per_10k_sentences_over_the_second_half():
    n = 1000
    # 0.5 MB per 100 sentences in the second half = 50 MB / 10k; flat warm-up before it
    s = _samples(lambda d: 100 + max(0, d - 500) * 0.005, n)
    s[-1]["pss"] = 0.0  # the exit (after the last sentence) is not part of the slope
    assert lm.slope_per_10k(s, n) == pytest.approx(50.0, rel=1e-6)
    flat = _samples(lambda d: 300.0, n)
    assert lm.slope_per_10k(flat, n) == pytest.approx(0.0, abs=1e-9)
    assert lm.slope_per_10k(flat[:3], n) is None  # no sample in the second half
    # output in two bursts (a held batch): the second half in time of the writing
    burst = [dict(t=t, done=d, pss=100.0 + t) for t, d in
             [(0, 0), (1, 0), (2, 200), (3, 200), (4, 200), (5, 800), (6, 800), (7, 1000), (8, 1000)]]
    # t 5..7: 1 MB/s while 200 sentences come in 2 s: 100 MB per 10k
    assert lm.slope_per_10k(burst, n) == pytest.approx(100.0, rel=1e-6)
    assert lm.at_fraction(s, n, 0.9) == pytest.approx(100 + 400 * 0.005)


@pytest.mark.long  # the script end to end; its arithmetic: the unit tests above
def test_tiny_end_to_end(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    p = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--stock-threads", "1",
                        "--out", str(out), "--work", str(work)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads((out / "long_memory_tiny.json").read_text())
    assert {(r["system"], r["beam"]) for r in res["runs"]} == {("stock", 1), ("plugin", 1)}
    for r in res["runs"]:
        s = r["summary"]
        assert s["exit"] == 0 and s["sentences_written"] == res["sentences"] == 256
        assert s["samples"] >= 5 and len(r["series"]) >= 5
        assert s["peak_pss_mb"] > 50  # a python process with torch and the model
        assert isinstance(s["slope_mb_per_10k"], float)
        assert all(v is not None and 0 < v <= s["peak_pss_mb"] for v in s["pss_10_50_90_mb"])
        assert s["processes_max"] >= 1 and "fairseq-generat" in s["per_process"]
        assert any(ln.startswith("Generate test with beam=1: BLEU") for ln in r["log"])
    plugin = next(r for r in res["runs"] if r["system"] == "plugin")["summary"]
    assert any(k.startswith("fastgen-") for k in plugin["per_process"])  # its workers seen
    md = (out / "long_memory_tiny.md").read_text()
    assert "| 1 | stock |" in md and "| 1 | plugin |" in md
    assert not list(work.glob("out-*"))  # generated text removed after each run


def test_pool_keeps_objects_out_of_the_collector_while_its_workers_live():
    """Collections in a forked worker (and in the main process) would copy the pages of
    every object they visit; the pool freezes them for its workers' lifetime."""
    from fairseq_fastgen.tasks.pool import Pool

    assert gc.get_freeze_count() == 0
    pool = Pool(None, 1, lambda *a: None)
    try:
        assert gc.get_freeze_count() > 1000
    finally:
        pool.close()
    assert gc.get_freeze_count() == 0
    gc.freeze()  # someone else's freeze is left alone
    try:
        pool = Pool(None, 1, lambda *a: None)
        pool.close()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
