"""Console scripts of distributions the venv sees only through its .pth file.

    VENV/bin/python console_scripts.py DIST [DIST ...]

benchmarks/device/install.sh exposes the base python's site-packages to its venv through a
.pth file; their packages import, but their console scripts stay beside the base python,
while ``fairseq_fastgen.compare`` runs ``fairseq-generate`` from beside ``sys.executable``.
On the device fairseq-fixed is installed into the venv from its wheel and has its scripts;
in the CPU dry run it comes from the running environment, so its scripts are written here,
as pip writes them (import the entry point, call it).  Existing scripts are left alone.
"""
import importlib.metadata as md
import os
import sys
from pathlib import Path

TEMPLATE = """#!{python}
import sys
from {module} import {attr}
if __name__ == "__main__":
    sys.argv[0] = {name!r}
    sys.exit({attr}())
"""


def main(argv=None) -> int:
    bindir = Path(sys.executable).parent
    written = []
    for dist in (argv if argv is not None else sys.argv[1:]):
        try:
            eps = md.distribution(dist).entry_points
        except md.PackageNotFoundError:
            print(f"console_scripts: {dist} not visible here", file=sys.stderr)
            return 1
        for ep in eps:
            target = bindir / ep.name
            if ep.group != "console_scripts" or target.exists():
                continue
            module, _, attr = ep.value.partition(":")
            target.write_text(TEMPLATE.format(python=sys.executable, module=module.strip(),
                                              attr=attr.strip(), name=ep.name))
            os.chmod(target, 0o755)
            written.append(ep.name)
    print(f"console_scripts: wrote {', '.join(written) or 'none (all present)'} in {bindir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
