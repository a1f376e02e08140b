"""The device kit (benchmarks/device_check.sh, benchmarks/device/) on CPU, so that it cannot
rot between GPU lendings: the whole script as a dry run (``--device cpu --tiny``, the same
parts and code path), and the pieces whose failure the dry run would not show.

The dry run installs a wheel folder holding this project's wheel only, built here for the
running python (build_wheels.py --only-project); fairseq-fixed comes from the running
environment through the same .pth mechanism that exposes the device's torch (building
fairseq-fixed takes minutes: ``make device-wheels`` does that, for the device's Python 3.12).
The dry run takes about 2.5 minutes on an idle 2-core machine (process start-up dominates),
up to ~6 under heavy contention; its budget (660 s) leaves room for the latter.
"""
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "benchmarks" / "device"
sys.path.insert(0, str(DEVICE))

import build_wheels  # noqa: E402
import summarize  # noqa: E402

PARTS = ("install", "pytest", "generator", "real_sizes", "suite")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_kit")
    wheels, out = root / "wheels", root / "out"
    b = subprocess.run([sys.executable, str(DEVICE / "build_wheels.py"), "--python", sys.executable,
                        "--out", str(wheels), "--only-project"], capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stdout[-2000:] + b.stderr[-2000:]
    env = dict(os.environ, TMPDIR=str(root))
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_check.sh"), str(out), "--device", "cpu",
                        "--tiny", "--wheels", str(wheels), "--python", sys.executable, "--budget", "660"],
                       capture_output=True, text=True, timeout=720, env=env)
    return p, out, root


@pytest.mark.long  # every part of the kit, end to end (its pieces have unit tests here)
def test_dry_run_every_part_runs_and_its_results_parse(dry_run):
    p, out, root = dry_run
    log = (out / "device_check.log").read_text() if (out / "device_check.log").exists() else ""
    assert p.returncode == 0, p.stdout[-3000:] + log[-6000:]
    files = sorted(out.iterdir())
    assert len(files) <= 8 and all(f.is_file() and f.stat().st_size < 16 * 2**20 for f in files)
    s = json.loads((out / "summary.json").read_text())
    assert [q["name"] for q in s["parts"]] == list(PARTS)
    assert all(q["status"] == "ok" for q in s["parts"]), s["parts"]
    assert s["failed_parts"] == []
    # the installed wheel, not the checkout, is what install_check imported; torch stayed the env's
    inst = s["install"]
    assert inst["problems"] == [] and "site-packages" in inst["fairseq_fastgen_file"]
    assert not inst["fairseq_fastgen_file"].startswith(str(ROOT / "fairseq_fastgen"))
    import torch
    assert Path(inst["torch_file"]).resolve() == Path(torch.__file__).resolve()
    gen = json.loads((out / "generator.json").read_text())
    assert gen["cells"] and all(c["lossless"] for c in gen["cells"])
    junit = summarize.pytest_figures(out / "pytest.xml")
    assert junit["tests"] > 0 and junit["failures"] == junit["errors"] == 0
    suite = json.loads((out / "suite.json").read_text())
    assert suite["cells"] and all(r.get("lossless") is not False
                                  for c in suite["cells"] for r in c["systems"].values())
    assert json.loads((out / "real_sizes.json").read_text())["cells"]
    assert "all parts ok" in (out / "summary.md").read_text()
    assert not list(root.glob("fastgen-device.*")), "the script leaves its work folder behind"


def _wheel(path: Path, name: str, requires):
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-1.0.dist-info/METADATA", meta)
    return path


def test_unmet_requirements_are_reported(tmp_path):
    """A requirement neither carried nor on the device fails make device-wheels; extras and
    markers that do not hold for the target do not."""
    a = _wheel(tmp_path / "a-1.0-py3-none-any.whl", "a",
               ["torch>=2", "b", "nowhere-pkg", 'sphinx; extra == "docs"', 'oldpy; python_version < "3.8"'])
    b = _wheel(tmp_path / "b-1.0-py3-none-any.whl", "b", ["numpy"])
    assert build_wheels.unmet([a, b], "3.12") == ["a-1.0-py3-none-any.whl: nowhere-pkg"]


def test_build_shim_drops_only_the_torch_extensions():
    """The stand-in for torch.utils.cpp_extension that builds fairseq-fixed without torch."""
    import importlib.util
    from setuptools import Distribution, Extension
    # by path: the real torch is already imported in this process
    spec = importlib.util.spec_from_file_location(
        "shim_cpp_extension", DEVICE / "build_shim" / "torch" / "utils" / "cpp_extension.py")
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    plain = Extension("fairseq.libbleu", ["x.cpp"])
    dist = Distribution({"ext_modules": [plain, shim.CppExtension("fairseq.libnat", ["y.cpp"])]})
    cmd = shim.BuildExtension(dist)
    cmd.ensure_finalized()
    assert [e.name for e in cmd.extensions] == ["fairseq.libbleu"]


def test_summary_fails_on_a_timed_out_part_and_on_a_missing_result(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    parts = tmp_path / "parts.tsv"
    parts.write_text("install\tok\t0\t3\t60\t\npytest\ttimeout\t124\t60\t60\t\n"
                     "generator\tok\t0\t5\t60\t\nreal_sizes\tskipped\t\t0\t0\tnot in this checkout\n")
    rc = summarize.main(["--parts", str(parts), "--install", str(tmp_path / "none.json"),
                         "--outdir", str(out), "--device", "cpu"])
    s = json.loads((out / "summary.json").read_text())
    assert rc == 1 and s["failed_parts"] == ["pytest", "generator"]  # generator: ok but no generator.json
