# Two commands: `make demo` sets everything up and runs every use case; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The extras installed (pyproject.toml): every use case by default; EXTRAS=finance for one. `make test` adds dev.
EXTRAS ?= all
# WHEELS=DIR installs from a wheelhouse (`make wheelhouse`) with no package index: a machine without one.
WHEELS ?=
INSTALLED := $(VENV)/.installed
TESTABLE := $(VENV)/.installed-dev
comma := ,
ifneq ($(strip $(WHEELS)),)
FROM := --no-index --find-links $(abspath $(WHEELS)) --constraint $(abspath $(WHEELS))/constraints.txt
endif

.PHONY: install wheelhouse demo test test-slow test-gpu test-no-bf16 gpu-check ui cli-docs clean

# The venv and the editable install of EXTRAS (again when pyproject.toml changes); from WHEELS where given, checked
# against its SHA256SUMS before the venv is made.
define venv_install
	$(if $(FROM),$(PYTHON) -m common.tools.wheelhouse check $(WHEELS))
	$(PYTHON) -m venv $(VENV)
	$(if $(FROM),,$(BIN)/pip install --quiet --upgrade pip)
	$(BIN)/pip install --quiet$(if $(FROM), $(FROM)) -e '.[$(1)]'
	touch $(INSTALLED)$(if $(2), $(2))
endef

$(INSTALLED): pyproject.toml
	$(call venv_install,$(EXTRAS))

$(TESTABLE): pyproject.toml
	$(call venv_install,$(EXTRAS)$(comma)dev,$(TESTABLE))

# Only the set-up, as `demo` does first.
install: $(INSTALLED)

# Every wheel EXTRAS needs (TORCH=cpu for torch's CPU build) into WHEELS, with its lock: carry the folder and the clone
# to a machine without an index, then `make install WHEELS=DIR` there (docs/install.md).
wheelhouse:
	$(PYTHON) -m common.tools.wheelhouse build $(or $(WHEELS),wheels) --extras $(EXTRAS)$(if $(TORCH), --torch $(TORCH))

demo: $(INSTALLED)
	$(BIN)/usecases demo

test: $(TESTABLE)
	$(BIN)/python -m pytest

# Whole files per xdist worker, as the default suite (pyproject.toml), so the slow suite's module fixtures (the
# real-data runs) are made once; its longest files are marked starts_first so none runs alone at the end.
test-slow: $(TESTABLE)
	$(BIN)/python -m pytest -m slow

test-gpu: $(TESTABLE)
	$(BIN)/python -m pytest -m gpu

# On a machine with a GPU: doctor, the gpu tests, every default run and benchmark; gpu-report.json and .md here.
gpu-check: $(INSTALLED)
	$(BIN)/usecases gpu-check --out .

# The suite as a CPU without native BF16 (and without AVX-512 kernels) runs it, on any machine.
test-no-bf16: $(TESTABLE)
	PYTHONPATH=tests/cpu_without_bf16 ATEN_CPU_CAPABILITY=avx2 $(BIN)/python -m pytest

ui: $(INSTALLED)
	$(BIN)/usecases ui

# docs/cli.md's reference of every command and option, written from the parser (tests/test_cli_docs.py checks it).
cli-docs: $(TESTABLE)
	$(BIN)/python -m usecases.cli.reference

clean:
	rm -rf $(VENV) checkpoints .pytest_cache
