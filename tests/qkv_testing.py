"""Shared oracle helpers: every fast path is compared with ``qkv.reference`` in float64.

The comparison follows flash-attention's tests: a backend's error against the
float64 oracle must stay within a small factor of the error that *plain PyTorch in the same
dtype* makes against that oracle — 2x for outputs and lse, 3x for gradients — plus a tiny floor
for cases where plain PyTorch happens to be exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import qkv
from catalogue import lay_out

# private on purpose: the plain baseline runs on qkv's own normalised problem (unbatched inputs,
# GQA groups), and the oracle's lse comes from qkv.reference.forward
from qkv._core.dense import apply_score_mod, dense_mask
from qkv._door import validate

Tensor = torch.Tensor

# Below these, an error is noise whatever plain PyTorch did (plain can be exactly right, e.g. Lk=1).
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def plain_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: object = None,
    score_mod: object = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain PyTorch in the inputs' own dtype (no upcast): the error baseline. Returns
    ``(out, lse)`` with fully masked rows set to 0 / -inf as the contract requires."""
    p = validate(q, k, v, mask=mask, score_mod=score_mod, scale=scale)
    g = p.groups
    kk = p.k.repeat_interleave(g, 1)  # [B, Hq, Lk, D]
    vv = p.v.repeat_interleave(g, 1)  # [B, Hq, Lk, Dv]
    s = (p.q @ kk.transpose(-2, -1)) * p.scale  # [B, Hq, Lq, Lk]
    s = apply_score_mod(p, s).to(q.dtype)
    m = dense_mask(p)
    if m is not None:
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)  # [B, Hq, Lq]
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = w @ vv
    return p.restore(out), p.restore(lse)


def oracle(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    """The reference on float64 copies: ``(out, lse)`` in float64."""
    p = validate(
        q.double(),
        k.double(),
        v.double(),
        mask=kw.get("mask"),
        score_mod=kw.get("score_mod"),
        scale=kw.get("scale"),
    )
    out, lse, _ = qkv.reference.forward(p, dropout_p=0.0)
    return p.restore(out), p.restore(lse.double())


def _maxerr(a: Tensor | None, b: Tensor | None) -> float:
    if a is None or b is None:
        return 0.0
    a, b = a.detach().double(), b.detach().double()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = torch.where(both_inf, torch.zeros_like(a), a - b).abs()
    return float(diff.max()) if diff.numel() else 0.0


@dataclass
class Comparison:
    name: str
    err: float
    plain_err: float
    factor: float
    floor: float

    @property
    def ok(self) -> bool:
        return self.err <= self.factor * self.plain_err + self.floor

    def __str__(self) -> str:
        return (
            f"{self.name}: error {self.err:.3g} vs plain {self.plain_err:.3g} "
            f"(allowed {self.factor}x + {self.floor:g})"
        )


def compare_to_oracle(
    fn: Callable[..., Any],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: object = None,
    score_mod: object = None,
    scale: float | None = None,
    grads: bool = True,
    extra_params: tuple[Tensor, ...] = (),
    seed: int = 0,
    grad_layout: str = "contiguous",
) -> list[Comparison]:
    """Run ``fn(q, k, v, mask=, score_mod=, scale=)`` (returning ``out`` or ``(out, lse)``) and
    check out, lse (when returned) and the gradients of q, k, v (and of a bias tensor or the
    ``extra_params`` a score_mod closes over) against the float64 oracle, with a random
    upstream gradient laid out in memory as ``grad_layout`` (:data:`catalogue.LAYOUTS`).
    q, k and v keep their own layouts.

    Returns the comparisons; callers assert ``all(c.ok for c in result)``."""
    dtype = q.dtype
    floor = FLOOR[dtype]
    bias = score_mod if isinstance(score_mod, Tensor) else None
    qf, kf, vf = (t.detach().requires_grad_(grads) for t in (q, k, v))
    bf = bias.detach().requires_grad_(grads) if bias is not None else score_mod
    kw = {"mask": mask, "scale": scale}

    result = fn(qf, kf, vf, score_mod=bf, **kw)
    out, lse = result if isinstance(result, tuple) else (result, None)
    po, plse = plain_attention(qf, kf, vf, score_mod=bf, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = lay_out(torch.randn(out.shape, generator=gen, dtype=torch.float64), grad_layout)
    wrt = [qf, kf, vf, *([bf] if bias is not None else []), *extra_params]
    g_fast: tuple[Tensor | None, ...] = ()
    g_plain: tuple[Tensor | None, ...] = ()
    if grads:
        g_fast = torch.autograd.grad(out, wrt, do.to(out.dtype), allow_unused=True)
        g_plain = torch.autograd.grad(po, wrt, do.to(po.dtype), allow_unused=True)

    q64, k64, v64 = (t.detach().double().requires_grad_(grads) for t in (qf, kf, vf))
    b64 = bf.detach().double().requires_grad_(grads) if bias is not None else score_mod
    wrt64 = [q64, k64, v64, *([b64] if bias is not None else []), *extra_params]
    # The tensors a score_mod closes over are float64 too while the oracle runs and is
    # differentiated (after the fast and plain gradients: swapping a leaf's dtype detaches
    # graphs built before). Left in float32, the oracle would add them in float32 and scatter
    # its dS into them in float32, so its "exact" gradient carried the same summation error
    # as plain PyTorch's, and a fast path summing in another order looked 10x worse.
    kept = [t.data for t in extra_params]
    try:
        for t in extra_params:
            t.data = t.data.double()
        oo, olse = oracle(q64, k64, v64, score_mod=b64, **kw)
        g_64 = torch.autograd.grad(oo, wrt64, do, allow_unused=True) if grads else ()
    finally:
        for t, d in zip(extra_params, kept, strict=True):
            t.data = d
    res = [
        Comparison("out", _maxerr(out, oo), _maxerr(po, oo), 2.0, floor),
    ]
    if lse is not None:
        want = torch.float64 if dtype == torch.float64 else torch.float32
        assert lse.dtype == want, f"lse must be {want} for {dtype} inputs, got {lse.dtype}"
        res.append(Comparison("lse", _maxerr(lse, olse), _maxerr(plse, olse), 2.0, floor))
    if not grads:
        return res
    names = [
        "dq",
        "dk",
        "dv",
        *(["dbias"] if bias is not None else []),
        *[f"dparam{i}" for i in range(len(extra_params))],
    ]
    for n, gf, gp, g6 in zip(names, g_fast, g_plain, g_64, strict=True):
        if g6 is None:
            assert gf is None or float(gf.abs().max()) == 0.0, f"{n}: fast path has a gradient"
            continue
        assert gf is not None, f"{n}: no gradient reached this input on the fast path"
        assert torch.isfinite(gf).all(), f"{n}: non-finite gradient"
        res.append(Comparison(n, _maxerr(gf, g6), _maxerr(gp, g6), 3.0, floor * 10))
    return res


def assert_matches_oracle(comparisons: list[Comparison]) -> None:
    bad = [str(c) for c in comparisons if not c.ok]
    assert not bad, "; ".join(bad)
