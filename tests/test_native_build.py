"""Loud builds: the default CPU path (the C++ decoder step) is built, or its absence was
asked for; ``python -m fairseq_fastgen build-native`` fails when the build fails."""
import os
import subprocess
import sys

from fairseq_fastgen.__main__ import ALLOW_PYTHON_STEP
from fairseq_fastgen.models import native_step


def test_the_default_cpu_step_is_built_unless_the_python_step_was_asked_for():
    if os.environ.get(ALLOW_PYTHON_STEP) == "1":
        assert native_step.load() is not None or native_step.load_error()
        return
    assert native_step.load() is not None, (
        f"the C++ decoder step did not build ({native_step.load_error()}); "
        f"{ALLOW_PYTHON_STEP}=1 runs the suite on the PyTorch step")


def _build_native(tmp_path, **env):
    e = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": "/bin/false", **env}
    if ALLOW_PYTHON_STEP not in env:
        e.pop(ALLOW_PYTHON_STEP, None)
    return subprocess.run([sys.executable, "-m", "fairseq_fastgen", "build-native"], env=e,
                          capture_output=True, text=True, timeout=300)


def test_build_native_fails_when_the_build_fails(tmp_path):
    r = _build_native(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "native decoder step not built" in r.stderr and ALLOW_PYTHON_STEP in r.stderr
    assert "compiling the C++ decoder step once" in r.stderr  # said before the wait


def test_build_native_accepts_the_python_step_when_asked(tmp_path):
    r = _build_native(tmp_path, **{ALLOW_PYTHON_STEP: "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "slower PyTorch step" in r.stdout
