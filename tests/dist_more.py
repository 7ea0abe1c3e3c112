"""More cases a spawned world runs: traffic counted through the plan and the transport,
errors every rank raises together, and a model that trains over a split sequence."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import qkv
import qkv.distributed as qd

Tensor = torch.Tensor


def traffic(rank: int, W: int, layout: str, mask_name: str) -> list[str]:
    """The bytes each rank sends and receives, per phase and peer, equal the plan's; a
    sliding window narrower than a chunk talks to neighbours only; causal in the contiguous
    layout sends nothing to earlier ranks."""
    B, H, L, D = 1, 2, 64, 8
    mask = {"window": qkv.sliding_window(3), "causal": qkv.causal}[mask_name]
    pl = qd.plan(B, H, L, D, mask=mask, world_size=W, layout=layout)
    mine = pl.ranks[rank]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    lay = qd.Layout(layout, W, L)
    ql, kl, vl = (lay.take(t, rank).requires_grad_() for t in (q, k, v))
    with qd.traffic() as tr:
        out = qd.attention(ql, kl, vl, mask=mask, layout=layout)
        out.sum().backward()
    fails = []
    got = {ph: tr.total(ph) for ph in ("forward", "backward")}
    want = {
        "forward": (mine.bytes_sent, mine.bytes_received),
        "backward": (mine.backward_bytes_sent, mine.backward_bytes_received),
    }
    if got != want:
        fails.append(f"bytes (sent, received) moved {got}, the plan says {want}")
    if set(mine.peers) != tr.peers():
        fails.append(f"peers {sorted(tr.peers())} but the plan names {list(mine.peers)}")
    if mask_name == "window":
        far = [p for p in tr.peers() if abs(p - rank) != 1]
        if far:
            fails.append(f"a narrow window talked to non-neighbours {far}")
        if W > 2 and max(r.bytes_received for r in pl.ranks) >= pl.allgather_bytes:
            fails.append("a narrow window received as much as an all-gather")
    if mask_name == "causal" and layout == "contiguous":
        back = [p for (ph, p), n in tr.sent.items() if ph == "forward" and p < rank and n]
        if back:
            fails.append(f"causal sent keys backwards to ranks {back}")
    return fails


def _expect(fn: object, *args: object, must: tuple[str, ...], **kw: object) -> list[str]:
    try:
        fn(*args, **kw)  # type: ignore[operator]
    except (ValueError, TypeError) as e:
        missing = [m for m in must if m not in str(e)]
        return [f"error {e!s} lacks {missing}"] if missing else []
    return [f"no error (expected one mentioning {must})"]


def errors(rank: int, W: int, layout: str) -> list[str]:
    """Each mistake is refused on every rank (none hangs), naming the rank and the shapes;
    the group stays usable afterwards."""
    L = 29
    lay = qd.Layout(layout, W, L)
    q, k, v = (lay.take(torch.randn(1, 2, L, 8), rank) for _ in range(3))
    fails = []
    short = q[:, :, 1:] if rank == 1 else q  # rank 1 holds one row too few
    k1 = k[:, :, 1:] if rank == 1 else k
    v1 = v[:, :, 1:] if rank == 1 else v
    fails += _expect(
        qd.attention, short, k1, v1, layout=layout, must=(f"rank {rank}", "shard lengths")
    )
    if rank == 1:
        fails += _expect(qd.attention, q, k1, v, layout=layout, must=("rank 1", "k [1, 2"))
    else:
        fails += _expect(qd.attention, q, k, v, layout=layout, must=("ranks [1] refused",))
    masks = [qkv.causal if rank == 0 else None]
    fails += _expect(
        qd.attention, q, k, v, mask=masks[0], layout=layout, must=(f"rank {rank}", "the mask")
    )
    heads = q.repeat(1, 2, 1, 1) if rank == W - 1 else q
    fails += _expect(qd.attention, heads, k, v, layout=layout, must=("q heads", "q [1, "))
    bad = k.to("meta") if rank == 0 else k
    must = ("rank 0", "cpu", "meta") if rank == 0 else ("ranks [0] refused",)
    fails += _expect(qd.attention, q, bad, v, layout=layout, must=must)
    other = "contiguous" if layout == "zigzag" else "zigzag"
    lay_r = layout if rank else other
    fails += _expect(qd.attention, q, k, v, layout=lay_r, must=("layout",))
    bad_layout = "ring" if rank == 0 else layout  # refused on rank 0 alone, raised on all
    must = ("layout must be one of",) if rank == 0 else ("ranks [0] refused",)
    fails += _expect(qd.attention, q, k, v, layout=bad_layout, must=must)
    scale = None if rank == 0 else 1 / math.sqrt(8)  # the same scale said two ways: no error
    out = qd.attention(q, k, v, mask=qkv.causal, scale=scale, layout=layout)  # still in step
    if out.shape != q.shape:
        fails.append(f"after the errors, an output of shape {list(out.shape)}")
    return fails


def train(rank: int, W: int, layout: str) -> list[str]:
    """A small model of qkv.MultiHeadAttention layers (RoPE, GQA, causal) trains over a split
    sequence: after three SGD steps (gradients summed over the ranks) its parameters equal
    those of the same model trained on the unsplit sequence."""
    torch.manual_seed(0)
    d, L = 16, 45

    def model() -> torch.nn.ModuleList:
        torch.manual_seed(0)
        return torch.nn.ModuleList(
            [qkv.MultiHeadAttention(d, 4, n_kv_heads=2, rope=True) for _ in range(2)]
        )

    def run(m: torch.nn.ModuleList, x: Tensor, cp: object) -> Tensor:
        for layer in m:
            x = x + layer(x, mask=qkv.causal, context_parallel=cp)
        return x

    x = torch.randn(2, L, d)
    target = torch.randn(2, L, d)
    split, whole = model(), model()
    cp = qd.ContextParallel(None, layout)
    opt_s = torch.optim.SGD(split.parameters(), lr=0.1)
    opt_w = torch.optim.SGD(whole.parameters(), lr=0.1)
    lay = qd.Layout(layout, W, L)
    fails = []
    for step in range(3):
        y_l = run(split, qd.shard(x, layout=layout, dim=1), cp)
        n = target.numel()  # the mean over the whole sequence: this rank's share of the sum
        (((y_l - lay.take(target, rank, dim=1)) ** 2).sum() / n).backward()
        for p in split.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)  # data-parallel style: the ranks' shares summed
        y = run(whole, x, None)
        (((y - target) ** 2).sum() / n).backward()
        full = qd.unshard(y_l, layout=layout, dim=1)
        if not torch.allclose(full, y, atol=1e-5, rtol=1e-4):
            fails.append(f"step {step}: outputs differ by {float((full - y).abs().max()):.3g}")
        for (n, a), b in zip(split.named_parameters(), whole.parameters(), strict=True):
            assert a.grad is not None and b.grad is not None
            if not torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4):
                err = float((a.grad - b.grad).abs().max())
                fails.append(f"step {step}: grad of {n} differs by {err:.3g}")
        opt_s.step()
        opt_w.step()
        opt_s.zero_grad()
        opt_w.zero_grad()
    return fails


def subgroup(rank: int, W: int, layout: str) -> list[str]:
    """``group=`` a subgroup (ranks 1..W-1 of the world): positions, peers and collectives are
    those of the group, not the world; rank 0 stays out of it."""
    g = dist.new_group(list(range(1, W)))  # every rank of the world calls new_group
    if rank == 0:
        return []
    me, Wg, L = rank - 1, W - 1, 37
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, L, 8, generator=gen) for _ in range(3))
    lay = qd.Layout(layout, Wg, L)
    ql, kl, vl = (lay.take(t, me).requires_grad_() for t in (q, k, v))
    out = qd.attention(ql, kl, vl, mask=qkv.sliding_window(4), group=g, layout=layout)
    do = torch.randn(1, 2, L, 8, generator=gen)
    out.backward(lay.take(do, me))
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    ref = qkv.attention(qf, kf, vf, mask=qkv.sliding_window(4))
    assert isinstance(ref, Tensor)
    ref.backward(do)
    fails = []
    for name, a, b in [
        ("out", out, ref),
        ("dq", ql.grad, qf.grad),
        ("dk", kl.grad, kf.grad),
        ("dv", vl.grad, vf.grad),
    ]:
        assert a is not None and b is not None
        err = float((a - lay.take(b, me)).abs().max())
        if err > 1e-5:
            fails.append(f"{name} differs by {err:.3g} from the single-process call")
    full = qd.unshard(out.detach(), group=g, layout=layout)
    if full.shape != ref.shape or float((full - ref).abs().max()) > 1e-5:
        fails.append("qd.unshard over the subgroup is not the full output")
    return fails
