# Two commands for a fresh machine (each makes its own virtual environment):
#   make demo   - the main job
#   make test   - lint, type-check and every test
# torch is pinned by constraints.txt: an unpinned torch would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PIP     = $(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: demo test lint typecheck unit clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/qkv walkthrough

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(BIN)/.installed
	$(BIN)/mypy

unit: $(BIN)/.installed
	$(BIN)/python -m pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
