"""``qkv.inspect.record(model)``: capture what every qkv attention call inside a model saw.

How it works: ``qkv.attention`` reads one ContextVar (``qkv._recording.ACTIVE``) per call.
While a recording is active it asks its backend for the lse as well (so the planner picks an
lse-capable backend) and hands the normalised problem and the lse to the recorder, which keeps
detached q, k and lse (or only the statistics). Forward hooks on each
``qkv.MultiHeadAttention`` submodule (found as a ``qkv._recording.AttentionLayer``: this
package does not import the module layer, which imports it) set a second ContextVar to the
module's name, so every capture knows which layer made it. The caller still gets exactly
what it asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import Token
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .. import _recording
from .._core.kinds import classify_score
from .._core.problem import Problem
from .._door import mask_kind
from ._stats import Stats, stats_of_problem
from ._weights import Index, check_index, row_weights

Tensor = torch.Tensor


@dataclass
class Capture:
    """What one attention call saw (always in the batched ``[B, H, L, D]`` form).

    Attributes:
        layer: dotted name of the ``qkv.MultiHeadAttention`` submodule that made the call
            (``""`` for a call outside any such module, or the recorded module itself).
        q: ``[B, Hq, Lq, D]`` queries as the kernel saw them (after projections and RoPE), or
            ``None`` when recording with ``keep="stats"``.
        k: ``[B, Hkv, Lk, D]`` keys, or ``None`` with ``keep="stats"``.
        lse: ``[B, Hq, Lq]`` float32 log-sum-exp of each row.
        mask, score_mod, scale: what the call was given (masks in normalised form).
        stats: the statistics, when recorded with ``keep="stats"``.
    """

    layer: str
    q: Tensor | None
    k: Tensor | None
    lse: Tensor
    mask: Any
    score_mod: Any
    scale: float
    stats: Stats | None = None

    def _problem(self, what: str) -> Problem:
        if self.q is None or self.k is None:
            raise ValueError(
                f"this capture of layer {self.layer!r} kept only statistics; record with "
                f"keep='qk' (the default) to rebuild {what}"
            )
        return Problem(
            q=self.q,
            k=self.k,
            v=self.k[..., :0],  # never read: weights need only q, k and lse
            mask=mask_kind(self.mask),
            score=classify_score(self.score_mod),
            scale=self.scale,
            dropout_p=0.0,
            return_lse=True,
            orig_ndim=4,
        )

    def weights(self, *, rows: Index = None, heads: Index = None) -> Tensor:
        """Exact weights ``[B, h, r, Lk]`` of the chosen rows/heads (see ``inspect.weights``)."""
        p = self._problem("weights")
        h = check_index("heads", heads, p.Hq, "heads", p.device)
        r = check_index("rows", rows, p.Lq, "query rows", p.device)
        return row_weights(p, self.lse, h, r)

    def statistics(self, *, top_k: int | None = None) -> Stats:
        """:class:`Stats` of this call: the recorded ones (``keep="stats"``), or computed now
        from q, k and lse with ``top_k`` keys per row (default 5)."""
        if self.stats is not None:
            have = self.stats.top_keys.shape[-1]
            if top_k is not None and min(top_k, self.stats.received.shape[-1]) != have:
                raise ValueError(
                    f"layer {self.layer!r} was recorded with statistics for top_k={have}; "
                    f"record with keep='qk' to compute other top_k values afterwards"
                )
            return self.stats
        return stats_of_problem(
            self._problem("statistics"), self.lse, 5 if top_k is None else top_k
        )


class Recording:
    """The captures of one ``record()`` block, in call order.

    ``rec[i]`` is the i-th capture; ``rec["encoder.layers.3.attn"]`` the last capture of that
    layer; ``rec.layers`` the layer names in first-call order; ``len(rec)`` and iteration
    follow the call order. Each :class:`Capture` rebuilds its call's weights,
    ``rec[i].weights(rows=...)`` → ``[B, Hq, rows, Lk]``.
    """

    def __init__(
        self, keep: Literal["qk", "stats"], top_k: int, names: dict[int, str] | None = None
    ) -> None:
        self.keep, self.top_k = keep, top_k
        self.captures: list[Capture] = []
        self._names = names or {}  # id(submodule) -> dotted name, for _recording.CALLER

    def observe(self, problem: Any, lse: Tensor) -> None:
        p: Problem = problem
        caller = _recording.CALLER.get()
        layer = self._names.get(id(caller)) if caller is not None else None
        if layer is None:
            layer = _recording.LAYER.get()
        lse = lse.detach()
        mask, score_mod = p.mask.given, p.score.given  # what the call was given
        if self.keep == "stats":
            det = dataclasses.replace(p, q=p.q.detach(), k=p.k.detach())
            st = stats_of_problem(det, lse, self.top_k)
            cap = Capture(layer, None, None, lse, mask, score_mod, p.scale, st)
        else:
            cap = Capture(layer, p.q.detach(), p.k.detach(), lse, mask, score_mod, p.scale)
        self.captures.append(cap)

    @property
    def layers(self) -> list[str]:
        return list(dict.fromkeys(c.layer for c in self.captures))

    def __len__(self) -> int:
        return len(self.captures)

    def __iter__(self) -> Iterator[Capture]:
        return iter(self.captures)

    def __getitem__(self, key: int | str) -> Capture:
        if isinstance(key, int):
            return self.captures[key]
        for c in reversed(self.captures):
            if c.layer == key:
                return c
        raise KeyError(f"no qkv attention call was recorded in layer {key!r}; got {self.layers}")

    def __repr__(self) -> str:
        return f"Recording({len(self)} calls in layers {self.layers})"


def _attention_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    subs: list[tuple[str, nn.Module]] = list(module.named_modules())
    return [(n, m) for n, m in subs if isinstance(m, _recording.AttentionLayer)]


@contextmanager
def record(
    module: nn.Module, *, keep: Literal["qk", "stats"] = "qk", top_k: int = 5
) -> Iterator[Recording]:
    """Record every ``qkv.attention`` call made while the block runs, named by layer.

    Calls traced by ``torch.compile`` are not recorded (dynamo cannot trace the context
    lookup). Inside the block, each call asks its backend for the lse too (so the planner may pick a
    different, lse-capable backend than it would otherwise) and the caller still gets what it
    asked for. Calls inside a ``qkv.MultiHeadAttention`` submodule of ``module`` are named by
    that submodule's dotted name, and so are the calls qkv's transformers attention function
    (:mod:`qkv.hf`) makes for a layer of a Hugging Face model. Recordings nest: an inner one
    takes the calls until it ends.
    A call that names ``backend="sdpa"`` explicitly fails while recording (SDPA cannot return
    the lse). Calls made with ``need_weights=True`` are recorded like any other (the module
    computes them with ``qkv.attention`` and rebuilds the weights from the lse).

    Args:
        module: the model (any ``nn.Module``).
        keep: ``"qk"`` keeps detached q, k and lse per call (``Capture.weights`` rebuilds any
            rows; memory like one more activation per layer); ``"stats"`` computes
            :class:`Stats` during the call and keeps only those and the lse.
        top_k: how many keys per row the statistics list with ``keep="stats"``.

    Yields:
        A :class:`Recording` that fills as the model runs.

    Example::

        >>> import torch, qkv
        >>> enc = torch.nn.Sequential(qkv.MultiHeadAttention(32, 4), qkv.MultiHeadAttention(32, 4))
        >>> with qkv.inspect.record(enc) as rec:
        ...     _ = enc(torch.randn(1, 10, 32))
        >>> rec.layers, rec["1"].weights(rows=[3]).shape
        (['0', '1'], torch.Size([1, 4, 1, 10]))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"record() needs a torch.nn.Module, got {type(module).__name__}")
    if keep not in ("qk", "stats"):
        raise ValueError(f"keep must be 'qk' or 'stats', got {keep!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
    rec = Recording(keep, top_k, {id(m): n for n, m in module.named_modules()})
    tokens: dict[int, list[Token[str]]] = {}
    handles = []
    for name, m in _attention_modules(module):

        def pre(mod: nn.Module, args: Any, _name: str = name) -> None:
            tokens.setdefault(id(mod), []).append(_recording.LAYER.set(_name))

        def post(mod: nn.Module, args: Any, out: Any) -> None:
            stack = tokens.get(id(mod))
            if stack:
                _recording.LAYER.reset(stack.pop())

        handles.append(m.register_forward_pre_hook(pre))
        # always_call: the layer name is reset even when the forward raises.
        handles.append(m.register_forward_hook(post, always_call=True))
    active = _recording.ACTIVE.set(rec)
    _recording.opened(+1)
    try:
        yield rec
    finally:
        _recording.opened(-1)
        _recording.ACTIVE.reset(active)
        for h in handles:
            h.remove()
