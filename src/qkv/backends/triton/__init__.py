"""The Triton backend: one fused GPU kernel (forward and backward) over the block-sparse plan.

It runs the tile plan the CPU engine runs: per query block the key blocks it sees, each full
(no mask evaluated) or partial. Built-in masks are evaluated inside the kernel from their
parameters; any other mask (or-combinations, bool tensors, mask_mods) reaches it as bits of
its partial tiles, evaluated ahead in PyTorch, so user code is never compiled. Built-in score
mods (ALiBi, softcap, the relative table, with their tensors' gradients) and additive bias
tensors run inside the kernel; grouped-query attention reads each key/value head once per
group, with no copies.

On CUDA tensors it needs the ``triton`` package (CUDA builds of torch ship it). On CPU tensors
it runs only in Triton's interpreter (``TRITON_INTERPRET=1`` before the first call; hundreds of
times slower, for tests), and ``backend="auto"`` never picks it there.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import weakref

import torch

from ..._core.kindspec import unwatched
from ..._core.problem import Problem
from ..base import Backend, Route, imprecise_backward, no_keys_result, unit_last_stride
from . import launch
from .launch import Call, TritonAttention, score_param, tilings
from .lists import block_mask_at, mask_spec, tile_lists

Tensor = torch.Tensor

__all__ = ["TritonBackend"]

# Largest head dim: the kernels keep a [BM, D] query tile and [BN, D] key and value tiles in
# registers and shared memory; FlashAttention-2 stops at 256 too.
MAX_HEAD_DIM = 256


# Looked up once, here: a cache filled on first use would be a global that dynamo sees change
# after its first trace (a recompile), and functools.cache warns under dynamo.
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


class TritonBackend(Backend):
    """Fused block-sparse attention in Triton (CUDA; the interpreter on the CPU)."""

    name = "triton"
    materialises_scores = False  # O(n) memory: tiles only

    def auto_skip(self, p: Problem) -> str | None:
        if p.device.type != "cuda":
            return "Triton's interpreter runs on the CPU only for tests (hundreds of times slower)"
        return imprecise_backward(p)

    def rejects(self, p: Problem) -> str | None:
        if not _HAVE_TRITON:
            return "the triton package is not installed (CUDA builds of torch ship it)"
        if p.device.type == "cpu" and not launch.interpreted():
            return (
                "its kernels run on CUDA tensors; on the CPU only in Triton's interpreter "
                "(set TRITON_INTERPRET=1 before the first call; slow, for tests)"
            )
        if p.device.type not in ("cuda", "cpu"):
            return f"its kernels run on CUDA tensors (these are on {p.device.type})"
        if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            name = str(p.dtype).replace("torch.", "")
            return f"it computes float16, bfloat16 and float32 (inputs are {name})"
        if max(p.D, p.Dv) > MAX_HEAD_DIM:
            return f"head dims up to {MAX_HEAD_DIM} (got D={p.D}, Dv={p.Dv})"
        if p.dropout_p > 0:
            return "it has no dropout (blocksparse and sdpa do)"
        if p.score.is_user:
            return (
                "a Python score_mod cannot run inside the kernel without compiling user code; "
                "blocksparse evaluates it per tile (exact, no compile)"
            )
        return None

    def route(self, p: Problem, *, dry_run: bool = False) -> Route:
        spec = mask_spec(p.mask, p.B, p.Lq, p.Lk, p.device)
        t = tilings(p, spec)
        fwd_bm = block_mask_at(p.mask, p.shape, (t.fwd.bq, t.fwd.bk), p.device)
        notes = []
        if spec.bits:
            notes.append(
                "the mask has no in-kernel formula: its partial tiles are evaluated once in "
                "PyTorch and read by the kernel as packed bits"
            )
        if launch.interpreted():
            notes.append("TRITON_INTERPRET=1: the kernels run in Triton's interpreter")
        call = None
        if not dry_run:
            built = {(t.fwd.bq, t.fwd.bk): fwd_bm}
            # (the tile lists read the mask, not the call: a plan holds none of its tensors)
            mask, shape, device = p.mask, p.shape, p.device

            @functools.cache
            def lists_at(size: tuple[int, int]) -> object:
                bm = built.get(size) or block_mask_at(mask, shape, size, device)
                return tile_lists(bm, mask, spec, shape, device)

            lists_at((t.fwd.bq, t.fwd.bk))  # the forward's now: planning errors surface here
            planned = weakref.ref(p) if unwatched(p.mask) else None
            call = Call(p=None, spec=spec, lists=lists_at, tiles=t, planned=planned)
        return Route(
            forward=(
                f"triton fused forward, {t.fwd.bq}x{t.fwd.bk} tiles over the visible blocks, "
                f"mask in the kernel: {spec.text}"
            ),
            backward=(
                f"triton fused backward (recomputed from the lse): dK/dV per {t.dkdv.bk}-key "
                f"block over the {t.dkdv.bq}-row query blocks that see it, dQ per "
                f"{t.dq.bq}-row query block over {t.dq.bk}-key blocks"
            ),
            extra_memory=_extra_memory(p),
            block=fwd_bm,
            notes=tuple(notes),
            detail=call,
        )

    def keep(self, route: Route) -> Route:
        call = route.detail
        if isinstance(call, Call) and call.planned is not None:  # (tiles planned per call)
            return dataclasses.replace(route, block=None, detail=None)
        return route

    def run(self, p: Problem, route: Route) -> tuple[Tensor, Tensor | None]:
        call = route.detail
        if not isinstance(call, Call) or (call.planned is not None and call.planned() is not p):
            # kept without its tile lists (made from values a signature does not watch)
            call = self.route(p).detail
            assert isinstance(call, Call)
        call = dataclasses.replace(call, p=p)  # the plan's, bound to this call
        if p.B * p.Hq * p.Lq == 0 or p.Lk == 0:
            return no_keys_result(p)
        q, k, v = (unit_last_stride(t) for t in (p.q, p.k, p.v))  # kernels read D densely
        param = score_param(p)
        tracked = [q, k, v, *([param] if param is not None else [])]
        if torch.is_grad_enabled() and any(t.requires_grad for t in tracked):
            out, lse = TritonAttention.apply(call, q, k, v, param)
        else:
            out, lse = launch.forward(call, q, k, v, param, out_dtype=q.dtype)
        return out, (lse if p.return_lse else None)


def _extra_memory(p: Problem) -> int:
    lse = p.B * p.Hq * p.Lq * 4
    grads = 0
    if p.requires_grad():  # float32 dq, dk, dv and delta
        grads = (p.q.numel() + p.k.numel() + p.v.numel()) * 4 + lse
    return lse + grads
