# `make test` and `make bench` bootstrap .venv from nothing; nothing else needs installing by hand.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: test bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[bench]'
	touch $@

# torch is pinned: this exact CPU build is the one the tests compare against.
$(VENV)/.test: $(VENV)/.base
	$(PIP) 'torch==2.13.0'
	$(PIP) -e '.[test]'
	touch $@

# Most of a cold run is Numba compiling kernels, one thread per process: two pytest workers
# (a test file each) use both cores (15.7 -> 10.1 min on 2 cores). The SyncBatchNorm tests, whose
# process groups have 6-second collective timeouts, then run alone.
test: $(VENV)/.test
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not solo"
	$(PY) -m pytest -q -m solo

# The DSP kit on the whole vector suite (docs/dsp.md): written fresh, built with the system C
# compiler twice (strict C99, then AddressSanitizer/UBSan), run, and every case compared.
DSP_CHECK := build/dsp-check
.PHONY: dsp-check
dsp-check: $(VENV)/.base
	rm -rf $(DSP_CHECK)
	$(VENV)/bin/bngrad vectors --suite dsp --out $(DSP_CHECK)/suite
	$(VENV)/bin/bngrad dsp-kit --out $(DSP_CHECK)/kit
	$(MAKE) -s -C $(DSP_CHECK)/kit run SUITE=$(CURDIR)/$(DSP_CHECK)/suite
	$(VENV)/bin/bngrad dsp-check $(DSP_CHECK)/suite
	find $(DSP_CHECK)/suite -name '*.out.bin' -delete
	$(MAKE) -s -C $(DSP_CHECK)/kit run-asan SUITE=$(CURDIR)/$(DSP_CHECK)/suite
	$(VENV)/bin/bngrad dsp-check $(DSP_CHECK)/suite

# The benchmark compares against the same pinned PyTorch as the tests.
bench: $(VENV)/.test
	$(PY) -m bngrad bench --suite quick

# ruff and mypy, pinned in pyproject's lint extra (their settings are there too). On top of the
# test environment: mypy checks bngrad.torch against the pinned PyTorch.
.PHONY: lint
$(VENV)/.lint: $(VENV)/.test
	$(PIP) -e '.[lint]'
	touch $@

lint: $(VENV)/.lint
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build src/*.egg-info
