"""The decoding loop: prefill once into a :class:`qkv.KVCache` per layer, then one token per
step; greedy at ``temperature=0``, else temperature + nucleus (top-p) sampling.

Batched prompts are left-padded to one length, so that every row's next token is at the same
column; the padding is masked as keys (:class:`~qkv.models.LlamaDecoder`'s ``starts``). RoPE
then places row ``b``'s tokens ``starts[b]`` positions later than alone, which changes no
score: RoPE scores depend on positions only through their difference.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ._llama_step import Stepper
from .llama import LlamaDecoder

Tensor = torch.Tensor

__all__ = ["Sampling", "StopText", "decode_tokens"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (checked once, at the door)."""

    max_new_tokens: int  # the most tokens to generate per prompt
    temperature: float  # 0 = greedy (argmax); > 0 divides the logits before sampling
    top_p: float  # nucleus sampling: the smallest set of tokens whose probability >= top_p
    seed: int | None  # seeds a torch.Generator of its own (None: torch's global generator)

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {n!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:
            raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus cut), got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise TypeError(f"seed must be an int or None, got {type(s).__name__}")


def _pick(logits: Tensor, s: Sampling, gen: torch.Generator | None) -> Tensor:
    """The next token of each row: ``logits [B, vocab]`` → ``[B]`` int64."""
    if s.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)  # [B, V]
    if s.top_p < 1:
        p_sorted, order = probs.sort(dim=-1, descending=True)  # [B, V]
        # Keep a token if the mass before it is below top_p: the first one always stays.
        drop = (p_sorted.cumsum(dim=-1) - p_sorted) >= s.top_p  # [B, V]
        p_sorted = p_sorted.masked_fill(drop, 0.0)
        choice = torch.multinomial(p_sorted, 1, generator=gen)  # [B, 1] (renormalises)
        return order.gather(-1, choice)[:, 0]
    return torch.multinomial(probs, 1, generator=gen)[:, 0]


def decode_tokens(
    decoder: LlamaDecoder, prompts: list[list[int]], s: Sampling, *, pad_id: int
) -> Iterator[Tensor]:
    """Yield the next token of every row ``[B]``, ``s.max_new_tokens`` times at most (fewer
    where the context ends). The caller stops iterating when it has what it wants."""
    B, L = len(prompts), max(len(p) for p in prompts)
    steps = min(s.max_new_tokens, decoder.config.max_positions - L)
    if steps <= 0:
        return
    dev = decoder.embed.weight.device
    ids = torch.full((B, L), pad_id, dtype=torch.int64)  # [B, L] left-padded
    for b, p in enumerate(prompts):
        ids[b, L - len(p) :] = torch.tensor(p, dtype=torch.int64)
    starts = torch.tensor([L - len(p) for p in prompts], device=dev)  # [B]
    pad = starts if bool((starts > 0).any()) else None  # unpadded: plain causal, the fast path
    gen = None
    if s.seed is not None:
        gen = torch.Generator(device=dev).manual_seed(s.seed)
    caches = decoder.new_caches(L + steps)
    stepper = Stepper(decoder)
    with torch.inference_mode():
        logits = decoder(ids.to(dev), caches=caches, starts=pad, last_only=True).logits
        for step in range(steps):
            tok = _pick(logits[:, -1], s, gen)  # [B]
            yield tok
            if step + 1 < steps:
                if pad is None and stepper.can_step(caches):  # the same logits, less Python
                    logits = stepper(tok[:, None], caches)
                else:
                    logits = decoder(tok[:, None], caches=caches, starts=pad, last_only=True).logits


class StopText:
    """Incremental detokenisation of one row with stop strings: ``push(ids)`` returns the text
    that is safe to show now. Text that could still become a stop string, or an incomplete
    UTF-8 character, is held back until the next token decides it."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]) -> None:
        self._decode = decode
        self.stop = stop
        self.shown = ""  # text handed out so far
        self.text = ""  # the whole decoded text, cut at a stop string once one is seen
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        text = self._decode(ids)
        for st in self.stop:
            at = text.find(st)
            if at >= 0:
                text, self.stopped = text[:at], True
        self.text = text
        safe = len(text)
        if not self.stopped:
            if text.endswith("\ufffd"):  # a multi-byte character split across tokens
                safe = len(text.rstrip("\ufffd"))
            for st in self.stop:  # hold back a tail that is the start of a stop string
                for k in range(min(len(st) - 1, safe), 0, -1):
                    if text[safe - k : safe] == st[:k]:
                        safe -= k
                        break
        piece = text[len(self.shown) : max(safe, len(self.shown))]
        self.shown += piece
        return piece

    def flush(self) -> str:
        """At the end: whatever was held back (a stop string's start that never completed)."""
        piece = self.text[len(self.shown) :]
        self.shown += piece
        return piece
