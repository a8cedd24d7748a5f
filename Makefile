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

test: $(VENV)/.test
	$(PY) -m pytest -q

# The benchmark compares against the same pinned PyTorch as the tests.
bench: $(VENV)/.test
	$(PY) -m bngrad bench --suite quick

clean:
	rm -rf $(VENV) build src/*.egg-info
