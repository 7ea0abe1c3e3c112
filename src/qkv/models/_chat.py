"""The chat prompt, from the model's own Jinja chat template (GGUF ``tokenizer.chat_template``
or ``tokenizer_config.json``'s ``chat_template``).

Rendered the way transformers' ``apply_chat_template`` does (a sandboxed Jinja environment
with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and the special tokens as
variables), so a template written for it gives the same text here.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

__all__ = ["ChatTemplate", "Message"]

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": "..."}


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str | None, *, bos_token: str, eos_token: str) -> None:
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: str | list[Message], *, add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (a user message as a string, or a list of
        ``{"role", "content"}`` dicts), ending with the assistant's turn opened."""
        if self.source is None:
            raise ValueError(
                "this model has no chat template (tokenizer.chat_template); call generate "
                "without chat=True and write the prompt yourself"
            )
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
            for m in messages
        ):
            raise TypeError(
                "chat messages must be a string or a list of {'role': ..., 'content': ...} dicts"
            )
        out = _compile(self.source).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        return str(out)
