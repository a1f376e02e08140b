"""Smoke test of the benchmark suite: `benchmarks/suite.py --quick` end to end (< 5 min).

Checks that the report and plots are produced and that fastgen (all on, and every ablation)
is lossless vs stock fairseq in every cell of the run.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_suite_quick(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "suite"
    # one thread: robust on a shared CI runner (the smoke test checks outputs, not speed)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--quick", "--threads", "1",
                        "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = (out / "BENCHMARKS.md").read_text()
    assert "## Results" in report and "## Headline" in report
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
