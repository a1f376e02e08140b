"""What benchmarks/device_check.sh installed, checked from inside its venv (run from outside
the checkout, so that ``fairseq_fastgen`` comes from the installed wheel, not the tree).

    VENV/bin/python install_check.py --device-torch PATH --out install.json

Fails (exit 1) when torch is not the device's own (same file as --device-torch), when a
carried package does not import, or when a module of the installed fairseq_fastgen wheel does
not import (a subpackage missing from setup.py's ``packages`` shows here first).
"""
import argparse
import importlib
import json
import pkgutil
import sys
import sysconfig
from pathlib import Path


def probe_cupy() -> str:
    try:
        import cupy

        return f"{cupy.__version__} (CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()})"
    except Exception as e:  # noqa: BLE001  (missing here, or no GPU: recorded, not fatal)
        return f"unusable: {type(e).__name__}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device-torch", required=True, help="torch/__init__.py as the device's python sees it")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    res = dict(python=sys.version.split()[0], executable=sys.executable, problems=[])
    import torch

    res.update(torch=torch.__version__, torch_file=torch.__file__, cuda=torch.version.cuda,
               cuda_available=torch.cuda.is_available())
    if Path(torch.__file__).resolve() != Path(a.device_torch).resolve():
        res["problems"].append(f"torch imported from {torch.__file__}, not the device's {a.device_torch}")
    for name in ("fairseq", "fairseq_cli.generate", "hydra", "omegaconf", "bitarray", "sacremoses",
                 "fairseq.data.data_utils_fast", "fairseq.libbleu"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            res["problems"].append(f"import {name}: {type(e).__name__}: {e}")
    try:
        import fairseq_fastgen

        res["fairseq_fastgen_file"] = fairseq_fastgen.__file__
        site = Path(sysconfig.get_paths()["purelib"]).resolve()
        if site not in Path(fairseq_fastgen.__file__).resolve().parents:
            res["problems"].append(f"fairseq_fastgen imported from {fairseq_fastgen.__file__}, not the wheel in {site}")
        mods = [m.name for m in pkgutil.walk_packages(fairseq_fastgen.__path__, "fairseq_fastgen.")]
        for m in mods:
            try:
                importlib.import_module(m)
            except Exception as e:  # noqa: BLE001
                res["problems"].append(f"import {m}: {type(e).__name__}: {e}")
        res["fairseq_fastgen_modules"] = len(mods)
    except Exception as e:  # noqa: BLE001
        res["problems"].append(f"import fairseq_fastgen: {type(e).__name__}: {e}")
    try:
        import fairseq

        res["fairseq"] = f"{fairseq.__version__} ({fairseq.__file__})"
    except Exception:  # noqa: BLE001  (already recorded above)
        pass
    res["cupy"] = probe_cupy()
    a.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 1 if res["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
