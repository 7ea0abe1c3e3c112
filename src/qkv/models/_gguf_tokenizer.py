"""A ``tokenizers.Tokenizer`` built from a GGUF file's vocabulary, merges and pre-tokenizer.

A GGUF file carries no ``tokenizer.json``: it stores llama.cpp's description of the tokenizer
(``tokenizer.ggml.model``, ``.pre``, ``.tokens``, ``.merges``, ``.token_type``, special ids).
For byte-level BPE (``model = "gpt2"``) this is enough to rebuild it exactly: a BPE model over
the vocabulary and merges, the pre-tokenizer split llama.cpp applies for ``pre`` (its
``llama-vocab.cpp``), GPT-2's byte-to-unicode mapping, and control tokens kept whole.
SentencePiece vocabularies (``model = "llama"``: Llama 2, TinyLlama) are not rebuilt yet and
are refused with that reason.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

__all__ = ["PRE_TOKENIZERS", "gguf_tokenizer"]

_GPT2 = "gpt2"
_LLAMA3 = "llama3"
# llama.cpp's pre-tokenizer names → which split. "smollm" is GPT-2's regex after splitting
# off every digit (llama-vocab.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: "\p{N}", then GPT-2's),
# which is also what SmolLM2's own tokenizer.json does (Digits(individual_digits) + ByteLevel).
PRE_TOKENIZERS = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "smollm": "smollm",
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type codes (llama.cpp's llama_token_attr)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (``bytes_to_unicode``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


def _pre_tokenizer(kind: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if kind == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def gguf_tokenizer(meta: dict[str, Any], source: str) -> Any:
    """The ``tokenizers.Tokenizer`` a GGUF file's ``tokenizer.ggml.*`` metadata describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{source} has a {kind!r} tokenizer; qkv rebuilds byte-level BPE tokenizers from "
            f"GGUF files (tokenizer.ggml.model = 'gpt2': SmolLM, Llama 3, ...), not SentencePiece "
            f"ones yet; load the model's Hugging Face folder (with tokenizer.json) instead"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{source}: pre-tokenizer {pre!r} is not one qkv knows; known: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges: list[str] = meta.get("tokenizer.ggml.merges", [])
    types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A byte-level vocabulary spells every token in the byte alphabet; a token outside it
    # (a literal special written in plain text) is respelled byte by byte, as transformers does.
    vocab = {
        (t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    pairs = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[pre])
    tok.decoder = decoders.ByteLevel()
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=False)  # token_type may be absent
        if ty == _CONTROL and set(t) <= spelled
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == _USER_DEFINED
    ]
    tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)]
        )
    return tok
