"""Subcommands of the ``qkv`` command (see ``qkv.cli``)."""

from __future__ import annotations

import sys
from collections.abc import Callable


def one_line_errors(
    command: str,
    body: Callable[[], int],
    install: str,
    refused: tuple[type[BaseException], ...] = (),
) -> int:
    """``body()``, or exit status 2 with one line on stderr and no traceback: a missing
    module names what to install (``install``), and a ValueError, TypeError or OSError (or a
    ``refused`` exception) prints the library's message, which already says what to do."""
    caught: tuple[type[BaseException], ...] = (*refused, ValueError, TypeError, OSError)
    try:
        return body()
    except ImportError as e:
        what = f"the module {e.name!r} is not installed" if e.name else str(e).rstrip(".")
        print(f"qkv {command}: error: {what}; {install}", file=sys.stderr)
        return 2
    except caught as e:
        msg = " ".join(str(e).split())  # one line, no traceback
        print(f"qkv {command}: error: {msg}", file=sys.stderr)
        return 2
