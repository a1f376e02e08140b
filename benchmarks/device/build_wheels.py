"""Build, here, the wheels the lent GPU machine lacks (``make device-wheels``).

    python benchmarks/device/build_wheels.py --python ~/.pyenv/versions/3.12.1/bin/python3.12 \
        --out .device-wheels

The device (see /work/.library/device/KINDS.md) runs Python 3.12 with torch 2.11+cu130, CuPy
for CUDA 13, numpy, cython, regex, sacrebleu, sentencepiece, tqdm, scikit-learn, PyYAML ...,
but no fairseq, hydra-core or omegaconf, and it reaches no network.  This script puts into
OUT, for the target interpreter ``--python``:

* fairseq-fixed 0.12.3.1 built from its sdist without torch: its setup.py imports
  ``torch.utils.cpp_extension``, which ``build_shim/`` stands in for (the device's CUDA torch
  cannot be imported here, and the extensions that link torch's C++ ABI serve no path fastgen
  measures: see build_shim/torch/utils/cpp_extension.py).  libbleu and the two Cython data
  modules are built;
* the binary and pure-Python wheels in :data:`CARRIED` (downloaded for cp312 manylinux, or
  built here when PyPI has only an sdist);
* this project's own wheel.

Then it checks that every requirement of those wheels (extras aside) is either carried or in
:data:`DEVICE_HAS`, that each distribution appears once, and that OUT plus the working tree
that travels with a run stays under the 64 MiB a run may carry; it fails otherwise.
OUT/MANIFEST.txt lists the wheels, their sizes and sha256.
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).resolve().parent / "build_shim"
FAIRSEQ = "fairseq-fixed==0.12.3.1"
# What the device lacks, pinned to stack A's versions (requirements-a.txt's resolution).
# name==version -> True when PyPI has a wheel for cp312 manylinux; False: build it here (pure).
CARRIED = {
    "hydra-core==1.3.2": True,
    "omegaconf==2.3.0": True,
    "antlr4-python3-runtime==4.9.3": False,  # hydra/omegaconf's parser; sdist only on PyPI
    "bitarray==3.12.3": True,
    "cffi==2.1.1": True,
    "pycparser==3.12": True,
    "sacremoses==0.2.0": True,
}
# Distributions the device image holds (KINDS.md's package list), that the wheels above need.
DEVICE_HAS = {
    "torch", "torchaudio", "numpy", "cython", "regex", "sacrebleu", "sentencepiece", "tqdm",
    "scikit-learn", "packaging", "pyyaml", "click", "joblib", "typing-extensions", "psutil",
    "pytest", "hypothesis", "matplotlib", "setuptools",
}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
RUN_LIMIT_MIB = 64  # what one device run may carry: working tree + carried paths


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sh(cmd: List[str], env: Dict[str, str] = None) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, env=env)


def build_python(target: str, venv: Path) -> str:
    """An interpreter of the target's version with setuptools, wheel, cython and numpy."""
    probe = [target, "-c", "import setuptools, wheel, Cython, numpy"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return target
    py = venv / "bin" / "python"
    if not py.exists():
        sh([target, "-m", "venv", venv])
    sh([py, "-m", "pip", "install", "-q", "setuptools", "wheel", "cython", "numpy>=1.21.3"])
    return str(py)


def target_tags(py: str) -> Dict[str, str]:
    code = "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"
    ver = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    return {"version": ver, "abi": "cp" + ver.replace(".", "")}


def build_fairseq(py: str, out: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SHIM))
    # --no-cache-dir: a cached wheel may be one built against a real torch (other extensions)
    sh([py, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-cache-dir",
        "--no-binary", "fairseq-fixed", "-w", out, FAIRSEQ], env)


def fetch_carried(py: str, tags: Dict[str, str], out: Path) -> None:
    binary = [r for r, has_wheel in CARRIED.items() if has_wheel]
    plat = [x for p in PLATFORMS for x in ("--platform", p)]
    sh([py, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
        tags["version"], "--implementation", "cp", "--abi", tags["abi"], "--abi", "abi3", "--abi", "none",
        *plat, "-d", out, *binary])
    for req in [r for r, has_wheel in CARRIED.items() if not has_wheel]:
        sh([py, "-m", "pip", "wheel", "-q", "--no-deps", "-w", out, req])


def build_project(py: str, out: Path) -> None:
    sh([py, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, ROOT])


def wheel_meta(whl: Path) -> Dict[str, object]:
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
    reqs = re.findall(r"^Requires-Dist: (.+)$", text, re.M)
    return {"name": norm(name), "requires": reqs}


def unmet(wheels: List[Path], version: str) -> List[str]:
    """Requirements (extras aside, markers evaluated for the target) neither carried nor on the device."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    env = {"python_version": version, "python_full_version": version + ".0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    carried = {wheel_meta(w)["name"] for w in wheels}
    missing = []
    for w in wheels:
        for spec in wheel_meta(w)["requires"]:
            r = Requirement(spec)
            if r.marker is not None and not Marker(str(r.marker)).evaluate(env):
                continue
            if norm(r.name) not in carried | DEVICE_HAS:
                missing.append(f"{w.name}: {spec}")
    return missing


def travelling_bytes() -> int:
    """Tracked and untracked-not-ignored files: what a device run sends besides `carry`."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--python", required=True, help="interpreter of the device's Python version")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--build-env", type=Path, default=ROOT / ".device-build" / "venv",
                   help="venv with the build tools, made when --python lacks them")
    p.add_argument("--only-project", action="store_true",
                   help="this project's wheel only (the CPU dry run: fairseq from the running env)")
    a = p.parse_args(argv)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):  # one version of each, or the offline install stops
        old.unlink()
    py = build_python(a.python, a.build_env.resolve())
    tags = target_tags(py)
    build_project(py, out)
    if not a.only_project:
        build_fairseq(py, out)
        fetch_carried(py, tags, out)
    wheels = sorted(out.glob("*.whl"))
    names = [wheel_meta(w)["name"] for w in wheels]
    dupes = sorted({n for n in names if names.count(n) > 1})
    missing = [] if a.only_project else unmet(wheels, tags["version"])
    size = sum(w.stat().st_size for w in wheels)
    tree = travelling_bytes()
    lines = [f"# wheels for Python {tags['version']} (target {a.python}), built by {Path(__file__).name}",
             f"# total {size / 2**20:.1f} MiB; working tree that travels {tree / 2**20:.1f} MiB; "
             f"limit per run {RUN_LIMIT_MIB} MiB",
             f"# assumed on the device: {', '.join(sorted(DEVICE_HAS))}"]
    for w in wheels:
        lines.append(f"{w.stat().st_size:>10}  {hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}")
    (out / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    problems = [f"duplicate distributions: {dupes}"] if dupes else []
    problems += [f"requirement neither carried nor on the device: {m}" for m in missing]
    if size + tree > RUN_LIMIT_MIB * 2**20:
        problems.append(f"{(size + tree) / 2**20:.1f} MiB would travel (wheels + tree) > {RUN_LIMIT_MIB} MiB")
    for msg in problems:
        print("build_wheels: " + msg, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
