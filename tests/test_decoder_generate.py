"""Generation on qkv's SmolLM2: the KV-cache path against full recomputation,
streaming, batches, sampling options, stop strings, attention maps and the errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import qkv
import qkv.models
from decoder_testing import one_thread, smollm2
from qkv.models._generate import StopText

pytest.importorskip("gguf")


pytestmark = pytest.mark.usefixtures("one_thread")
__all__ = ["one_thread"]  # the fixture, imported for pytest to find


@pytest.fixture(scope="module")
def model():
    return smollm2()


def test_the_model_is_built_from_qkv_modules(model) -> None:
    layer = model.decoder.layers[0]
    assert isinstance(layer.attention, qkv.MultiHeadAttention)
    assert isinstance(layer.attention.rope, qkv.RotaryEmbedding)
    assert (layer.attention.n_heads, layer.attention.n_kv_heads) == (9, 3)
    c = model.config
    assert (c.n_layers, c.d_model, c.max_positions, c.rope_base) == (30, 576, 8192, 100000.0)
    assert model.decoder.lm_head.weight is model.decoder.embed.weight  # tied


def test_cached_decoding_equals_full_recompute(model) -> None:
    """Greedy decoding on the KV cache (prefill once, one token a step) gives the tokens and
    the logits of running the whole prefix through the model at every step."""
    prompt = "The three primary colours are"
    n = 12
    model.generate(prompt, max_new_tokens=n)
    cached = model.last_tokens[0]
    ids = model.tokenize(prompt).input_ids[0].tolist()
    caches = model.decoder.new_caches(len(ids) + n)
    with torch.inference_mode():
        step_logits = model(torch.tensor([ids]), caches=caches, last_only=True).logits[0, -1]
        for t in cached:
            full = model(torch.tensor([ids])).logits[0, -1]  # the whole prefix, no cache
            assert (full - step_logits).abs().max() <= 1e-4
            assert int(full.argmax()) == t
            ids.append(t)
            step_logits = model(torch.tensor([[t]]), caches=caches, last_only=True).logits[0, -1]
    assert len(cached) == n


def test_stream_pieces_make_the_generated_text(model) -> None:
    pieces = list(model.stream("Once upon a time", max_new_tokens=16))
    assert len(pieces) > 1
    assert "".join(pieces) == model.generate("Once upon a time", max_new_tokens=16)
    assert model.last_stats.new_tokens == 16 and model.last_stats.decode_tokens_per_s > 0


def test_a_batch_equals_each_prompt_alone(model) -> None:
    prompts = ["The capital of France is", "def add(a, b):", "Hi"]
    alone = [model.generate(p, max_new_tokens=10) for p in prompts]
    assert model.generate(prompts, max_new_tokens=10) == alone


def test_chat_uses_the_file_template(model) -> None:
    prompt = model.chat_prompt("What is 2 + 2?")
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert model.generate("What is 2 + 2?", chat=True, max_new_tokens=24) == model.generate(
        prompt, max_new_tokens=24
    )
    assert model.last_tokens[0][-1] != 2  # <|im_end|> ends the turn and is not part of it


def test_sampling_options(model) -> None:
    kw = {"max_new_tokens": 12, "temperature": 0.9}
    a = model.generate("My favourite food is", seed=1, **kw)
    assert model.generate("My favourite food is", seed=1, **kw) == a  # a seed reproduces
    others = {model.generate("My favourite food is", seed=s, **kw) for s in (2, 3, 4)}
    assert others != {a}
    greedy = model.generate("My favourite food is", max_new_tokens=12)
    # a nucleus this small holds only the most likely token: sampling becomes greedy
    assert model.generate("My favourite food is", top_p=1e-6, seed=5, **kw) == greedy


def test_stop_strings_end_the_text(model) -> None:
    full = model.generate("1, 2, 3, 4,", max_new_tokens=12)
    assert " 6" in full
    cut = model.generate("1, 2, 3, 4,", max_new_tokens=12, stop=" 6")
    assert cut == full[: full.index(" 6")]
    assert "".join(model.stream("1, 2, 3, 4,", max_new_tokens=12, stop=[" 6", "zzz"])) == cut


def test_stop_text_holds_back_what_may_become_a_stop() -> None:
    pieces = {(1,): "ab", (1, 2): "ab<", (1, 2, 3): "ab<e", (1, 2, 3, 4): "ab<x"}
    s = StopText(lambda ids: pieces[tuple(ids)], ("<end>",))
    assert [s.push([1]), s.push([1, 2]), s.push([1, 2, 3]), s.push([1, 2, 3, 4])] == [
        "ab",
        "",
        "",
        "<x",
    ]
    utf8 = StopText(lambda ids: "caf\ufffd" if len(ids) == 1 else "café", ())
    assert (utf8.push([1]), utf8.push([1, 2])) == ("caf", "é")


def test_attention_maps_are_causal(model) -> None:
    tokens, w = model.attention_maps("The cat sat because it was tired.")
    assert tokens == ["The", " cat", " sat", " because", " it", " was", " tired", "."]
    assert w.shape == (30, 9, 8, 8)
    assert (w.triu(1) == 0).all()
    assert torch.allclose(w.sum(-1), torch.ones(30, 9, 8), atol=1e-5)


def test_errors_are_one_clear_line(model, tmp_path) -> None:
    long = "word " * 8200
    with pytest.raises(ValueError, match=r"the prompt is \d+ tokens but .*context is 8192") as e:
        model.generate(long)
    with pytest.raises(ValueError, match="unknown model name 'gpt5'; known names: 'all-minilm"):
        qkv.models.load("gpt5")
    with pytest.raises(FileNotFoundError):
        qkv.models.load(tmp_path / "nothing-here")
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        model.generate("hi", max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        model.generate("hi", top_p=0)
    with pytest.raises(TypeError, match="stream takes one prompt string"):
        next(model.stream(["a", "b"]))
    with pytest.raises(ValueError, match="the prompt is empty"):
        model.generate("")
    assert "\n" not in str(e.value)


def test_generation_stops_at_the_context(model, monkeypatch) -> None:
    """max_new_tokens beyond the context: generation ends where the context is full (shown
    with the context shrunk to 40 tokens, as a full 8192-token prefill takes minutes here)."""
    small = dataclasses.replace(model.config, max_positions=40)
    monkeypatch.setattr(model, "config", small)
    monkeypatch.setattr(model.decoder, "config", small)
    prompt = "one two three four five six seven eight nine ten " * 3
    n_prompt = model.tokenize(prompt).input_ids.shape[1]
    assert 30 <= n_prompt < 40
    model.generate(prompt, max_new_tokens=50)
    assert model.last_stats.new_tokens == 40 - n_prompt
    with pytest.raises(ValueError, match=r"the prompt is \d+ tokens but .* context is 40 tokens"):
        model.generate(prompt * 2)


def test_the_encoder_still_loads_by_default_and_by_name() -> None:
    enc = qkv.models.load()
    assert isinstance(enc, qkv.models.TextEncoder)
    assert isinstance(qkv.models.load("all-MiniLM-L6-v2"), qkv.models.TextEncoder)
