#!/usr/bin/env bash
# The device kit (issue 19): everything a lent GPU machine should run, in one call.
#
#   benchmarks/device_check.sh OUTDIR [--device cuda|cpu] [--tiny] [--wheels DIR] [--python PY]
#                              [--budget SECONDS]
#
# On the device (see /work/.library/device/): `make device-wheels` here first, then
#   run(command="benchmarks/device_check.sh $OUT", carry=[".device-wheels"], timeout_s=780)
#
# Parts, in order, each under its own `timeout` (a part that fails or runs out of time is
# recorded and the next one still runs; the whole script stays inside --budget, 720 s):
#   install    benchmarks/device/install.sh: a venv over the device python's own packages
#              (its torch is used, never replaced), the wheels of --wheels installed offline
#              with --no-deps, checked by install_check.py (torch is the device's, every
#              fastgen module of the installed wheel imports)
#   pytest     tests/test_ngram_blocker.py: the CuPy kernel vs the torch reference (fp32, fp16,
#              bf16), the kernel source through nvcc, the blocker's CPU properties
#   generator  benchmarks/device/generator_check.py: FastSequenceGenerator vs stock in one
#              process on --device, fp32 (lossless, bitwise) and fp16/bf16, bundled models
#   real_sizes python benchmarks/real_sizes.py --device D --repeats 1 (fp32, fp16, bf16 on cuda;
#              the dry run: --tiny, the bart_large cell); skipped with a logged line where that script
#              does not exist
#   suite      python benchmarks/suite --quick --device D --no-ct2 --no-scaling (fp32 + fp16
#              on cuda; the dry run: benchmarks/device/suite_tiny.py, one cell); last, as it
#              keeps the cells it measured when its time runs out (cells.partial.json)
# The working tree's fairseq_fastgen is what the tests and benchmarks measure (each puts the
# checkout first on sys.path and gives fairseq --user-dir from it); the installed wheel of
# this project is checked by the install part only.
#
# OUTDIR gets at most 8 files, each well under 16 MiB: device_check.log (every part's
# output), summary.md, summary.json (parts, status, seconds, environment), pytest.xml,
# generator.json, suite.json, suite.md, real_sizes.json.
#
# CPU dry run (tests/test_device_kit.py): `--device cpu --tiny`, the same parts on tiny
# settings, with a wheel folder holding only this project's wheel (build_wheels.py
# --only-project for the running python: building fairseq-fixed takes minutes, too slow for
# the test suite), fairseq and the rest coming from the running environment through the
# same .pth mechanism that exposes the device's torch.
set -u -o pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
case $1 in -*) usage ;; esac
OUTDIR=$1; shift
DEVICE=cuda TINY=0 WHEELS=$ROOT/.device-wheels PY=python3 BUDGET=720
while [ $# -gt 0 ]; do
    case $1 in
        --device) DEVICE=$2; shift 2 ;;
        --tiny) TINY=1; shift ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --python) PY=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        *) usage ;;
    esac
done
case $DEVICE in cpu|cuda) ;; *) usage ;; esac
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastgen-device.XXXXXX")
LOG=$OUTDIR/device_check.log
PARTS=$WORK/parts.tsv
VENV=$WORK/venv
VPY=$VENV/bin/python
START=$(date +%s)
RESERVE=15  # seconds kept for the summary
: > "$LOG"; : > "$PARTS"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
cd "$ROOT" || exit 2

# Per-part time caps (seconds) on cuda; the dry run's are smaller.  Each part also gets no
# more than what is left of the budget.
if [ "$TINY" = 1 ]; then
    CAP_INSTALL=60 CAP_PYTEST=90 CAP_GENERATOR=90 CAP_REAL=150 CAP_SUITE=200
    TINY_FLAG=(--tiny) SUITE_FLAGS=(--no-ablation --models es-en) PRECISIONS=(fp32)
    SUITE=(benchmarks/device/suite_tiny.py)  # the suite's main on a one-cell grid
    REAL_FLAGS=(--tiny --cells bart_large --sentences 2)  # the n-gram, long-source cell
else
    CAP_INSTALL=60 CAP_PYTEST=100 CAP_GENERATOR=130 CAP_REAL=300 CAP_SUITE=200
    TINY_FLAG=() SUITE_FLAGS=() PRECISIONS=(fp32) SUITE=(benchmarks/suite)
    REAL_FLAGS=(--repeats 1)  # every cell once: the budget holds no second round
    [ "$DEVICE" = cuda ] && PRECISIONS=(fp32 fp16 bf16)
fi

log() { echo "device_check: $*" | tee -a "$LOG"; }

# part NAME CAP CMD...: run CMD with its output in the log, under min(CAP, time left)
part() {
    local name=$1 cap=$2; shift 2
    local left=$((BUDGET - RESERVE - ($(date +%s) - START)))
    local t=$(( cap < left ? cap : left ))
    if [ "$t" -lt 10 ]; then
        log "part $name skipped: ${left}s of the budget left"
        printf '%s\tskipped\t\t0\t0\tno time left\n' "$name" >> "$PARTS"
        return
    fi
    log "part $name (timeout ${t}s): $*"
    local t0=$(date +%s)
    timeout --kill-after=10 "$t" "$@" >> "$LOG" 2>&1
    local rc=$? status=ok
    case $rc in 0) ;; 124|137) status=timeout ;; *) status=failed ;; esac
    local dt=$(( $(date +%s) - t0 ))
    printf '%s\t%s\t%s\t%s\t%s\t\n' "$name" "$status" "$rc" "$dt" "$t" >> "$PARTS"
    log "part $name: $status (exit $rc, ${dt}s)"
}

skip() { log "part $1 skipped: $2"; printf '%s\tskipped\t\t0\t0\t%s\n' "$1" "$2" >> "$PARTS"; }

log "device $DEVICE, tiny $TINY, wheels $WHEELS, python $PY, budget ${BUDGET}s, work $WORK"
command -v nvidia-smi >/dev/null && nvidia-smi -L >> "$LOG" 2>&1

part install "$CAP_INSTALL" bash "$ROOT/benchmarks/device/install.sh" "$PY" "$WHEELS" "$VENV" "$WORK/install.json"
if [ ! -x "$VPY" ] || [ ! -s "$WORK/install.json" ]; then
    # nothing else can run without the environment; the summary says why
    for p in pytest generator real_sizes suite; do skip "$p" "install failed"; done
else
    part pytest "$CAP_PYTEST" "$VPY" -m pytest -q -p no:cacheprovider tests/test_ngram_blocker.py \
        --junitxml "$OUTDIR/pytest.xml"
    part generator "$CAP_GENERATOR" "$VPY" benchmarks/device/generator_check.py --device "$DEVICE" \
        "${TINY_FLAG[@]}" --out "$OUTDIR/generator.json"
    if [ -f benchmarks/real_sizes.py ]; then
        part real_sizes "$CAP_REAL" "$VPY" benchmarks/real_sizes.py --device "$DEVICE" "${REAL_FLAGS[@]}" \
            --precisions "${PRECISIONS[@]}" --out "$WORK/real_sizes" --work "$WORK/real_sizes_work"
    else
        skip real_sizes "benchmarks/real_sizes.py not in this checkout"
    fi
    part suite "$CAP_SUITE" "$VPY" "${SUITE[@]}" --quick --device "$DEVICE" --no-ct2 --no-scaling \
        "${SUITE_FLAGS[@]}" --out "$WORK/suite" --report "$WORK/suite/report.md"
fi

# results into OUTDIR (a suite cut short still left its cells in cells.partial.json)
for f in "$WORK/suite/results.json" "$WORK/suite/cells.partial.json"; do
    [ -f "$f" ] && { cp "$f" "$OUTDIR/suite.json"; break; }
done
[ -f "$WORK/suite/report.md" ] && cp "$WORK/suite/report.md" "$OUTDIR/suite.md"
rs=$(ls "$WORK"/real_sizes/real_sizes_*.json 2>/dev/null | head -1)
[ -n "$rs" ] && cp "$rs" "$OUTDIR/real_sizes.json"
PYBIN=$([ -x "$VPY" ] && echo "$VPY" || echo "$PY")
"$PYBIN" "$ROOT/benchmarks/device/summarize.py" --parts "$PARTS" --install "$WORK/install.json" \
    --outdir "$OUTDIR" --device "$DEVICE" --tiny "$TINY" --elapsed $(( $(date +%s) - START )) \
    --real-sizes-md "$(ls "$WORK"/real_sizes/real_sizes_*.md 2>/dev/null | head -1)" >> "$LOG" 2>&1
rc=$?
rm -rf "$WORK"
cat "$OUTDIR/summary.md" 2>/dev/null
exit $rc
