# The two commands of the README: `make demo` and `make test` (and `make lint`, which CI runs first,
# `make test-slow`, the second tier of tests, which CI runs after `make test`, `make test-all`,
# both tiers, and `make docs`, the documentation site, which CI builds after the tests).
# Both create .venv if missing and install torch first ($(TORCH_SPEC)), then the package;
# a stamp file makes the second run skip the installs.
PYTHON ?= python3
# the oldest Python the targets install on: the docs extra's pins (sphinx==9.0.4,
# myst-parser==5.2.0) need 3.11, while the library alone (requires-python) runs on 3.10;
# README.md states this version (tests/test_docs.py checks it against the pins)
MIN_PYTHON := 3.11
# $(call CHECK_PYTHON,interpreter,what to run instead): fails with that advice when too old
CHECK_PYTHON = $(1) -c 'import sys; sys.exit(sys.version_info[:2] < ($(subst .,$(comma),$(MIN_PYTHON))))' \
  || { echo "make: $(1) is Python $$($(1) -c 'import platform; print(platform.python_version())'); the make targets need Python >= $(MIN_PYTHON) (the docs extra's Sphinx 9 and MyST-Parser 5 do): $(2)" >&2; exit 1; }
comma := ,
# inside pyproject.toml's torch range (>=2.13,<2.14), or `pip install -e .` replaces it
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stratagem-installed
PIP_FLAGS := -q --disable-pip-version-check
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
QUIET := { grep -v "is ignored" || true; }

.PHONY: demo test test-slow test-all lint docs venv clean bench gpu gpu-wheels

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || { $(call CHECK_PYTHON,$(PYTHON),make $(MAKECMDGOALS) PYTHON=python$(MIN_PYTHON)); \
	  $(PYTHON) -m venv $(VENV); }
	@$(call CHECK_PYTHON,$(PY),rm -rf $(VENV); make $(MAKECMDGOALS) PYTHON=python$(MIN_PYTHON))
	$(PY) -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)" 2>&1 | $(QUIET)
	$(PY) -c "import torch" 
	$(PY) -m pip install $(PIP_FLAGS) -e ".[all,test,docs]" 2>&1 | $(QUIET)
	$(PY) -c "import stratagem, pytest, addict, yaml, tqdm, sphinx, myst_parser, furo"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m stratagem demo

# two tiers (the `slow` marker, pyproject.toml): `make test` runs every behaviour at least once
# within 10 minutes on 2 cores; `make test-slow` the rest (soaks, repetition-heavy variants,
# the checks too slow for the first); `make test-all` both in one session
PYTEST := OMP_NUM_THREADS=1 MPLBACKEND=Agg $(PY) -m pytest -q -p no:cacheprovider --durations=20

test: $(STAMP)
	$(PYTEST) -m "not slow" tests

test-slow: $(STAMP)
	$(PYTEST) -m slow tests

test-all: $(STAMP)
	$(PYTEST) tests

LINT_PATHS := stratagem tests benchmarks examples

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy stratagem

# the site from docs/ into docs/_build/html (open index.html; search works offline): -W makes any
# warning an error (a broken link or reference, a docstring that does not render, a public name
# missing from the API reference); -E re-reads every page so that no warning hides in a cache
docs: $(STAMP)
	OMP_NUM_THREADS=1 MPLBACKEND=Agg $(VENV)/bin/sphinx-build -W --keep-going -E -q -b html docs docs/_build/html
	@echo "docs: docs/_build/html/index.html"

bench: $(STAMP)
	$(PY) benchmarks/optim_overhead.py

# every gpu-marked test and the GPU benchmarks, then one summary (benchmarks/gpu/run.sh: its
# budget, 8 minutes, is in its header). No venv step: a GPU machine may have no network, so the
# script picks a Python whose torch sees CUDA and imports this checkout through PYTHONPATH.
# Without CUDA it runs its dry part (CI does) and says so in one line.
gpu:
	bash benchmarks/gpu/run.sh

# the pure-Python dependencies and pytest as wheels for Python 3.10-3.13, for a GPU machine
# without network: carry .gpu-wheels/ with the checkout and `make gpu` installs what it lacks
GPU_WHEELS := addict packaging pyyaml tqdm typing_extensions xxhash pytest pytest-timeout pluggy iniconfig pygments exceptiongroup tomli
gpu-wheels:
	for v in 3.10 3.11 3.12 3.13; do \
	  $(PYTHON) -m pip download $(PIP_FLAGS) --only-binary=:all: --python-version $$v \
	    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --no-deps -d .gpu-wheels $(GPU_WHEELS); \
	done

clean:
	rm -rf $(VENV) work_dirs docs/_build docs/_generated .gpu-wheels benchmarks/gpu/results
