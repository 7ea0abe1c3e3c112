"""``qd.attention``, ``qd.plan``, ``qd.shard``, ``qd.unshard``: the public functions, and the
``torch.autograd.Function`` between them and the per-rank work."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .._core.kinds import describe
from .._core.problem import Problem
from .._door import validate
from ..backends.base import unit_last_stride
from ..backends.blocksparse.autograd import captured
from ..typing import MaskLike, ScoreLike
from . import backward as _backward
from . import checks, compute, content
from . import plan as _plan
from .layout import Layout, check_layout

Tensor = torch.Tensor


class _ContextParallel(torch.autograd.Function):
    """``(spec, q, k, v, *params) -> (out, lse)`` over a sequence split across ranks."""

    @staticmethod
    def forward(
        ctx: Any, spec: compute.Spec, q: Tensor, k: Tensor, v: Tensor, *params: Tensor
    ) -> tuple[Tensor, Tensor]:
        out, lse = compute.forward(spec, q, k, v)
        ctx.spec, ctx.params = spec, params
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out.to(q.dtype), lse

    @staticmethod
    @once_differentiable  # the recomputing backward is not itself differentiable: say so
    def backward(ctx: Any, dout: Tensor | None, dlse: Tensor | None) -> tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dparams = _backward.backward(
            ctx.spec, q, k, v, ctx.params, out, lse, dout, dlse
        )
        return (
            None,
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            *(g.to(p.dtype) for g, p in zip(dparams, ctx.params, strict=True)),
        )


def _global_problem(
    q: Tensor, k: Tensor, v: Tensor, L: int, mask: object, score_mod: object, scale: object
) -> Problem:
    """The door of ``qkv.attention`` on the *global* problem ``[B, H, L, L]``: zero-stride
    stand-ins of the full q, k, v (nothing is allocated), so the mask and score are checked
    against the whole sequence and classified once."""

    def full(t: Tensor) -> Tensor:
        return t.new_zeros(()).expand(t.shape[0], t.shape[1], L, t.shape[3])  # [B, H, L, D]

    return validate(full(q), full(k), full(v), mask=mask, score_mod=score_mod, scale=scale)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: MaskLike = None,
    *,
    score_mod: ScoreLike = None,
    scale: float | None = None,
    group: Any = None,
    layout: str = "zigzag",
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """This rank's rows of exact attention over a sequence split across the ranks of ``group``.

    Equivalent to taking this rank's rows (:func:`shard`) of the single-process
    ``qkv.attention(q_full, k_full, v_full, mask=mask, score_mod=score_mod, scale=scale)``:
    masks and score_mods see *global* positions, as in a single-process call.

    Args:
        q: this rank's queries ``[B, Hq, L_local, D]`` (the rows :func:`shard` gives it).
        k: this rank's keys ``[B, Hkv, L_local, D]``, the same positions as q.
        v: this rank's values ``[B, Hkv, L_local, Dv]``.
        mask, score_mod, scale: as in :func:`qkv.attention`, over the full ``[L, L]``. Every
            rank passes the same ones (a bool mask or bias tensor spans the full ``[L, L]``).
        group: a ``torch.distributed`` process group (None: the default group).
        layout: ``"zigzag"`` (rank r holds chunks r and 2W-1-r: balanced causal work) or
            ``"contiguous"``; see :class:`qkv.distributed.Layout`.
        return_lse: also return ``lse [B, Hq, L_local]`` (float32; float64 for float64 inputs).

    Only the key/value rows some of this rank's queries see are received (and only the rows
    other ranks need are sent), by ``isend``/``irecv`` overlapped with computing the chunks
    already here; :func:`plan` says which. Gradients reach q, k, v (dK/dV partial sums
    travel back to the owners) and the tensors a score_mod closes over (all-reduced: every
    rank gets the full gradient). Half-precision inputs are computed per pair in float32.

    Example (on every rank)::

        q_l, k_l, v_l = (qd.shard(t) for t in (q, k, v))
        out_l = qd.attention(q_l, k_l, v_l, mask=qkv.causal)
        out = qd.unshard(out_l)        # == qkv.attention(q, k, v, mask=qkv.causal)
    """
    rank, W = checks.check_group(group)
    # A mistake on one rank is raised on every rank, after the all_gather in agree(): raising
    # here alone would leave the others waiting there until the group's timeout.
    local_error: Exception | None = None
    held: list[tuple[str, int]] = []
    users: list[str] = []
    try:
        check_layout(layout)
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be True or False, got {type(return_lse).__name__}")
        checks.check_local(rank, q, k, v)
    except (TypeError, ValueError) as e:
        local_error = e
    try:
        # What the mask and score hold (ids, lengths, tensors), compared in the same gather
        # as their names: equal names with other contents would plan different traffic.
        items, users = content.collect(mask, score_mod)
        sums = content.checksums(items, q.device.type if isinstance(q, Tensor) else "cpu")
        held = [(what, c) for (what, _, _), c in zip(items, sums, strict=True)]
    except Exception as e:  # raised after the gather, with the others (checks.agree)
        local_error = local_error or e
    # Agree first (one all_gather), then classify once against the real length L.
    params = _learnable(score_mod)
    needs_grad = local_error is None and (
        torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *params))
    )
    lay = checks.agree(
        group,
        rank,
        W,
        q,
        k,
        v,
        layout=layout,
        mask=describe(mask),
        score=describe(score_mod),
        scale=scale,
        n_params=len(params),
        needs_grad=needs_grad,
        content=held,
        probes=len(users),
        local_error=local_error,
    )
    if not users:
        p = _global_problem(q, k, v, lay.L, mask, score_mod, scale)
    else:
        p = _probed_problem(group, rank, W, q, k, v, lay.L, mask, score_mod, scale, users)
    wd = compute.work_dtype(q.dtype)
    pl = _plan.build(
        p.mask,
        lay,
        B=p.B,
        Hq=p.Hq,
        Hkv=p.Hkv,
        D=p.D,
        Dv=p.Dv,
        element_size=q.element_size(),
        grad_size=torch.finfo(wd).bits // 8,
        device=q.device,
    )
    spec = compute.Spec(group, rank, lay, pl, p.mask, p.score, p.scale, len(params))
    # Every partial call reads slices of q, k, v; torch's fused kernels read a last dim with
    # stride != 1 (x.mT, x[..., ::2]) as if it were 1, so such shards are copied once here
    # (differentiably: the gradient reaches the caller's view) rather than per pair.
    q, k, v = (unit_last_stride(t) for t in (q, k, v))
    out, lse = _ContextParallel.apply(spec, q, k, v, *params)
    return (out, lse) if return_lse else out


def _probed_problem(
    group: Any,
    rank: int,
    W: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    L: int,
    mask: object,
    score_mod: object,
    scale: object,
    users: list[str],
) -> Problem:
    """The global problem of a call with a user mask_mod or score_mod, whose results are
    compared across ranks on a grid of global positions (one more small all_gather): what
    a mod computes from captured numbers no checksum of tensors sees. Any error building or
    probing the problem here (a user mod may raise anything) is raised on every rank."""
    error: Exception | None = None
    p, probes = None, (0, 0)
    try:
        p = _global_problem(q, k, v, L, mask, score_mod, scale)
        probes = content.probe(p)
    except Exception as e:  # re-raised below, on this rank, as it was
        error = e
    where = f"probed at q_idx and kv_idx in {content.positions(L)}"
    checks.agree_probes(
        group, rank, W, q.device, probes, users=users, where=where, local_error=error
    )
    assert p is not None
    return p


def _learnable(score_mod: object) -> tuple[Tensor, ...]:
    """The tensors the backward computes gradients for beyond q, k, v: a bias tensor that
    requires grad, or the learnable tensors a callable score_mod closes over."""
    if isinstance(score_mod, Tensor):
        return (score_mod,) if score_mod.requires_grad else ()
    return tuple(captured(score_mod)) if callable(score_mod) else ()


def plan(
    B: int,
    H: int,
    L: int,
    D: int,
    *,
    mask: MaskLike = None,
    score_mod: ScoreLike = None,
    world_size: int,
    layout: str = "zigzag",
    Hkv: int | None = None,
    Dv: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> _plan.Plan:
    """The plan of ``qd.attention`` on ``world_size`` ranks for ``q [B, H, L, D]``,
    ``k [B, Hkv, L, D]``, ``v [B, Hkv, L, Dv]``: ``ranks[r]`` has ``steps``, ``bytes_sent``,
    ``bytes_received`` (forward; ``backward_bytes_*`` for the backward) and ``flops``;
    ``imbalance`` is the busiest over the idlest rank's FLOPs; ``str()`` prints it all.
    Needs no process group."""
    lay = Layout(check_layout(layout), world_size, L)
    Hkv = H if Hkv is None else Hkv
    Dv = D if Dv is None else Dv
    q = torch.empty((), dtype=dtype, device="meta").expand(B, H, L, D)  # [B, H, L, D]
    k = torch.empty((), dtype=dtype, device="meta").expand(B, Hkv, L, D)
    v = torch.empty((), dtype=dtype, device="meta").expand(B, Hkv, L, Dv)
    p = validate(q, k, v, mask=mask, score_mod=score_mod)
    item = torch.empty((), dtype=dtype).element_size()
    wd = compute.work_dtype(dtype)
    return _plan.build(
        p.mask,
        lay,
        B=B,
        Hq=H,
        Hkv=Hkv,
        D=D,
        Dv=Dv,
        element_size=item,
        grad_size=torch.finfo(wd).bits // 8,
        device=torch.device("cpu"),
    )


def shard(x: Tensor, group: Any = None, layout: str = "zigzag", *, dim: int = 2) -> Tensor:
    """This rank's rows of the full tensor ``x`` (positions along ``dim``, default 2 as in
    ``[B, H, L, D]``; ``dim=1`` for ``[B, L, d_model]``). Differentiable: the gradient lands
    on this rank's rows of ``x``. :class:`qkv.distributed.Layout` says which rows they are."""
    rank, W = checks.check_group(group)
    if not isinstance(x, Tensor):
        raise TypeError(f"qd.shard takes a tensor, got {type(x).__name__}")
    return Layout(check_layout(layout), W, x.shape[dim]).take(x, rank, dim)


def unshard(x: Tensor, group: Any = None, layout: str = "zigzag", *, dim: int = 2) -> Tensor:
    """The full tensor from every rank's rows (the inverse of :func:`shard`), on every rank:
    one ``all_gather`` (shards padded to one length). Not differentiable (for outputs and
    inspection). ``[B, H, L_local, D]`` → ``[B, H, L, D]`` (the sequence along ``dim``)."""
    rank, W = checks.check_group(group)
    if not isinstance(x, Tensor):
        raise TypeError(f"qd.unshard takes a tensor, got {type(x).__name__}")
    d = dim % x.ndim
    dev = x.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    n = torch.tensor([x.shape[d]], dtype=torch.int64, device=dev)
    ns = torch.empty(W, dtype=torch.int64, device=dev)
    checks.gather_into(ns, n, group=group)
    lengths = [int(i) for i in ns.tolist()]
    L = checks.infer_length(layout, W, lengths)
    if L is None:
        raise ValueError(
            f"rank {rank}: shard lengths {lengths} are not the {layout} layout of any sequence"
        )
    top = max(lengths)
    pad = [0, 0] * (x.ndim - 1 - d) + [0, top - x.shape[d]]
    xp = torch.nn.functional.pad(x.detach(), pad).contiguous()
    bufs = [torch.empty_like(xp) for _ in range(W)]
    dist.all_gather(bufs, xp, group=group)
    shards = [b.narrow(d, 0, m) for b, m in zip(bufs, lengths, strict=True)]
    return Layout(layout, W, L).assemble(shards, dim=d)
