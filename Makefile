# The two commands of the README: `make demo` and `make test` (and `make lint`, which CI runs first).
# Both create .venv if missing and install torch first ($(TORCH_SPEC)), then the package;
# a stamp file makes the second run skip the installs.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stratagem-installed
PIP_FLAGS := -q --disable-pip-version-check
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
QUIET := { grep -v "is ignored" || true; }

.PHONY: demo test lint venv clean bench

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)" 2>&1 | $(QUIET)
	$(PY) -c "import torch" 
	$(PY) -m pip install $(PIP_FLAGS) -e ".[all,test]" 2>&1 | $(QUIET)
	$(PY) -c "import stratagem, pytest, addict, yaml, tqdm"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m stratagem demo

test: $(STAMP)
	OMP_NUM_THREADS=1 MPLBACKEND=Agg $(PY) -m pytest -q -p no:cacheprovider tests

LINT_PATHS := stratagem tests benchmarks examples

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy stratagem

bench: $(STAMP)
	$(PY) benchmarks/optim_overhead.py

clean:
	rm -rf $(VENV) work_dirs
