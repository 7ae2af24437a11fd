# One entry point: `make demo` (set up + the CPU main job), `make test` (set up + the suite).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup test test-all demo bench clean

$(STAMP): setup.py
	@set -e; py=$$(scripts/find_python.sh); echo "using $$py"; \
	  [ -x $(PY) ] || $$py -m venv $(VENV); \
	  $(PY) -m pip install -q --upgrade pip; \
	  $(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

# The default suite: unit + multi-process CPU tests, without the ones marked slow.
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

test-all: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

demo: $(STAMP)
	$(PY) -m mixln_megatron.demo

bench: $(STAMP)
	$(PY) benchmarks/overhead.py --quick

clean:
	rm -rf $(VENV) runs build *.egg-info
