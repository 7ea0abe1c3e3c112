"""The ``qkv`` command. Each subcommand lives in its own module under ``qkv._cli`` and is
imported only when run, so ``qkv --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module under qkv._cli, one-line help). A module defines add_arguments(parser)
# and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "explain": ("explain", "what a token attends to in a real model, layer by layer"),
    "generate": ("generate", "stream text from a real decoder on qkv (SmolLM2-135M by default)"),
    "transcribe": ("transcribe", "speech to text with Whisper on qkv, word times with --words"),
    "walkthrough": ("walkthrough", "the formula step by step on a tiny example"),
    "plan": ("plan", "which backend qkv.attention would run for a shape and mask, and why"),
    "bench": ("bench", "time qkv against torch SDPA (and FlexAttention) over lengths and masks"),
    "build": ("build", "build qkv's compiled CPU kernels for this CPU now (a Dockerfile, CI)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkv", description="qkv: attention for PyTorch: exact, flexible, inspectable, fast."
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        importlib.import_module(f"qkv._cli.{module}").add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    mod = importlib.import_module(f"qkv._cli.{args._module}")
    try:
        return int(mod.run(args))
    except BrokenPipeError:  # `qkv ... | head` is not an error
        return 0
    except (ValueError, TypeError, FileNotFoundError, PermissionError) as e:
        print(f"qkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
