#!/usr/bin/env bash
# The install part of benchmarks/device_check.sh:  install.sh PY WHEELS VENV OUT_JSON
#
# Makes a venv VENV from PY, makes PY's own site-packages visible in it (a .pth file: the
# device's torch, CuPy, numpy ... are used as they are, never copied, upgraded or replaced),
# installs every wheel of WHEELS into VENV offline, without dependencies (--ignore-installed:
# a same-version package visible through the .pth never shadows a wheel), then checks the
# result from outside the checkout (install_check.py).  Console scripts (fairseq-generate)
# land beside VENV/bin/python, where fairseq_fastgen.compare looks for them.
set -u -o pipefail
PY=$1 WHEELS=$2 VENV=$3 OUT_JSON=$4
HERE=$(cd "$(dirname "$0")" && pwd)

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "install: no wheels in $WHEELS (make device-wheels builds them)" >&2
    exit 2
fi
device_torch=$("$PY" -c "import torch; print(torch.__file__)") || { echo "install: $PY has no torch" >&2; exit 2; }

# a venv from a venv takes the base interpreter.  PY's own pip installs into a bare venv
# (pip >= 22.3: --python; seconds, where ensurepip takes half a minute); an older pip gets a
# venv with its own pip
pip_major=$("$PY" -m pip --version 2>/dev/null | sed -n 's/^pip \([0-9]*\)\..*/\1/p')
if [ "${pip_major:-0}" -ge 23 ]; then
    "$PY" -m venv --without-pip "$VENV" || exit 2
    pip=("$PY" -m pip --python "$VENV/bin/python")
else
    "$PY" -m venv "$VENV" || exit 2
    pip=("$VENV/bin/python" -m pip)
fi
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$PY" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
    > "$site/_device_site_packages.pth"
echo "install: $(wc -l < "$site/_device_site_packages.pth") site dir(s) of $PY visible in $VENV; torch: $device_torch"

"${pip[@]}" install -q --no-index --no-deps --ignore-installed --no-compile --no-cache-dir --disable-pip-version-check \
    "${wheels[@]}" || exit 1
echo "install: ${#wheels[@]} wheels from $WHEELS"
"$VENV/bin/python" "$HERE/console_scripts.py" fairseq-fixed || exit 1
cd "$(dirname "$VENV")" && "$VENV/bin/python" "$HERE/install_check.py" --device-torch "$device_torch" --out "$OUT_JSON"
