"""Checks at the door of ``qd.attention``: the group, the local tensors, and that every rank
describes the same call (one ``all_gather`` of a small descriptor), so that a disagreement is
a clear error on every rank instead of a hang or a wrong answer.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .layout import LAYOUTS, Layout, infer_length

Tensor = torch.Tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_group(group: Any) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group`` (None: the default group)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "qkv.distributed needs an initialised process group: call "
            "torch.distributed.init_process_group('gloo' or 'nccl', ...) on every rank first"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {group!r}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    return rank, dist.get_world_size(group)


def check_local(rank: int, q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"rank {rank}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(
                f"rank {rank}: {name} has shape {tuple(t.shape)}; qkv.distributed takes this "
                f"rank's shard as [B, H, L_local, D]"
            )
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    devices = {q.device, k.device, v.device}
    if len(devices) != 1:
        raise ValueError(
            f"rank {rank}: q, k and v are on {q.device}, {k.device} and {v.device}; put this "
            f"rank's shards on one device"
        )
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(
            f"rank {rank}: q {list(q.shape)}, k {list(k.shape)} and v {list(v.shape)} hold "
            f"different numbers of positions; each rank holds the same rows of one sequence "
            f"for q, k and v (self-attention over the split sequence)"
        )


def gather_into(out: Tensor, t: Tensor, group: Any) -> None:
    """``all_gather`` of equal-sized tensors into one (``all_gather_single`` where torch has
    it: ``all_gather_into_tensor`` is deprecated in torch 2.13)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


def _scale_key(scale: object, D: int) -> str:
    """The scale as the call will use it (None is 1/sqrt(D)), so ranks passing None and the
    same number agree; never raises (a bad scale is refused after the ranks agree)."""
    if scale is None:
        return repr(1.0 / math.sqrt(D) if D > 0 else 1.0)
    try:
        return repr(float(scale))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return repr(scale)


def _crc(s: str) -> int:
    return zlib.crc32(s.encode())


FIELDS = (
    "L_local",
    "local error",
    "batch",
    "q heads",
    "kv heads",
    "head dim",
    "value dim",
    "dtype",
    "layout",
    "mask",
    "score_mod",
    "scale",
    "learnable tensors",
    "needs grad",
    "device type",
    "number of tensors the mask and score_mod carry",
    "user mods to probe",
)

# The checksums of the first SLOTS tensors a mask and score carry travel one per field of the
# descriptor (so an error names the one that differs); any further ones share the last field.
SLOTS = 6
_MASK63 = (1 << 63) - 1  # checksums travel as int64


def _slots(content: list[tuple[str, int]]) -> tuple[list[str], list[int]]:
    """The descriptor's content fields: ``SLOTS`` checksums (0 where unused) and their names."""
    if len(content) <= SLOTS:
        names = [w for w, _ in content]
        vals = [c & _MASK63 for _, c in content]
    else:
        rest = content[SLOTS - 1 :]
        names = [w for w, _ in content[: SLOTS - 1]]
        others = ", ".join(w for w, _ in rest)
        names.append(f"the mask's and score_mod's other tensors ({others})")
        vals = [c & _MASK63 for _, c in content[: SLOTS - 1]]
        vals.append(_crc(" ".join(str(c) for _, c in rest)))
    return names + [""] * (SLOTS - len(names)), vals + [0] * (SLOTS - len(vals))


def agree(
    group: Any,
    rank: int,
    W: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    layout: str,
    mask: str,
    score: str,
    scale: float | None,
    n_params: int,
    needs_grad: bool,
    content: Sequence[tuple[str, int]] = (),
    probes: int = 0,
    local_error: Exception | None = None,
) -> Layout:
    """All-gather each rank's description of the call; raise naming the ranks that disagree,
    or whose shard length is not what the layout gives them. Returns the layout.

    A rank whose own inputs were refused (``local_error``) still joins the all_gather, so
    every rank raises instead of the others waiting for it until the group's timeout.

    ``content``: ``(what, checksum)`` of every tensor the mask and score_mod carry
    (:mod:`qkv.distributed.content`): ranks whose mask has the same name and shape but other
    ids, lengths or values are refused here, on every rank, naming the tensor. ``probes``: how
    many user mods the call will probe (:func:`agree_probes`)."""
    if local_error is not None:  # stand-ins, only to fill the descriptor
        q = k = v = torch.zeros(1, 1, 1, 1)
    mine = [
        q.shape[2],
        int(local_error is not None),
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[3],
        v.shape[3],
        _DTYPES.index(q.dtype) if q.dtype in _DTYPES else -1,
        LAYOUTS.index(layout) if layout in LAYOUTS else -1,
        _crc(mask),
        _crc(score),
        _crc(_scale_key(scale, q.shape[3])),
        n_params,
        int(needs_grad),
        _crc(q.device.type),
        len(content),
        probes,
    ]
    names, vals = _slots(list(content))
    mine += vals
    table = _gather_table(group, W, mine, q.device)  # [W, fields + SLOTS]
    if local_error is not None:
        raise local_error
    failed = [r for r in range(W) if table[r][1]]
    if failed:
        raise ValueError(
            f"rank {rank}: ranks {failed} refused their inputs to qd.attention (their error "
            f"says why); this rank stops with them"
        )
    for f, name in enumerate(FIELDS[2:], start=2):
        vals = [row[f] for row in table]
        if len(set(vals)) > 1:
            who = [r for r in range(W) if vals[r] != vals[rank]]
            raise ValueError(
                f"rank {rank}: the ranks disagree on the {name} of qd.attention (ranks {who} "
                f"differ from this one: q {list(q.shape)}, k {list(k.shape)}, v "
                f"{list(v.shape)}, dtype {q.dtype}, layout {layout!r}, mask {mask}, "
                f"score_mod {score}, scale {scale}); every rank must make the same call on "
                f"its own shard"
            )
    for i, what in enumerate(names):
        vals = [row[len(FIELDS) + i] for row in table]
        if len(set(vals)) > 1:
            raise ValueError(
                f"rank {rank}: {what} differ between ranks ({_by_rank(vals, rank)}); every "
                f"rank must pass the same mask and score_mod (mask {mask}, score_mod {score}), "
                f"built from the same tensors: they span the whole sequence, only q, k and v "
                f"are split"
            )
    lengths = [row[0] for row in table]
    L = infer_length(layout, W, lengths)
    if L is None:
        total = sum(lengths)
        want = list(Layout(layout, W, total).lengths) if total >= 1 else []
        bad = [r for r in range(W) if not want or lengths[r] != want[r]]
        raise ValueError(
            f"rank {rank}: shard lengths {lengths} (ranks 0..{W - 1}) are not the {layout} "
            f"layout of any sequence: for L = {total} it gives {want}; ranks {bad} differ "
            f"(this rank holds q {list(q.shape)}). Split with qd.shard(x, layout={layout!r})"
        )
    return Layout(layout, W, L)


def _gather_table(group: Any, W: int, mine: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``mine`` (int64 fields), one all_gather: ``[W, len(mine)]``. On the
    device for NCCL, which gathers only there; on the CPU for gloo."""
    dev = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor(mine, dtype=torch.int64, device=dev)
    out = torch.empty(W * len(mine), dtype=torch.int64, device=dev)
    gather_into(out, t, group=group)
    table: list[list[int]] = out.view(W, len(mine)).cpu().tolist()
    return table


def _by_rank(vals: list[int], rank: int) -> str:
    """``rank 0 has checksum 0x..., rank 1 has 0x... (ranks [1] differ from this one)``."""
    who = [r for r in range(len(vals)) if vals[r] != vals[rank]]
    each = ", ".join(f"rank {r} has {v:#x}" for r, v in enumerate(vals))
    return f"checksums: {each}; ranks {who} differ from this one"


def agree_probes(
    group: Any,
    rank: int,
    W: int,
    device: torch.device,
    probes: tuple[int, int],
    *,
    users: list[str],
    where: str,
    local_error: Exception | None,
) -> None:
    """All-gather the checksums of the user mods' results on the probe grid
    (:func:`qkv.distributed.content.probe`); raise on every rank if they differ, or if a rank
    could not build the global problem or probe it (its own error there)."""
    mine = [int(local_error is not None), probes[0] & _MASK63, probes[1] & _MASK63]
    table = _gather_table(group, W, mine, device)  # [W, 3]
    if local_error is not None:
        raise local_error
    failed = [r for r in range(W) if table[r][0]]
    if failed:
        raise ValueError(
            f"rank {rank}: ranks {failed} refused the mask or score_mod of qd.attention (their "
            f"error says why); this rank stops with them"
        )
    for f, what in ((1, "mask"), (2, "score_mod")):
        vals = [row[f] for row in table]
        if len(set(vals)) > 1:
            raise ValueError(
                f"rank {rank}: the {what} gives different results on different ranks at the "
                f"same global positions ({where}; {_by_rank(vals, rank)}); every rank must "
                f"pass the same {what} ({', '.join(users)}), computing the same thing from "
                f"the same captured values"
            )
