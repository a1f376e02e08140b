# Two commands a new user needs:  make demo   and   make test
# Both create/reuse the virtualenv $(VENV) with stack A (Python 3.11, torch 2.13.0 CPU,
# fairseq-fixed 0.12.3.1).  fairseq-fixed builds from source once (~9 min); pip keeps the
# built wheel in its cache (~/.cache/pip), so later installs take seconds.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fastgen-installed

.PHONY: demo test test-long install clean-venv bench bench-suite bench-quick test-b demo-b fuzz

$(STAMP): setup.py requirements-a.txt $(wildcard fairseq_fastgen/csrc/*.cpp)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-a.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m fairseq_fastgen build-native
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# make test: the fast, complete gate (CI); make test-long: the long runs of behaviours the
# gate covers at a smaller size (tests marked long: bundled models in half precision, the
# benchmark suite and device kit end to end).
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not long" tests

test-long: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m long tests

# Differential fuzzer (tests/fuzz_generation.py), a long run: stock fairseq vs the plugin
# over generation options on tiny random models; prints "fuzz: N examples tried, ...".
# FUZZ_EXAMPLES sizes it; FUZZ_KEEP_GOING=1 counts every failure instead of stopping at
# the first; FUZZ_SEED=N draws another sequence (CI's short run is derandomized).
FUZZ_EXAMPLES ?= 5000
fuzz: $(STAMP)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz.py -k test_fuzz_generation

bench: bench-suite

# Full suite (stock vs fastgen + ablations vs CTranslate2, scaling; < 30 min on 2 CPU cores):
# writes BENCHMARKS.md and benchmarks/results/suite/ (results.json, PNG plots).
bench-suite: $(STAMP)
	$(PY) benchmarks/suite

bench-quick: $(STAMP)
	$(PY) benchmarks/suite --quick --out benchmarks/results/suite-quick

clean-venv:
	rm -rf $(VENV)

# Stack B: Python 3.10 + official fairseq 0.12.2 (pip < 24.1: omegaconf 2.0.x metadata).
# pyenv machines: its python3.10 shim fails unless 3.10 is selected, so take the binary itself
PYTHON310 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python3.10) python3.10)
VENV_B ?= .venv310
STAMP_B := $(VENV_B)/.fastgen-installed

$(STAMP_B): setup.py
	test -x $(VENV_B)/bin/python || $(PYTHON310) -m venv $(VENV_B)
	$(VENV_B)/bin/python -m pip install -q "pip<24.1"
	$(VENV_B)/bin/python -m pip install -q -e ".[test]"
	touch $@

test-b: $(STAMP_B)
	$(VENV_B)/bin/python -m pytest -q tests/test_cli_equivalence.py tests/test_checkpoint.py -k "tiny or bundled or checkpoint"

demo-b: $(STAMP_B)
	$(VENV_B)/bin/python examples/demo.py

# Device kit (issue 19; benchmarks/device_check.sh): the wheels a lent GPU machine lacks
# (fairseq-fixed built for its Python 3.12 without torch's C++ extensions, hydra-core,
# omegaconf, antlr4, bitarray, cffi, pycparser, sacremoses, this project), into an ignored
# folder that a run carries; fails when that folder plus the working tree exceed 64 MiB.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
DEVICE_WHEELS ?= .device-wheels

.PHONY: device-wheels
device-wheels: $(STAMP)
	$(PY) benchmarks/device/build_wheels.py --python $(PYTHON312) --out $(DEVICE_WHEELS)

# Long-run memory (issue 18): PSS of the whole process tree over time, stock beside the
# plugin, beams 1 and 5, on the bundled test set repeated to SENTENCES sentences; writes
# benchmarks/results/long_memory.{json,md}.  100,000 sentences take hours on 2 cores.
SENTENCES ?= 100000
.PHONY: bench-memory
bench-memory: $(STAMP)
	$(PY) benchmarks/long_memory.py --sentences $(SENTENCES) --beams 1,5
