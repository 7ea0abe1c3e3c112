"""Whether dynamo can trace a user's mod, asked on real tensors outside any trace.

Under ``torch.compile(fullgraph=True)`` a mod dynamo cannot trace (a Python ``if`` on a
tensor's value, ``print``, ``.tolist()`` of floats) fails the whole compile with dynamo's
own report, which names the mod's line among qkv's frames. qkv asks first: while dynamo
traces, :func:`refuse_under_fullgraph` runs eagerly (from the convention decision, which
dynamo calls outside the trace) and compiles the mod alone on probe tensors, once per mod.
If that fails and the trace is fullgraph, it raises dynamo's ``UserError`` (the type dynamo
passes on as it is, meant for code valid in eager that dynamo cannot trace) with one line:
the mod, where it failed, why, and the fix. Without fullgraph nothing is raised: dynamo
breaks the graph inside the mod and runs that part eagerly, which is right.

:func:`qkv.plan` says the same in a note (:func:`untraceable`), so a mod can be checked
before anything is compiled. ``import qkv`` imports no dynamo: these functions import it
when they are called.
"""

from __future__ import annotations

import contextlib
import os
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._core.checks import callable_name

Tensor = torch.Tensor

# Per mod (weakly: a mod garbage-collected takes its entry with it), per (kind, device type,
# convention): None (dynamo traces it) or why not, in words.
_verdicts: weakref.WeakKeyDictionary[Any, dict[tuple[str, str, bool], str | None]] = (
    weakref.WeakKeyDictionary()
)


def _calling(call: Callable[..., Any]) -> Callable[..., Any]:
    """A new function that calls ``call``, with a code object of its own: dynamo keeps what
    it compiled on the code object, so a shared one would gather entries from every check
    (and stop compiling past its recompile limit). Garbage-collected with its entries."""

    def through(*args: Tensor) -> Any:
        return call(*args)

    return types.FunctionType(
        through.__code__.replace(), through.__globals__, "qkv_trace_check", None,
        through.__closure__,
    )  # fmt: skip


def _reason(e: BaseException) -> str:
    """Where and why dynamo stopped, from its report: the innermost user line and the
    report's explanation (else its first line)."""
    text = str(getattr(e, "msg", None) or e)
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    why = next((s[len("Explanation:") :].strip() for s in lines if s.startswith("Explanation:")),
               lines[0] if lines else type(e).__name__)  # fmt: skip
    frame = getattr(e, "innermost_user_frame_summary", None)
    if frame is None:
        return why.rstrip(". ")
    where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
    code = (frame.line or "").strip()
    return f"at {where} (`{code}`): {why.rstrip('. ')}" if code else f"at {where}: {why}"


def untraceable(
    kind: str, fn: Any, call: Callable[..., Any], args: tuple[Tensor, ...]
) -> str | None:
    """Why dynamo cannot trace ``call`` (``fn`` as qkv calls it: itself, or through vmap) on
    ``args``, or None if it can. Compiled alone with fullgraph once per mod, kind, device
    type and convention (~0.1 s); a mod qkv runs through vmap is compiled on one element
    (0-d tensors, what vmap gives it), not through vmap's levels. Only dynamo's own refusals
    count (any other error is the mod's, and the call itself raises it)."""
    key = (kind, args[0].device.type, call is fn)
    try:
        known = _verdicts.get(fn, {})
    except TypeError:  # not weakly referenceable: asked every time
        known = {}
    if key in known:
        return known[key]
    import torch._dynamo.exc as dexc

    why: str | None = None
    if call is not fn:  # through vmap: one element (dynamo traces vmap's levels slowly: ~6 s)
        call, args = fn, tuple(a.reshape(-1)[0] for a in args)
    try:
        with torch.no_grad():
            torch.compile(_calling(call), fullgraph=True, backend="eager")(*args)
    except (dexc.Unsupported, dexc.UserError) as e:
        why = _reason(e)
    except Exception:  # the mod's own error, raised where qkv calls it
        why = None
    with contextlib.suppress(TypeError):  # not weakly referenceable: not kept
        _verdicts.setdefault(fn, {})[key] = why
    return why


def _fullgraph() -> bool:
    """Whether the trace under way refuses graph breaks (``fullgraph=True``); False when it
    cannot be told."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        return bool(tx.one_graph or tx.error_on_graph_break)
    except Exception:
        return False


def refuse_under_fullgraph(
    kind: str, fn: Any, call: Callable[..., Any], args: tuple[Tensor, ...]
) -> None:
    """While dynamo traces with fullgraph: raise one line naming ``fn`` and why dynamo cannot
    trace it, rather than dynamo's report from deep inside qkv. Run eagerly, outside the
    trace (see the module's text)."""
    if not _fullgraph():
        return
    why = untraceable(kind, fn, call, args)
    if why is None:
        return
    from torch._dynamo.exc import UserError, UserErrorType

    error = UserError(UserErrorType.DYNAMIC_CONTROL_FLOW, message(kind, fn, why))
    # dynamo appends the traced stack ("from user code"): the caller's frames, not qkv's
    stack = getattr(error, "real_stack", None)
    if stack is not None:
        error.real_stack = type(stack).from_list([f for f in stack if not _in_qkv(f.filename)])
    raise error


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the qkv package


def _in_qkv(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_ROOT + os.sep)


def message(kind: str, fn: Any, why: str) -> str:
    """The one line for a mod dynamo cannot trace (the fullgraph error and qkv.plan's note)."""
    return (
        f"{kind} {callable_name(fn)} cannot be traced by torch.compile, {why}. Under "
        f"fullgraph=True qkv cannot run it: make it traceable (a condition on tensor values "
        f"as torch.where; no print, no Python reads of tensor values) or compile without "
        f"fullgraph=True, where it runs eagerly behind a graph break"
    )
