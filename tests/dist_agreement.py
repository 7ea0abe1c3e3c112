"""Cases a spawned world runs for tests/test_distributed_agreement.py.

Ranks passing masks or score_mods with the same names and shapes but different
contents (document ids, a bool mask, a bias, a tensor a user mod closes over, a number it
captures) are refused with a ValueError on every rank, naming what differs; equal contents
(held in other tensors, even in another integer dtype) still give the single-process answer.

Shards of any memory layout; and everything handed to ``torch.distributed`` is
contiguous (:func:`watch_wire`), as NCCL requires.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

import qkv
import qkv.distributed as qd

Tensor = torch.Tensor

L = 29


def _expect(fn: Callable[[], object], must: tuple[str, ...], kind: type = ValueError) -> list[str]:
    try:
        fn()
    except Exception as e:
        if not isinstance(e, kind):
            return [f"{type(e).__name__} instead of {kind.__name__}: {e}"]
        missing = [m for m in must if m not in str(e)]
        return [f"error {e!s} lacks {missing}"] if missing else []
    return [f"no error (expected one mentioning {must})"]


def _shards(rank: int, W: int, layout: str, H: int = 2) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(1, H, L, 8, generator=g) for _ in range(3)]
    lay = qd.Layout(layout, W, L)
    return tuple(full) + tuple(lay.take(t, rank) for t in full)


def _docs(cut: int, dtype: torch.dtype = torch.int64) -> Tensor:
    ids = torch.zeros(L, dtype=dtype)
    ids[cut:] = 1
    return ids


def differing(rank: int, W: int, layout: str) -> list[str]:
    """Every mistake raises on every rank (a world that hangs or aborts fails the test)."""
    _, _, _, q, k, v = _shards(rank, W, layout)
    last = rank == W - 1
    fails = []

    def call(mask: object = None, score_mod: object = None) -> Callable[[], object]:
        return lambda: qd.attention(q, k, v, mask=mask, score_mod=score_mod, layout=layout)

    # One length, other ids. A cut at 3 on the last rank and at 20 elsewhere
    # also plans different traffic (which killed a rank inside gloo in the contiguous layout).
    ids = _docs(3 if last else 20)
    who = f"ranks {[W - 1]}" if not last else f"ranks {list(range(W - 1))}"
    fails += _expect(
        call(qkv.document(ids)),
        (f"rank {rank}:", "the document ids of the mask qkv.document(<29 ids>) differ", who),
    )
    # The same ids differing only past one rank's rows, so they plan the same traffic: a
    # silent wrong answer before.
    ids = _docs(L - 1 if last else L - 2)
    fails += _expect(call(qkv.and_masks(qkv.causal, qkv.document(ids))), ("document ids",))
    # A bool mask differing in one element.
    m = torch.ones(L, L, dtype=torch.bool).tril()
    m[L - 1, 0] = not last
    fails += _expect(call(m), ("the mask's bool tensor [29, 29]", "checksums: rank 0"))
    # A user mask_mod over a tensor that differs.
    cuts = _docs(5 if last else 6)

    def same_doc(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cuts[q_idx] == cuts[kv_idx]

    fails += _expect(call(same_doc), ("tensor 0 [29] that the mask_mod same_doc closes over",))
    # A bias tensor and a score_mod's table.
    bias = torch.zeros(1, 2, L, L)
    bias[0, 1, 3, 4] = float(last)
    fails += _expect(call(None, bias), ("the score_mod's bias tensor [1, 2, 29, 29]",))
    table = torch.zeros(13, 2)
    table[6, 0] = float(last)
    fails += _expect(call(None, qkv.relative_bias(table, 6)), ("the table of the score_mod",))
    # What no tensor shows: a captured number. The probe of the results catches it.
    prefix = 3 if last else 20

    def prefix_lm(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < prefix)

    fails += _expect(
        call(prefix_lm),
        ("the mask gives different results on different ranks", "mask_mod prefix_lm"),
    )
    cap = 2.0 if last else 3.0

    def capped(s: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(s / cap)

    fails += _expect(call(qkv.causal, capped), ("the score_mod gives different results",))

    # A user mod that raises on one rank only: that rank raises its own error, the others
    # say so (before, they waited in a receive until the group's timeout).
    def fragile(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if last:
            raise RuntimeError("fragile fails on the last rank")
        return kv_idx <= q_idx

    if last:
        fails += _expect(call(fragile), ("fragile fails",), RuntimeError)
    else:
        fails += _expect(call(fragile), (f"ranks [{W - 1}] refused the mask",))
    # The group is still usable.
    out = qd.attention(q, k, v, mask=qkv.causal, layout=layout)
    if out.shape != q.shape:
        fails.append(f"after the errors, an output of shape {list(out.shape)}")
    return fails


def equal(rank: int, W: int, layout: str) -> list[str]:
    """Equal contents in other tensor objects (ids in int32 on one rank), user mods over
    equal tensors, a learnable table: no error, and the single-process answer."""
    qf, kf, vf, q, k, v = _shards(rank, W, layout)
    lay = qd.Layout(layout, W, L)
    ids = _docs(11, torch.int32 if rank % 2 else torch.int64)
    mine = _docs(11)

    def same_doc(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (mine[q_idx] == mine[kv_idx]) & (kv_idx <= q_idx + 2)

    table = torch.linspace(-1, 1, 26).view(13, 2)
    m = torch.rand(L, L, generator=torch.Generator().manual_seed(3)) < 0.7
    cases: list[tuple[str, object, object]] = [
        ("document", qkv.document(ids), None),
        ("user mask_mod", same_doc, qkv.relative_bias(table.clone(), 6)),
        ("bool mask and softcap", m.clone(), qkv.softcap(3.0)),
        ("padding", qkv.padding(torch.tensor([17])), None),
    ]
    fails = []
    for name, mask, score in cases:
        out = qd.attention(q, k, v, mask=mask, score_mod=score, layout=layout)
        ref = qkv.attention(qf, kf, vf, mask=mask, score_mod=score)
        assert isinstance(out, Tensor) and isinstance(ref, Tensor)
        err = float((out - lay.take(ref, rank)).abs().max())
        if not err <= 1e-5:
            fails.append(f"{name}: differs by {err:.3g} from the single-process call")
    return fails


# ------------------------------------------------------------------------------ the wire


def _tensors(x: object) -> Iterator[Tensor]:
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dist.P2POp):
        yield x.tensor


_WIRE = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single")


@contextmanager
def watch_wire() -> Iterator[list[str]]:
    """Record every tensor handed to torch.distributed that is not contiguous (NCCL refuses
    them; gloo happens to take some)."""
    bad: list[str] = []
    saved = {n: getattr(dist, n) for n in (*_WIRE, "batch_isend_irecv") if hasattr(dist, n)}

    def watched(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            for t in _tensors([*args, *kw.values()]):
                if not t.is_contiguous():
                    bad.append(f"{name} got shape {list(t.shape)}, strides {t.stride()}")
            return fn(*args, **kw)

        return call

    for n, fn in saved.items():
        setattr(dist, n, watched(n, fn))
    try:
        yield bad
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
