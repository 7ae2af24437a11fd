# One entry point: `make demo` (set up + the CPU main job), `make test` (set up + the suite).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers; each takes whole files, so a module's fixtures are built once.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile

.PHONY: setup test test-all test-compat test-te test-bridge test-newest-torch demo bench clean

$(STAMP): setup.py
	@set -e; py=$$(scripts/find_python.sh); echo "using $$py"; \
	  [ -x $(PY) ] || $$py -m venv $(VENV); \
	  $(PY) -m pip install -q --upgrade pip; \
	  $(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

# The default suite: unit + multi-process CPU tests, without the ones marked slow.
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS) tests

test-all: $(STAMP)
	$(PY) -m pytest -q $(XDIST) $(PYTEST_ARGS) tests

# The compatibility subset (marker `compat`) on each older megatron-core release, laid over the
# venv's torch by scripts/compat_env.sh (.compat/<release>, no second torch download).
COMPAT_RELEASES ?= 0.17 0.18 main
test-compat: $(STAMP)
	@failed=; for r in $(COMPAT_RELEASES); do \
	  overlay=$$(scripts/compat_env.sh $$r) || { failed="$$failed $$r"; continue; }; \
	  echo "== megatron-core $$r ($$overlay)"; \
	  PYTHONPATH=$$overlay$${PYTHONPATH:+:$$PYTHONPATH} COMPAT_MEGATRON_RELEASE=$$r \
	    $(PY) -m pytest -q $(XDIST) -m compat $(PYTEST_ARGS) tests || failed="$$failed $$r"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-compat failed for:$$failed"; exit 1; fi

# The tests marked `te`, with TransformerEngine 2.20.2's real modules on the CPU (construction,
# checkpoints, resharding, conversion; TE's forward needs a GPU). scripts/install_te.sh lays TE
# over the venv (.venv/te-2.20.2, on PYTHONPATH for these tests only); another torch or no wheel:
# it says why in one line and the tests are skipped, or, with TE_TESTS_REQUIRED=1 in the
# environment, make fails with that line.
test-te: $(STAMP)
	@overlay=$$(scripts/install_te.sh) || exit 1; \
	if [ -z "$$overlay" ]; then echo "test-te: skipped (see the line above)"; exit 0; fi; \
	PYTHONPATH=$$overlay$${PYTHONPATH:+:$$PYTHONPATH} TE_TESTS_REQUIRED=1 \
	  $(PY) -m pytest -q $(XDIST) -m te $(PYTEST_ARGS) tests

# The tests marked `bridge`, with Megatron-Bridge 0.6.2 on the CPU (HF folder -> AutoBridge -> the
# Mix-LN GPTModel -> HF folder). scripts/install_bridge.sh lays Bridge's pinned packages over the
# venv (.venv/bridge-0.6.2, in front of the TE overlay, on PYTHONPATH for these tests only); where
# it cannot (another torch, no network, ...) it says why in one line and the tests are skipped, or,
# with BRIDGE_TESTS_REQUIRED=1 in the environment, make fails with that line.
# Only tests/test_bridge.py is collected: the rest of the suite is tested on the venv's transformers.
test-bridge: $(STAMP)
	@paths=$$(scripts/install_bridge.sh) || exit 1; \
	if [ -z "$$paths" ]; then echo "test-bridge: skipped (see the line above)"; exit 0; fi; \
	PYTHONPATH=$$paths$${PYTHONPATH:+:$$PYTHONPATH} BRIDGE_TESTS_REQUIRED=1 \
	  $(PY) -m pytest -q -m bridge $(PYTEST_ARGS) tests/test_bridge.py

# The checkpoint tests (torch_dist saves and loads: resume, conversion, inspect, vetting, megatron's
# metadata reader) once more on the newest torch pip resolves for `pip install -e .`, so a torch
# release that breaks them is seen the day it lands. scripts/newest_torch_env.sh keeps that torch in
# a second venv (.venv-newest-torch, past any machine-wide pip constraint on torch; .venv keeps its
# own) and says in one line what it holds; the last line here says what the tests ran on.
NEWEST_TORCH_TESTS ?= tests/test_torch_metadata_reader.py tests/test_layer_kinds.py \
  tests/test_layer_kinds_parallel.py tests/test_spike.py tests/test_resume_settings.py tests/test_vet_load.py \
  tests/test_convert.py tests/test_untrusted_checkpoints.py
test-newest-torch:
	@py=$$(scripts/newest_torch_env.sh) || exit 1; \
	$$py -m pytest -q $(XDIST) -m "not slow" $(PYTEST_ARGS) $(NEWEST_TORCH_TESTS); status=$$?; \
	echo "test-newest-torch: ran on $$($$py -m pip list 2>/dev/null | awk '$$1 == "torch" || $$1 == "megatron-core" {printf "%s %s ", $$1, $$2}')"; \
	exit $$status

demo: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	$(PY) benchmarks/overhead.py --quick

clean:
	rm -rf $(VENV) .venv-newest-torch .compat runs build *.egg-info
