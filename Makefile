# Two commands: `make demo` sets everything up and runs every use case; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow test-gpu test-no-bf16 gpu-check ui cli-docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# Only the set-up: the virtual environment and the editable install with the dev extra (again when pyproject.toml
# changes), as `demo` and `test` do first.
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/usecases demo

test: $(STAMP)
	$(BIN)/python -m pytest

# Whole files per xdist worker, as the default suite (pyproject.toml), so the slow suite's module fixtures (the
# real-data runs) are made once; its longest files are marked starts_first so none runs alone at the end.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu

# On a machine with a GPU: doctor, the gpu tests, every default run and benchmark; gpu-report.json and .md here.
gpu-check: $(STAMP)
	$(BIN)/usecases gpu-check --out .

# The suite as a CPU without native BF16 (and without AVX-512 kernels) runs it, on any machine.
test-no-bf16: $(STAMP)
	PYTHONPATH=tests/cpu_without_bf16 ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest

ui: $(STAMP)
	$(BIN)/usecases ui

# docs/cli.md's reference of every command and option, written from the parser (tests/test_cli_docs.py checks it).
cli-docs: $(STAMP)
	$(BIN)/python -m usecases.cli.reference

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
