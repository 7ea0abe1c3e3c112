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

__all__ = ["PRE_TOKENIZERS", "gguf_tokenizer", "token_id", "vocabulary"]

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
    tokens = vocabulary(meta, source)
    merges = _string_list(meta, "tokenizer.ggml.merges", source)
    types = _token_types(meta, len(tokens), source)
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A byte-level vocabulary spells every token in the byte alphabet; a token outside it
    # (a literal special written in plain text) is respelled byte by byte, as transformers does.
    vocab = {
        (t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    pairs = _merge_pairs(merges, vocab, source)
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # the tokenizers library raises bare Exception
        raise ValueError(
            f"{source}: the tokenizer.ggml.* metadata does not make a BPE tokenizer ({e}); the "
            f"file is corrupt"
        ) from None
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
    bos = token_id(meta, "tokenizer.ggml.bos_token_id", len(tokens), source)
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)]
        )
    return tok


def vocabulary(meta: dict[str, Any], source: str) -> list[str]:
    """``tokenizer.ggml.tokens``: a non-empty list of strings."""
    tokens = _string_list(meta, "tokenizer.ggml.tokens", source)
    if not tokens:
        raise ValueError(
            f"{source} has no tokenizer.ggml.tokens (the vocabulary); a GGUF model file "
            f"carries its tokenizer"
        )
    return tokens


def token_id(meta: dict[str, Any], key: str, n_tokens: int, source: str) -> int | None:
    """The special token id at ``key`` (None when absent), refused unless it is a token of the
    vocabulary: an id past it would be an IndexError, or a wrong token, later."""
    i = meta.get(key)
    if i is None:
        return None
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_tokens:
        raise ValueError(
            f"{source}: {key} = {i!r} is not a token of the vocabulary, which has {n_tokens} "
            f"tokens (ids 0..{n_tokens - 1}); the file is corrupt"
        )
    return i


def _string_list(meta: dict[str, Any], key: str, source: str) -> list[str]:
    value = meta.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{source}: {key} must be an array of strings, got {_kind(value)}")
    return value


def _token_types(meta: dict[str, Any], n_tokens: int, source: str) -> list[int]:
    key = "tokenizer.ggml.token_type"
    types = meta.get(key, [])  # may be absent: no token is special then
    if not isinstance(types, list) or not all(isinstance(t, int) for t in types):
        raise ValueError(f"{source}: {key} must be an array of integers, got {_kind(types)}")
    if types and len(types) != n_tokens:
        raise ValueError(
            f"{source}: {key} has {len(types)} entries for {n_tokens} tokens; it needs one per "
            f"token of tokenizer.ggml.tokens"
        )
    return types


def _merge_pairs(merges: list[str], vocab: dict[str, int], source: str) -> list[tuple[str, str]]:
    """BPE merges ("a b"), each two tokens of the vocabulary whose join is one too. Checked
    here because the tokenizers library fails on them with a bare Exception, and for some
    vocabularies with a Rust panic (``PanicException``, not even an ``Exception``: seen for
    vocab {"a", "b"} and the merge "a b"). 0.05 s for SmolLM2's 48900 merges."""
    pairs = []
    for i, m in enumerate(merges):
        a, sep, b = m.partition(" ")
        if not sep or not a or not b or a + b not in vocab or a not in vocab or b not in vocab:
            raise ValueError(
                f"{source}: tokenizer.ggml.merges[{i}] = {m!r} is not two tokens of the "
                f"vocabulary separated by a space whose join is a token too; the file is corrupt"
            )
        pairs.append((a, b))
    return pairs


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    return f"{type(value).__name__} {str(value)[:40]!r}"
