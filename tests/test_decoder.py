"""SmolLM2-135M on qkv against transformers' eager Llama reading the same GGUF file:
token ids, logits, greedy generation and attention maps."""

from __future__ import annotations

import shutil

import pytest
import torch

from decoder_testing import CHAT, LONG, one_thread, peer, smollm2

pytest.importorskip("transformers")
pytest.importorskip("gguf")

# The torture set: unicode, emoji (ZWJ sequences), code, runs of spaces and newlines, digits,
# special tokens, the chat template.
TORTURE = [
    "The cat sat because it was tired.",
    "",
    " ",
    "   leading spaces and trailing   ",
    "Hello  world\n\n\n\tx\r\ny\rz",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "12345 678 3.14159 1,000,000 2024-12-01 0x1F 007",
    "日本語のテキスト 中文 한국어 Ünïcödé ßtraße ñ café naïve",
    "😀 🏳️‍🌈 👨‍👩‍👧 🤖🤖 ❤️",
    "It's we'll they've I'M can't",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>x<file_sep>",
    "\u00a0nbsp\u2003em\u200bzw",
    "a" * 300 + " " + "ab" * 100,
]


pytestmark = pytest.mark.usefixtures("one_thread")
__all__ = ["one_thread"]  # the fixture, imported for pytest to find


@pytest.fixture(scope="module")
def model():
    return smollm2()


@pytest.fixture(scope="module")
def hf():
    return peer()


@pytest.mark.parametrize("text", [*TORTURE, "<chat>"])
def test_token_ids_equal_transformers(model, hf, text: str) -> None:
    tok = hf[1]
    if text == "<chat>":
        msgs = [{"role": "user", "content": CHAT}]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert model.chat_prompt(CHAT) == text  # the file's chat template, rendered alike
    ours = model.tokenize(text).input_ids[0].tolist()
    assert ours == tok(text)["input_ids"]
    assert model.decode(ours, skip_special_tokens=False) == tok.decode(ours)


def test_digit_split_follows_llama_cpp(model, hf) -> None:
    """The file names the "smollm" pre-tokenizer: llama.cpp splits off every numeric character
    before GPT-2's regex (as SmolLM2's own tokenizer.json does with Digits). transformers' GGUF
    loader ignores the name and applies GPT-2's regex alone, so the two differ where a space
    precedes a non-ASCII numeral (ASCII digits have no merges, so they agree: the torture set)."""
    assert model.tokenize(" ²").tokens == [" ", "²"]
    assert model.tokenize(" 42").tokens == [" ", "4", "2"]
    assert hf[1](" 42")["input_ids"] == model.tokenize(" 42").input_ids[0].tolist()


@pytest.mark.parametrize("which", ["short", "chat", "long"])
def test_logits_match_eager(model, hf, which: str) -> None:
    text = {"short": TORTURE[0], "chat": model.chat_prompt(CHAT), "long": LONG}[which]
    ids = model.tokenize(text).input_ids
    if which == "long":
        assert ids.shape[1] > 600
    with torch.inference_mode():
        ours = model(ids).logits
        theirs = hf[0](ids).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{which}: {ids.shape[1]} tokens, logits max abs diff {diff:.2e}")
    assert diff <= 5e-4


@pytest.mark.parametrize("which", ["short", "chat"])
def test_decode_steps_on_the_kernel_match_eager(model, hf, which: str) -> None:
    """Decoding's products have one row (a short prompt's a few), which qkv's compiled
    kernel computes from the file's Q4_1/Q8_0 blocks (where a compiler built it): the
    logits of a token-by-token pass over the KV cache, and of an 8-token prompt, within 5e-4
    of eager's on the whole sequence."""
    if shutil.which("c++") is not None:
        assert model.linear_path.kernel is not None, model.linear_path
    text = TORTURE[0] if which == "short" else model.chat_prompt(CHAT)
    ids = model.tokenize(text).input_ids
    caches = model.decoder.new_caches(ids.shape[1])
    with torch.inference_mode():
        steps = [model(ids[:, i : i + 1], caches=caches).logits for i in range(ids.shape[1])]
        short = model(ids[:, :8]).logits  # [1, 8, vocab]
        theirs = hf[0](ids).logits
    diff = (torch.cat(steps, dim=1) - theirs).abs().max().item()
    print(f"{which}: {ids.shape[1]} decode steps, logits max abs diff {diff:.2e}")
    assert diff <= 5e-4
    assert (short - theirs[:, :8]).abs().max().item() <= 5e-4


@pytest.mark.slow
@pytest.mark.parametrize("which", ["plain", "code", "chat"])
def test_greedy_32_tokens_identical(model, hf, which: str) -> None:
    prompt = {
        "plain": "The capital of France is",
        "code": "def fibonacci(n):\n",
        "chat": model.chat_prompt("Name three colours."),
    }[which]
    model.generate(prompt, max_new_tokens=32)
    ours = model.last_tokens[0]
    ids = model.tokenize(prompt).input_ids
    with torch.inference_mode():
        out = hf[0].generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
    theirs = [t for t in out.tolist() if t not in model.eos_ids][: len(ours) + 1]
    assert len(ours) >= 8, ours  # generated something real (stopped at the end token at most)
    assert ours == theirs


@pytest.mark.parametrize("which", ["short", "chat"])
def test_attention_maps_equal_eager(model, hf, which: str) -> None:
    text = TORTURE[0] if which == "short" else model.chat_prompt(CHAT)
    tokens, w = model.attention_maps(text)
    ids = model.tokenize(text).input_ids
    with torch.inference_mode():
        att = hf[0](ids, output_attentions=True).attentions
    theirs = torch.stack([a[0] for a in att])  # [layers, H, L, L]
    assert w.shape == theirs.shape == (30, 9, len(tokens), len(tokens))
    assert torch.allclose(w, theirs, atol=1e-5, rtol=0)
    assert (w.triu(1) == 0).all()  # causal: nothing above the diagonal


@pytest.mark.slow
def test_a_hugging_face_llama_folder_loads_the_same_model(model, hf, tmp_path) -> None:
    """What transformers read from the GGUF file, written as a Hugging Face folder
    (config.json, model.safetensors, tokenizer.json + its config): qkv loads that folder into
    the same decoder, logits and chat template included. (transformers refuses to
    save_pretrained a GGUF-loaded model, so the folder is written here.)"""
    import json

    from safetensors.torch import save_file

    import qkv.models

    conf = hf[0].config.to_dict()
    conf.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    state = {k: v.contiguous() for k, v in hf[0].state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))  # tied: the head is the embedding
    hf[1].save_pretrained(tmp_path)
    folder = qkv.models.load(tmp_path)
    assert isinstance(folder, qkv.models.TextDecoder)
    assert folder.config.n_kv_heads == 3 and folder.config.tie_embeddings
    text = model.chat_prompt(CHAT)
    assert folder.chat_prompt(CHAT) == text
    ids = model.tokenize(text).input_ids
    assert torch.equal(folder.tokenize(text).input_ids, ids)
    with torch.inference_mode():
        assert (folder(ids).logits - model(ids).logits).abs().max() <= 1e-5
