"""The cases a spawned world runs (tests/test_distributed.py): each compares ``qd.attention``
on this rank's shard with the single-process ``qkv.attention`` and the float64 oracle on the
unsplit tensors (output, lse and every gradient, with random upstream gradients for both out
and lse), by error ratio against plain PyTorch in float32.

A case returns a list of failures (empty: passed); every rank of the world runs every case
in the same order, because each is a collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import qkv
import qkv.distributed as qd
from catalogue import lay_out
from qkv_testing import FLOOR, _maxerr, oracle, plain_attention

Tensor = torch.Tensor


@dataclass
class Case:
    """``q [B, Hq, L, D]``, ``k/v [B, Hkv, L, D/Dv]``, a mask and a score built from a
    generator; ``params`` are the learnable tensors the score_mod closes over."""

    L: int = 53  # prime: never a multiple of the chunk count, so shards are uneven
    B: int = 1
    Hq: int = 2
    Hkv: int = 2
    D: int = 8
    Dv: int = 8
    dtype: torch.dtype = torch.float32
    mask: Callable[[int, torch.Generator], object] = lambda L, g: None
    score: Callable[[int, int, torch.Generator], tuple[object, list[Tensor]]] = field(
        default=lambda L, H, g: (None, [])
    )


def _docs(L: int, g: torch.Generator) -> Tensor:
    """Document ids with boundaries that cross the chunks (a 1-token document included)."""
    cuts = sorted({*torch.randint(1, L, (4,), generator=g).tolist(), L // 2, L // 2 + 1})
    ids = torch.zeros(L, dtype=torch.int64)
    for c in cuts:
        ids[c:] += 1
    return ids


def every_fifth(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return ((q_idx + 2 * kv_idx) % 5 != 0) & (kv_idx <= q_idx + 3)


def dead_row_7(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (kv_idx <= q_idx) & (q_idx != 7)  # query 7 sees no key at all


def _table(L: int, H: int, g: torch.Generator) -> tuple[object, list[Tensor]]:
    t = (0.5 * torch.randn(2 * 6 + 1, H, generator=g)).requires_grad_()
    return qkv.relative_bias(t, 6), [t]


def _closure(L: int, H: int, g: torch.Generator) -> tuple[object, list[Tensor]]:
    table = torch.randn(9, H, generator=g).requires_grad_()

    def near(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[(q_idx - kv_idx).clamp(-4, 4) + 4, h]

    return near, [table]


def _table_transposed(L: int, H: int, g: torch.Generator) -> tuple[object, list[Tensor]]:
    """A learnable table whose storage is transposed (a leaf with strides (1, 13)): its
    gradient is all-reduced, and NCCL takes only contiguous tensors."""
    t = (0.5 * torch.randn(H, 2 * 6 + 1, generator=g)).t().detach().requires_grad_()
    return qkv.relative_bias(t, 6), [t]


def _bias(L: int, H: int, g: torch.Generator) -> tuple[object, list[Tensor]]:
    b = torch.randn(1, H, L, L, generator=g).requires_grad_()
    return b, [b]


def _bool_tensor(L: int, g: torch.Generator) -> object:
    m = torch.rand(L, L, generator=g) < 0.6
    m[4] = False  # a fully masked row
    return m


CASES: dict[str, Case] = {
    "none": Case(),
    "causal": Case(mask=lambda L, g: qkv.causal),
    "window narrower than a chunk": Case(mask=lambda L, g: qkv.sliding_window(2)),
    "window wider than a shard": Case(mask=lambda L, g: qkv.sliding_window(30)),
    "two-sided window": Case(mask=lambda L, g: qkv.sliding_window(3, 4)),
    "document": Case(mask=lambda L, g: qkv.document(_docs(L, g))),
    "causal document": Case(mask=lambda L, g: qkv.and_masks(qkv.causal, qkv.document(_docs(L, g)))),
    "prefix-lm": Case(mask=lambda L, g: qkv.prefix_lm(11)),
    "padding per batch": Case(B=2, mask=lambda L, g: qkv.padding(torch.tensor([19, L]))),
    "custom mask_mod": Case(mask=lambda L, g: every_fifth),
    "fully masked row": Case(mask=lambda L, g: dead_row_7),
    "bool tensor": Case(mask=_bool_tensor),
    "alibi": Case(
        Hq=4,
        mask=lambda L, g: qkv.causal,
        score=lambda L, H, g: (qkv.alibi(qkv.alibi_slopes(H)), []),
    ),
    "softcap": Case(mask=lambda L, g: qkv.causal, score=lambda L, H, g: (qkv.softcap(2.0), [])),
    "learnable relative_bias table": Case(mask=lambda L, g: qkv.sliding_window(9), score=_table),
    "learnable table in transposed storage": Case(
        Hq=4, mask=lambda L, g: qkv.causal, score=_table_transposed
    ),
    "score_mod closing over a table": Case(score=_closure),
    "learnable bias tensor": Case(mask=lambda L, g: qkv.causal, score=_bias),
    "GQA": Case(Hq=4, Hkv=2, D=16, Dv=12, mask=lambda L, g: qkv.causal),
    "MQA window": Case(Hq=4, Hkv=1, mask=lambda L, g: qkv.sliding_window(5)),
    "even length": Case(L=48, mask=lambda L, g: qkv.causal),
    "tiny (empty chunks)": Case(L=5, mask=lambda L, g: qkv.causal),
    "bfloat16": Case(dtype=torch.bfloat16, mask=lambda L, g: qkv.causal),
    "float64": Case(dtype=torch.float64, mask=lambda L, g: qkv.document(_docs(L, g))),
}


def _compare(
    name: str, mine: Tensor, exact: Tensor, single: Tensor, plain_err: float, f: float, fl: float
) -> list[str]:
    out = []
    if torch.isnan(mine).any():
        out.append(f"{name}: NaN")
    e_exact, e_single = _maxerr(mine, exact), _maxerr(mine, single)
    allowed = f * plain_err + fl
    if e_exact > allowed:
        out.append(f"{name}: error {e_exact:.3g} vs the float64 oracle, allowed {allowed:.3g}")
    if e_single > allowed:
        out.append(f"{name}: differs from single-process qkv.attention by {e_single:.3g}")
    return out


def run_case(
    rank: int, W: int, layout: str, name: str, seed: int = 0, memory: str = "contiguous"
) -> list[str]:
    """``memory``: how this rank's q, k, v shards and its upstream gradient of out lie in
    memory (:data:`catalogue.LAYOUTS`: transposed storage, every other element with NaN
    between, permuted, at an offset with NaN before, heads expanded from one)."""
    c = CASES[name]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(c.B, c.Hq, c.L, c.D, generator=g).to(c.dtype)
    k = torch.randn(c.B, c.Hkv, c.L, c.D, generator=g).to(c.dtype)
    v = torch.randn(c.B, c.Hkv, c.L, c.Dv, generator=g).to(c.dtype)
    mask = c.mask(c.L, g)
    score, params = c.score(c.L, c.Hq, g)
    do = torch.randn(c.B, c.Hq, c.L, c.Dv, generator=g)
    if memory == "expanded":  # one head's values in every head: what an expanded view holds
        q, k, v, do = (t[:, :1].expand_as(t).contiguous() for t in (q, k, v, do))
    dl = torch.randn(c.B, c.Hq, c.L, generator=g)
    lay = qd.Layout(layout, W, c.L)
    kw: dict[str, Any] = {"mask": mask, "score_mod": score}

    def grads(out: Tensor, lse: Tensor, wrt: list[Tensor], full: bool) -> list[Tensor]:
        d_o, d_l = (do, dl) if full else (lay_out(lay.take(do, rank), memory), lay.take(dl, rank))
        d_l = torch.where(torch.isinf(lse.detach()), torch.zeros_like(d_l), d_l)
        return list(torch.autograd.grad((out, lse), wrt, (d_o.to(out.dtype), d_l)))

    def leaves(ts: tuple[Tensor, ...]) -> list[Tensor]:
        return [t.detach().requires_grad_() for t in ts]

    ql, kl, vl = (lay_out(t, memory) for t in leaves(tuple(lay.take(t, rank) for t in (q, k, v))))
    out_l, lse_l = qd.attention(ql, kl, vl, layout=layout, return_lse=True, **kw)
    g_dist = grads(out_l, lse_l, [ql, kl, vl, *params], full=False)

    qs, ks, vs = leaves((q, k, v))
    out_s, lse_s = qkv.attention(qs, ks, vs, return_lse=True, **kw)
    g_single = grads(out_s, lse_s, [qs, ks, vs, *params], full=True)
    qp, kp, vp = leaves((q, k, v))
    out_p, lse_p = plain_attention(qp, kp, vp, **kw)
    g_plain = grads(out_p, lse_p, [qp, kp, vp, *params], full=True)

    q6, k6, v6 = leaves(tuple(t.double() for t in (q, k, v)))
    kept = [t.data for t in params]
    try:  # the oracle's learnable tensors in float64 too (see qkv_testing.compare_to_oracle)
        for t in params:
            t.data = t.data.double()
        out_6, lse_6 = oracle(q6, k6, v6, **kw)
        g_6 = grads(out_6, lse_6.float(), [q6, k6, v6, *params], full=True)
    finally:
        for t, d in zip(params, kept, strict=True):
            t.data = d

    fl = FLOOR[c.dtype]
    fails = []
    if lse_l.dtype != lse_s.dtype:  # float64 inputs get a float64 lse, as in one process
        fails.append(f"lse is {lse_l.dtype}; qkv.attention gives {lse_s.dtype}")
    local = [True, True, True] + [False] * len(params)  # params' gradients are all-reduced
    for what, mine, exact, single, plain, f, floor in [
        ("out", out_l, out_6, out_s, out_p, 2.0, fl),
        ("lse", lse_l, lse_6, lse_s, lse_p, 2.0, fl),
    ]:
        e_plain = _maxerr(plain, exact)
        ex, si = lay.take(exact, rank), lay.take(single, rank)
        fails += _compare(what, mine, ex, si, e_plain, f, floor)
    names = ["dq", "dk", "dv", *[f"dparam{i}" for i in range(len(params))]]
    for n, is_local, gd, gs, gp, g6 in zip(
        names, local, g_dist, g_single, g_plain, g_6, strict=True
    ):
        e_plain = _maxerr(gp, g6)
        ex, si = (lay.take(g6, rank), lay.take(gs, rank)) if is_local else (g6, gs)
        fails += _compare(n, gd, ex, si, e_plain, 3.0, 10 * fl)
    return fails
