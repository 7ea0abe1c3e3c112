"""The loaded decoder: tokenizer + chat template + :class:`LlamaDecoder`, with the calls a
user makes (``tokenize``, ``generate``, ``stream``, ``attention_maps``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._chat import ChatTemplate, Message
from ._generate import Sampling, StopText, decode_tokens
from ._llama_config import LlamaConfig
from ._model import Tokens
from .llama import DecoderOutput, LlamaDecoder
from .quantized import LinearPath, QuantizedLinear

Tensor = torch.Tensor

__all__ = ["GenerationStats", "TextDecoder"]


class GenerationStats:
    """Speed of the last :meth:`TextDecoder.stream` / :meth:`TextDecoder.generate` call."""

    def __init__(self) -> None:
        self.prompt_tokens = 0  # tokens of the (longest) prompt, prefilled at once
        self.new_tokens = 0  # tokens decoded, per row
        self.prefill_s = 0.0  # time to the first new token (prefill + one pick)
        self.decode_s = 0.0  # time for the remaining new tokens

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.new_tokens - 1  # the first token came with the prefill
        return n / self.decode_s if n > 0 and self.decode_s > 0 else 0.0

    def __repr__(self) -> str:
        # a rate only where one was measured: "0.0 tokens/s" would read as a real speed
        prompt = f"prompt {self.prompt_tokens} tokens"
        if self.prefill_s > 0:
            prompt += f" at {self.prompt_tokens_per_s:.1f} tokens/s"
        decode = f"decode {self.new_tokens} tokens"
        if self.new_tokens > 1 and self.decode_s > 0:
            decode += f" at {self.decode_tokens_per_s:.1f} tokens/s"
        return f"{prompt}, {decode}"


class TextDecoder(nn.Module):
    """A Llama-family causal language model running on :class:`qkv.MultiHeadAttention`.

    Made by :func:`qkv.models.load` (``load("smollm2")``, a ``.gguf`` file or a Hugging Face
    Llama folder). Attributes: ``config`` (:class:`~qkv.models.LlamaConfig`), ``decoder``
    (the :class:`~qkv.models.LlamaDecoder`; ``decoder.layers[i].attention`` is layer ``i``'s
    :class:`qkv.MultiHeadAttention`), ``path``, ``last_stats`` (:class:`GenerationStats`),
    ``last_tokens`` (the token ids each prompt of the last call generated, end token excluded)
    and ``linear_path`` (:class:`~qkv.models.quantized.LinearPath`: whether the weight
    matrices multiply few-row inputs from the GGUF file's blocks with qkv's compiled kernel,
    or everything runs ``F.linear`` on float32 weights, and why; also in the repr).

    Calling the model, ``model(input_ids [B, L])``, gives logits ``[B, L, vocab]``;
    ``attention_maps(text)`` gives ``(tokens, weights [layers, heads, L, L])``.
    """

    causal = True  # a token attends to itself and earlier tokens only

    def __init__(
        self,
        config: LlamaConfig,
        tokenizer: Any,
        chat_template: ChatTemplate,
        *,
        eos_ids: tuple[int, ...],
        path: Path,
    ) -> None:
        super().__init__()
        self.config = config
        self.path = path
        self.eos_ids = eos_ids
        self.chat_template = chat_template
        self._tokenizer = tokenizer
        self.decoder = LlamaDecoder(config)
        self.last_stats = GenerationStats()
        self.last_tokens: list[list[int]] = []  # the new token ids of each row, last call
        self.linear_path = LinearPath(None, (), "no quantised blocks were loaded")

    @property
    def device(self) -> torch.device:
        return self.decoder.embed.weight.device

    def forward(self, input_ids: Tensor, **kw: Any) -> DecoderOutput:
        """Token ids ``[B, L]`` → :class:`DecoderOutput`; see :meth:`LlamaDecoder.forward`."""
        return self.decoder(input_ids, **kw)

    # ------------------------------------------------------------------------------ text

    def _ids(self, text: str) -> list[int]:
        _check_text(text, "prompt")
        return list(self._tokenizer.encode(text).ids)

    def tokenize(self, text: str) -> Tokens:
        """Tokenize one text (special tokens such as ``<|im_start|>`` are recognised).

        Returns :class:`~qkv.models.Tokens` ``(tokens, input_ids [1, L], attention_mask, offsets)``
        where ``tokens`` are the text pieces of the tokens (``["The", " cat", ...]``). A text
        longer than the context is refused with a ValueError giving the limit.
        """
        _check_text(text, "text")
        enc = self._tokenizer.encode(text)
        self._check_fits(len(enc.ids))
        ids = torch.tensor([enc.ids], dtype=torch.int64, device=self.device)  # [1, L]
        pieces = [self._tokenizer.decode([i], skip_special_tokens=False) for i in enc.ids]
        return Tokens(pieces, ids, torch.ones_like(ids), list(enc.offsets))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def chat_prompt(self, messages: str | list[Message]) -> str:
        """The model's chat template applied to ``messages`` (a user message, or a list of
        ``{"role", "content"}`` dicts), with the assistant's turn opened."""
        return self.chat_template.render(messages)

    def _check_fits(self, n_prompt: int) -> None:
        limit = self.config.max_positions
        if n_prompt > limit:
            raise ValueError(
                f"the prompt is {n_prompt} tokens but {self.config.name}'s context is {limit} "
                f"tokens; shorten it"
            )

    # ------------------------------------------------------------------------ generation

    def stream(
        self,
        prompt: str | list[Message],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        chat: bool = False,
    ) -> Iterator[str]:
        """Generate from one prompt, yielding the text as it is decoded (pieces; their
        concatenation is what :meth:`generate` returns).

        Args:
            prompt: the text to continue; with ``chat=True`` a user message (or a list of
                ``{"role", "content"}`` messages) wrapped in the model's chat template.
            max_new_tokens: the most tokens to generate; generation also ends at the model's
                end-of-turn token, at a ``stop`` string, or where the context is full.
            temperature: 0 (default) is greedy decoding; above 0, sampling at that temperature.
            top_p: nucleus sampling's probability mass (1 = off).
            seed: makes sampling reproducible (a generator of its own; None: torch's global).
            stop: a string (or strings) that ends generation; it is not part of the output.
            chat: wrap ``prompt`` in the chat template.

        The prompt is prefilled into one :class:`qkv.KVCache` per layer in one pass, then
        each new token costs one step over the cache. ``last_stats`` has the speed.
        """
        if not isinstance(prompt, str) and not chat:
            raise TypeError(
                "stream takes one prompt string; for several prompts at once use "
                "generate([...]), and for chat messages pass chat=True"
            )
        rows = [self._prompt_ids(prompt, chat)]
        yield from self._stream(rows, max_new_tokens, temperature, top_p, seed, stop, single=True)

    def generate(
        self,
        prompt: str | list[str],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        chat: bool = False,
    ) -> str | list[str]:
        """Generate a continuation of ``prompt`` (a string → a string), or of each of a list of
        prompts, batched in one pass per step (a list → a list of strings, in order). The
        options are those of :meth:`stream`.

        Example::

            >>> import qkv
            >>> model = qkv.models.load("smollm2")
            >>> model.generate("The capital of France is", max_new_tokens=2)
            ' Paris.'
            >>> prompts = ["The capital of France is", "1, 2, 3,"]
            >>> model.generate(prompts, max_new_tokens=6, stop=[".", " 6"])
            [' Paris', ' 4, 5,']
        """
        if isinstance(prompt, str):
            rows = [self._prompt_ids(prompt, chat)]
            return "".join(
                self._stream(rows, max_new_tokens, temperature, top_p, seed, stop, single=True)
            )
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise TypeError("prompt must be a string or a non-empty list of strings")
        rows = [self._prompt_ids(p, chat) for p in prompt]
        texts: list[str] = [""] * len(rows)
        for i, piece in self._stream(rows, max_new_tokens, temperature, top_p, seed, stop):
            texts[i] += piece
        return texts

    def _prompt_ids(self, prompt: Any, chat: bool) -> list[int]:
        if chat:
            prompt = self.chat_prompt(prompt)
        ids = self._ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token of text")
        self._check_fits(len(ids))
        return ids

    def _stream(
        self,
        rows: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop: str | list[str] | None,
        *,
        single: bool = False,
    ) -> Iterator[Any]:
        """Yield ``piece`` (single) or ``(row, piece)`` until every row has ended."""
        s = Sampling(max_new_tokens, float(temperature), float(top_p), seed)
        stops = _check_stop(stop)
        outs = [StopText(self.decode, stops) for _ in rows]
        new: list[list[int]] = [[] for _ in rows]
        self.last_tokens = new
        done = [False] * len(rows)
        stats = self.last_stats = GenerationStats()
        stats.prompt_tokens = max(len(r) for r in rows)
        pad = self.eos_ids[0] if self.eos_ids else 0
        t0 = time.perf_counter()
        t1 = t0
        was_training = self.training
        self.eval()
        try:
            for step, tok in enumerate(decode_tokens(self.decoder, rows, s, pad_id=pad)):
                if step == 0:
                    t1 = time.perf_counter()
                    stats.prefill_s = t1 - t0
                stats.new_tokens = step + 1
                for b, t in enumerate(tok.tolist()):
                    if done[b]:
                        continue
                    if t in self.eos_ids:
                        done[b] = True
                        continue
                    new[b].append(t)
                    piece = outs[b].push(new[b])
                    done[b] = outs[b].stopped
                    if piece:
                        yield piece if single else (b, piece)
                if all(done):
                    break
            for b, out in enumerate(outs):
                rest = "" if out.stopped else out.flush()
                if rest:
                    yield rest if single else (b, rest)
        finally:
            stats.decode_s = time.perf_counter() - t1
            self.train(was_training)

    # ----------------------------------------------------------------------- inspection

    @torch.inference_mode()
    def attention_maps(self, text: str) -> tuple[list[str], Tensor]:
        """Every layer's and head's attention weights over one text.

        Returns ``(tokens, weights)``: the L token pieces (as :meth:`tokenize`) and ``weights
        [n_layers, n_heads, L, L]`` (float32; row ``i`` of a head is what token ``i`` attends
        to, and sums to 1; zero above the diagonal: a causal model sees only earlier tokens).
        Equal to transformers' ``LlamaForCausalLM`` with ``attn_implementation="eager"`` and
        ``output_attentions=True``.
        """
        t = self.tokenize(text)
        was_training = self.training
        self.eval()
        try:
            out = self.decoder(t.input_ids, need_weights=True, last_only=True)
        finally:
            self.train(was_training)
        assert out.attentions is not None
        weights = torch.stack([w[0] for w in out.attentions]).float()  # [layers, H, L, L]
        return t.tokens, weights

    def quantize_activations(self, enabled: bool = True) -> TextDecoder:
        """Multiply few-row inputs (decoding) by the GGUF blocks with the inputs quantised to
        8-bit blocks of 32 and integer dot products, as llama.cpp does (``enabled=True``), or
        exactly in float32, the default (``False``). Returns the model.

        Faster (benchmarks/RESULTS.md: SmolLM2 Q4_1 at one thread), but not exact: each input
        value moves by up to half a step of its block's 8-bit scale, logits by ~0.1, and
        greedy decoding can pick another of two near-tied tokens. The exact path stays the
        default so that the model's logits match float32 implementations of its weights.
        Needs the compiled GGUF kernel (``linear_path`` says whether it runs); many-row
        inputs (a prompt of more than ``quantized.MAX_ROWS`` tokens) stay float32 either way.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        layers = [m for m in self.decoder.modules() if isinstance(m, QuantizedLinear)]
        if enabled and not layers:
            raise RuntimeError(
                f"quantize_activations needs qkv's compiled kernel on GGUF blocks; this model "
                f"runs {self.linear_path}"
            )
        for m in layers:
            m.int8_activations = enabled
        self.linear_path = replace(self.linear_path, int8_activations=enabled and bool(layers))
        return self

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"name={c.name!r}, layers={c.n_layers}, heads={c.n_heads}/{c.n_kv_heads} (q/kv), "
            f"d_model={c.d_model}, context={c.max_positions},\nlinear: {self.linear_path}"
        )


def _check_text(text: object, name: str) -> None:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str, got {type(text).__name__}")


def _check_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise TypeError("stop must be a non-empty string or a list of non-empty strings")
    return tuple(stop)
