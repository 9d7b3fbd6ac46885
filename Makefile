# make train : set up .venv and run the default job (python -m framework.train)
# make test  : set up .venv and run the whole test suite
# make gpu-check : on a GPU machine, everything to verify there in one run (bench/gpu_check.sh; PYTHON=... picks
#                  the interpreter, by default .venv's where it exists, else python3; ARGS=--dry-run runs it on the CPU)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train test lint clean gpu-check

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes. Without CUDA, torch==2.13.0 comes
# first so that the `torch>=2.6` range in pyproject.toml is already met by a CPU build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q 'torch>=2.6'; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev,hf,report,slurm]'
	touch $(STAMP)

train: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m framework.train $(ARGS)

# Two pytest workers (TEST_JOBS), one test file at a time each: file-scoped fixtures (a recipe run,
# a rank pool per worker) are built once, and the cores that single-process tests leave idle are used.
# Files are handed out slowest first (tests/conftest.py), not by xdist's count of tests per file.
# The C++ CPU optimizer kernels are built first where none is built (a fresh machine's cache), not inside
# the first test that uses them and its time limit; a failed build is said and the tests use the fallback.
TEST_JOBS ?= 2
test: setup lint
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m framework.ops build --if-needed \
		|| echo "make test: the C++ CPU optimizer kernels did not build (the reason is above); the tests use the fallback"
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder --durations=30 \
		$(PYTEST_ARGS)

# pyflakes + pycodestyle through ruff (settings in pyproject.toml); part of `make test`.
lint: setup
	$(VENV)/bin/ruff check -q .

# No setup prerequisite: a GPU image runs it with what is there. The environment's Python where `make setup`
# built one (python3 outside it cannot import torch), else python3.
gpu-check:
	PYTHON="$${PYTHON:-$(if $(wildcard $(PY)),$(PY),python3)}" bash bench/gpu_check.sh $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun checkpoints
