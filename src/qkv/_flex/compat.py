"""FlexAttention's calling convention for mask_mods and score_mods, inside qkv's.

qkv calls a mod once per tile with broadcastable int64 index tensors (``b [B,1,1,1]``,
``h [1,H,1,1]``, ``q_idx [1,1,Lq,1]``, ``kv_idx [1,1,1,Lk]``). FlexAttention calls it under
nested ``torch.vmap`` with 0-d indices (``_vmap_for_bhqkv`` in
``torch/nn/attention/flex_attention.py``), so mods written for it may index twice
(``table[q_idx][kv_idx]``) or take ``torch.dot(Q[q_idx], K[kv_idx])``: under broadcasting
those raise or return the wrong shape. Each user mod is classified once per call:

- it works under broadcasting: it is called as it is (unless its result depends on the rest
  of the tile, a reduction such as ``.sum()`` without a dim that vmap takes per element:
  a few positions are checked alone);
- it works only under vmap: a :class:`ModCall` gives it the broadcast convention and
  evaluates exactly the tile it is given through nested vmaps (:func:`vmap_grid`);
- neither: a ``ValueError`` with both errors and both conventions.

A mask_mod is probed on a few real positions when the call is validated. A score_mod is
decided on its first real call instead, as qkv promises a score_mod only ever sees real
scores (``tests/test_blocksparse.py::test_score_mod_sees_only_real_scores``); so is a
mask_mod given to ``qkv.block_mask``, which evaluates each position exactly once.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._core.checks import broadcastable, callable_name, check_mask_result, check_score_result
from .._core.tracing import assume_constant_result, is_symbolic
from .._core.usermod import UserMod
from .traceable import refuse_under_fullgraph

Tensor = torch.Tensor

_FLEX = "torch.nn.attention.flex_attention"


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {text.rstrip('. ')}"


def _is_qkv(obj: Any) -> bool:
    """qkv's own mods (built-ins, wrappers, block masks): never probed nor wrapped."""
    mod = getattr(obj, "__module__", None) or ""
    return mod == "qkv" or mod.startswith("qkv.") or hasattr(obj, "_check_problem")


def vmap_grid(fn: Callable[..., Any], args: tuple[Tensor, ...], empty: torch.dtype) -> Tensor:
    """``fn`` evaluated per element under nested ``torch.vmap`` over the broadcast grid
    ``[n0, n1, n2, n3]`` of ``args`` (each at most 4-D, dims of 1 broadcast).

    As FlexAttention does, one vmap level per dim; but an argument is mapped only along the
    dims where it has more than one entry, so ``table[q_idx]`` gathers ``[n2, ...]``, not
    ``[n0, n1, n2, n3, ...]``, and nothing is expanded beyond the grid it is given. What
    the mod gathers is its own: ``bias[h][q_idx][kv_idx]`` on a ``[H, Lq, Lk]`` bias copies
    ``bias[h]`` (all of it) for every tile: 27-43x a broadcast ``bias[h, q_idx, kv_idx]`` on a
    ``[2, 8, 128, 128]`` tile at Lq = Lk = 1024 (measured; eager vmap gathers where
    FlexAttention's compiled kernels load).
    """
    args4 = [a.reshape((1,) * (4 - a.ndim) + tuple(a.shape)) for a in args]  # 4-D views
    grid = torch.broadcast_shapes(*(a.shape for a in args4))
    if 0 in grid:
        return torch.zeros(grid, dtype=empty, device=args4[0].device)
    mapped = [d for d in range(4) if grid[d] > 1]
    f = fn
    for d in reversed(mapped):  # the innermost vmap maps the last dim
        f = torch.vmap(f, in_dims=tuple(0 if a.shape[d] > 1 else None for a in args4))
    out = f(*(a.reshape([n for n in a.shape if n > 1]) for a in args4))  # unmapped dims gone
    if not isinstance(out, Tensor):
        raise TypeError(f"returned {type(out).__name__} for one element, not a 0-d tensor")
    if out.shape[len(mapped) :] != ():
        raise ValueError(f"returned shape {tuple(out.shape[len(mapped) :])} for one element")
    return out.reshape(grid)


class _SameError(Exception):
    """The mod raised the very same error under both conventions: its own bug, which the
    caller shows as it is (not a convention problem)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _close(a: Tensor, b: Tensor) -> bool:
    if a.dtype == torch.bool or b.dtype == torch.bool:
        return torch.equal(a.bool(), b.bool())
    return torch.allclose(a.to(b.dtype), b, rtol=1e-4, atol=1e-6, equal_nan=True)


def _at(a: Tensor, i: int, j: int) -> Tensor:
    """``a`` (broadcastable to a 4-D tile) at query ``i`` and key ``j`` of the tile, every
    b and h kept (a score_mod only ever sees real scores: these are)."""
    if a.ndim < 4:
        a = a.reshape((1,) * (4 - a.ndim) + tuple(a.shape))
    rows = slice(i, i + 1) if a.shape[2] > 1 else slice(None)  # a dim of 1 broadcasts
    keys = slice(j, j + 1) if a.shape[3] > 1 else slice(None)
    return a[:, :, rows, keys]


def _tile_free(fn: Any, args: tuple[Tensor, ...], full: Tensor) -> bool:
    """False if ``full`` (``fn`` under broadcasting on the tile of ``args``) depends on the
    rest of the tile: a reduction over it (``.sum()`` without a dim), which vmap would have
    taken per element. One value for the whole tile is checked against vmap; otherwise the
    first and last (query, key) of the tile against ``fn`` evaluated on each alone. (Two
    calls: certain for a score_mod's floats, likely for a mask's bools.)"""
    if full.stride() == (0,) * full.ndim and full.numel() > 1:  # a constant, or a reduction
        try:
            return _close(vmap_grid(fn, args, full.dtype), full)
        except Exception:  # vmap cannot say otherwise
            return True
    for i, j in {(0, 0), (full.shape[2] - 1, full.shape[3] - 1)}:
        want = _at(full, i, j)
        try:
            got = torch.as_tensor(fn(*(_at(a, i, j) for a in args)), device=full.device)
            if not _close(got.expand_as(want), want):
                return False
        except Exception:  # it may need a larger tile: nothing to say then
            continue
    return True


def _decide(
    kind: str, fn: Any, args: tuple[Tensor, ...], alone: bool = True
) -> tuple[Any, str | None]:
    """Call ``fn(*args)`` under broadcasting, else under vmap. Returns ``(result, why)``:
    ``why`` is None when broadcasting works, else why not (``result`` then came from vmap).
    ``alone``: also check the broadcast result at a few positions alone (:func:`_tile_free`).
    Raises :class:`_SameError` when both fail alike, the usual ``TypeError`` for a result
    of the wrong type, and a ``ValueError`` when neither convention works."""
    dims = [(1,) * (4 - a.ndim) + tuple(a.shape) for a in args]
    grid = tuple(max(n) for n in zip(*dims, strict=True))  # they broadcast (qkv's callers)
    mask = kind == "mask_mod"
    check = check_mask_result if mask else check_score_result
    extra = () if mask else (args[0].dtype,)
    b_err, out = None, None
    try:
        out = fn(*args)
    except Exception as e:  # any error of the mod: try the other way
        b_err, b_text = e, f"raised {_first_line(e)}"
    else:
        if mask and isinstance(out, bool):
            return out, None  # a constant
        if not isinstance(out, Tensor) or not (
            out.dtype == torch.bool if mask else out.is_floating_point()
        ):
            check(out, fn, grid, *extra)  # the usual TypeError
        if broadcastable(tuple(out.shape), grid):
            if not alone or _tile_free(fn, args, out.expand(grid)):
                return out, None
            b_text = "returned values that depend on the rest of the tile (a reduction over it)"
        else:
            b_text = f"returned shape {tuple(out.shape)}"
            try:
                check(out, fn, grid, *extra)
            except ValueError as e:  # the usual words
                b_text = f"failed: {e}"
    try:
        per = vmap_grid(fn, args, torch.bool if mask else args[0].dtype)
    except Exception as e:
        if b_err is not None and type(e) is type(b_err) and str(e) == str(b_err):
            raise _SameError(b_err) from b_err
        if isinstance(out, Tensor) and broadcastable(tuple(out.shape), grid):
            return out, None  # it broadcasts, and vmap cannot say otherwise (e.g. randomness)
        v_text = f"raised {_first_line(e)}"
    else:
        check(per, fn, grid, *extra)  # the usual TypeError for a result of the wrong dtype
        return per, f"under broadcasting it {b_text}"
    names = ("b", "h", "q_idx", "kv_idx") if mask else ("score", "b", "h", "q_idx", "kv_idx")
    shapes = ", ".join(f"{n} {list(a.shape)}" for n, a in zip(names, args, strict=True))
    want = "a bool tensor (True = may attend)" if mask else "a float tensor"
    raise ValueError(
        f"{kind} {callable_name(fn)} works under neither calling convention. qkv calls it with "
        f"broadcastable tensors ({shapes}) and needs {want} broadcastable to {list(grid)}: "
        f"there it {b_text}. FlexAttention calls it under torch.vmap with 0-d tensors, one "
        f"element at a time: there it {v_text}. Make one of them work: broadcasting "
        f"(table[q_idx, kv_idx] and torch.where, not table[q_idx][kv_idx] or torch.dot), or "
        f"per element (no .item(), int(), or Python if/and/or on the index tensors)"
    )


def _probe(B: int, H: int, Lq: int, Lk: int, device: torch.device) -> tuple[Tensor, ...]:
    """Index tensors of a few real positions per dim (both ends and the middle), as qkv
    passes them: ``b [<=4,1,1,1]``, ``h [1,<=4,1,1]``, ``q_idx [1,1,<=4,1]``, ``kv_idx``.
    A size that is symbolic while dynamo traces gets positions 0 and 1 (dynamo takes such a
    size to be at least 2): positions computed from it would guard on its value, and the
    graph would serve that one length."""
    pos = [
        [0, 1] if is_symbolic(n) else sorted(i for i in {0, 1, n // 2, n - 1} if 0 <= i < n)
        for n in (B, H, Lq, Lk)
    ]
    return tuple(
        torch.tensor(p, device=device).view([-1 if d == i else 1 for d in range(4)])
        for i, p in enumerate(pos)
    )


class ModCall(UserMod):
    """A user mod called with qkv's broadcast convention: directly where broadcasting works
    for it, else per element through :func:`vmap_grid`. Decided when made (``why`` given)
    or, made with ``decided=False``, on its first call."""

    def __init__(self, kind: str, fn: Callable[..., Any], why: str | None, decided: bool) -> None:
        super().__init__(fn, why, decided)
        self.role = kind  # "mask_mod" or "score_mod": how it is called and named

    def __call__(self, *args: Tensor) -> Any:
        if torch.compiler.is_compiling():  # (a block mask's mod: not adopted in this trace)
            traced_convention(self.role, self.fn, args[0].device.type)  # fullgraph's check
        if not self.decided:
            try:
                # qkv.block_mask evaluates a mask at each position exactly once: a mask_mod
                # decided on its first tile is not evaluated again at positions alone.
                # While dynamo traces, values cannot be compared: decided by what
                # broadcasting returns, and not remembered for eager calls.
                tracing = torch.compiler.is_compiling()
                alone = self.role == "score_mod" and not tracing
                out, self.why = _decide(self.role, self.fn, args, alone)
            except _SameError as e:  # its own bug: raised as it is
                raise e.error from None
            self.decided = True
            if alone:  # a full decision (a lazy mask's skips the check of positions alone)
                _remember(self.role, self.fn, args[0].device.type, self.why)
            return out
        if self.why is None:
            return self.fn(*args)
        return vmap_grid(self.fn, args, torch.bool if self.role == "mask_mod" else args[0].dtype)

    @property
    def __name__(self) -> str:
        return callable_name(self.fn)

    def __repr__(self) -> str:
        return callable_name(self.fn) + ("" if self.why is None else " (through torch.vmap)")


def mask_mod_convention(
    fn: Any, B: int, H: int, Lq: int, Lk: int, device: torch.device
) -> Callable[..., Any]:
    """``fn`` itself when it works under broadcasting, else a :class:`ModCall` through vmap;
    raises (see :func:`_decide`) when it works neither way. Probed on a few real positions,
    once per function and device type: the convention a function's code needs does not
    change between calls, and the probe cost ~100-300 us a call (measured on a
    [1, 4, 64, 16] problem, where attention itself takes ~100 us)."""
    if device.type == "meta" or B * H * Lq * Lk == 0:
        return fn  # nothing to evaluate (qkv.plan on meta tensors, empty problems)
    known = _known("mask_mod", fn, device.type)
    if known is not None:
        return known
    if torch.compiler.is_compiling():
        why = traced_convention("mask_mod", fn, device.type)
        if why == _IN_TRACE:
            # A closure made inside the compiled function: comparing values there would be
            # data-dependent, so the trace decides by what broadcasting returns (an error or
            # a wrong shape: vmap), and remembers nothing.
            try:
                _, why = _decide("mask_mod", fn, _probe(B, H, Lq, Lk, device), alone=False)
            except _SameError:
                return fn
        return fn if why is None else ModCall("mask_mod", fn, why, decided=True)
    try:
        _, why = _decide("mask_mod", fn, _probe(B, H, Lq, Lk, device))
    except _SameError:  # its own bug: it surfaces where it always did, after the input checks
        return fn
    _remember("mask_mod", fn, device.type, why)
    return fn if why is None else ModCall("mask_mod", fn, why, decided=True)


# What traced_convention answers when the trace itself must decide.
_IN_TRACE = "decided in the trace"


def traced_convention(kind: str, fn: Any, device_type: str) -> str | None:
    """While dynamo traces: a user mod's convention (``None``: broadcasting works, else why it
    needs vmap) decided on real tensors outside the trace, or :data:`_IN_TRACE`.

    Inside the trace a mod that only works under vmap fails when it is tried under
    broadcasting: its error is raised by dynamo's shape propagation, which no ``except`` in
    traced code catches. So a function that exists outside the trace (defined at module level,
    or passed in) is decided by :func:`_convention_outside`, which dynamo calls eagerly and
    whose answer it takes as a constant. A closure made inside the compiled function has no
    object outside the trace (dynamo could not pass it out): the trace decides it."""
    try:
        fn.__closure__  # noqa: B018 (a closure made in the trace has none to read)
    except AttributeError:
        return _IN_TRACE
    return _convention_outside(kind, fn, device_type)


@assume_constant_result
def _convention_outside(kind: str, fn: Any, device_type: str) -> str | None:
    """:func:`_decide` on real probe tensors (positions 0 and 1 of the query and key axes, on
    ``device_type``); :data:`_IN_TRACE` when the mod fails both ways there (its error is then
    raised where the trace calls it). Under fullgraph, a mod dynamo cannot trace is refused
    here in one line (:mod:`qkv._flex.traceable`)."""
    device = torch.device(device_type)
    probe = _probe(1, 1, 2, 2, device)
    args = probe if kind == "mask_mod" else (torch.zeros(1, 1, 2, 2, device=device), *probe)
    try:
        why = _decide(kind, fn, args, alone=kind == "score_mod")[1]
    except Exception:
        return _IN_TRACE
    call = fn if why is None else ModCall(kind, fn, why, decided=True)
    refuse_under_fullgraph(kind, fn, call, args)
    return why


# A user mod's convention per (kind, device type), decided once: None (broadcasting works) or
# why it needs vmap. Weak keys: a mod garbage-collected takes its entry with it.
_decided: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], str | None]] = (
    weakref.WeakKeyDictionary()
)


def _known(kind: str, fn: Any, device_type: str) -> Any:
    """What to call for ``fn`` if its convention was decided before, else ``None``. Not read
    while dynamo traces: it would guard on the weak dictionary's keys, which change whenever
    another mod is garbage-collected (a recompile, or a failed guard if that happens during
    the trace); the trace decides by what broadcasting returns."""
    if torch.compiler.is_compiling():
        return None
    try:
        known = _decided.get(fn)
    except TypeError:  # unhashable, or not weakly referenceable: decided every call
        return None
    if known is None or (kind, device_type) not in known:
        return None
    why = known[(kind, device_type)]
    return fn if why is None else ModCall(kind, fn, why, decided=True)


def _remember(kind: str, fn: Any, device_type: str, why: str | None) -> None:
    with contextlib.suppress(TypeError):  # a callable that cannot be weakly referenced
        _decided.setdefault(fn, {})[(kind, device_type)] = why


def adopt_mask(
    mask: Any, device: torch.device, target: tuple[int, int, int, int], *, lazy: bool = False
) -> Any:
    """What the door keeps of a non-tensor mask: a vmap-only mask_mod wrapped, anything else
    unchanged. ``lazy`` decides on the first tile instead of probing (``qkv.block_mask``)."""
    if lazy:
        return _adopt(mask, lambda fn: ModCall("mask_mod", fn, None, decided=False))
    return _adopt(mask, lambda fn: mask_mod_convention(fn, *target, device))


def is_flex_block_mask(obj: object) -> bool:
    """True for a FlexAttention ``BlockMask`` (``qkv._flex.blockmask`` converts it)."""
    flex = sys.modules.get(_FLEX)  # loaded if the caller built a FlexAttention BlockMask
    return flex is not None and isinstance(obj, flex.BlockMask)


def adopt_score_mod(score_mod: Any, device: torch.device) -> Any:
    """What the door keeps of a callable: a user score_mod as decided on an earlier call on
    this device type, else in a :class:`ModCall` that decides on its first (real) call;
    qkv's own unchanged."""

    def wrap(fn: Any) -> Any:
        if torch.compiler.is_compiling():
            why = traced_convention("score_mod", fn, device.type)
            if why != _IN_TRACE:
                return fn if why is None else ModCall("score_mod", fn, why, decided=True)
        known = _known("score_mod", fn, device.type)
        return known if known is not None else ModCall("score_mod", fn, None, decided=False)

    return _adopt(score_mod, wrap)


def _adopt(obj: Any, wrap: Callable[[Any], Any]) -> Any:
    """``wrap`` a user callable, also inside qkv's combinations (``and_masks``) and its
    absolute-position wrappers (KV cache), which call user mods with qkv's convention."""
    if not callable(obj) or isinstance(obj, Tensor):
        return obj
    if not _is_qkv(obj):
        return wrap(obj)
    # the parts of qkv._core.combinations.Combined, qkv._positions.MaskAt and ScoreAt
    for attr in ("mods", "mod"):
        inner = getattr(obj, "__dict__", {}).get(attr)
        if inner is None:
            continue
        new = tuple(_adopt(m, wrap) for m in inner) if attr == "mods" else _adopt(inner, wrap)
        if any(a is not b for a, b in zip(_items(new), _items(inner), strict=True)):
            obj = copy.copy(obj)
            setattr(obj, attr, new)
    return obj


def _items(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)
