"""What a call's mask and score_mod *hold*, compared across ranks.

:func:`qkv.distributed.checks.agree` compares the mask's and score_mod's names and shapes;
two ``qkv.document(ids)`` of one length but different ids share both, so each rank would plan
different traffic from its own ids (a size mismatch that kills one rank inside gloo) or
compute a different mask (a silent wrong answer). Every tensor a mask or score carries spans
the whole sequence and is the same on every rank (the ranks shard q, k and v, never the
mask), so each is compared by a checksum:

- the built-ins' tensors (document ids, padding lengths/starts, ALiBi slopes, a
  relative_bias table), a bool mask tensor, a bias tensor, a ``qkv.BlockMask``'s tile states
  and a FlexAttention BlockMask's block lists;
- the tensors a user mask_mod or score_mod closes over (closure cells, defaults, globals it
  names, attributes, ``functools.partial`` arguments, module parameters and buffers);
- and a user mod's *results* on a fixed grid of global positions (:func:`probe`), for what
  no tensor shows (a captured Python number, say). That needs the sequence length, so it is
  a second, small ``all_gather`` made only for calls with a user mod.

The checksum is CRC-32 of the bytes on the CPU (zlib: about 3 GB/s, no temporaries); on an
accelerator, an integer polynomial hash computed where the tensor lies (no copy to the host).
Which one is chosen by the device type of q, which the ranks agree on, so equal contents give
equal checksums on every rank. Integer tensors are hashed as int64 (ids in int32 on one rank
and int64 on another mean the same mask).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import zlib
from typing import Any

import torch

from .._core.builtin_mods import BuiltinMask
from .._core.builtin_scores import BuiltinScore
from .._core.checks import callable_name
from .._core.evaluate import mask_at, score_at
from .._core.problem import Problem
from .._flex.compat import is_flex_block_mask
from ..blockmask import BlockMask

Tensor = torch.Tensor
Item = tuple[str, Tensor | None, str]  # (what, tensor, its shape/dtype when not read)

# The tensors a user's mod closes over are read in full up to this many bytes per call (a mod
# naming a global model would otherwise be hashed whole on every call); beyond it they are
# compared by dtype and shape, and the probe of the mod's results still runs.
CLOSURE_BYTES = 64 << 20

# FlexAttention BlockMask's tensors (torch.nn.attention.flex_attention.BlockMask).
_FLEX_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def checksum(t: Tensor, device_type: str) -> int:
    """A checksum of ``t``'s values (and dtype and shape): CRC-32 of the bytes when
    ``device_type`` (q's) is ``"cpu"``, else a hash computed on q's device type."""
    t = t.detach()
    if not t.dtype.is_floating_point and not t.is_complex() and t.dtype != torch.bool:
        t = t.to(torch.int64)
    head = zlib.crc32(f"{t.dtype} {list(t.shape)}".encode())
    if t.is_meta or t.numel() == 0:
        return head
    if device_type == "cpu":
        raw = t.cpu().contiguous().view(-1).view(torch.uint8).numpy()
        return zlib.crc32(raw, head)  # type: ignore[arg-type]
    return (head << 32) ^ _device_hash(t)


def _device_hash(t: Tensor, chunk: int = 1 << 24) -> int:
    """``sum(w_i * c_i)`` modulo 2^64 over the tensor's bytes as little words ``w_i`` (int16,
    widened to int64, so no product overflows) and odd multipliers ``c_i`` that depend on the
    position: integer arithmetic, so the order of the reduction cannot change the result, and
    a difference in one word, or two words swapped, always changes it."""
    b = t.contiguous().view(-1).view(torch.uint8)
    if b.numel() % 2:
        b = torch.cat((b, b.new_zeros(1)))
    w = b.view(torch.int16)
    total = 0
    for s in range(0, w.numel(), chunk):
        x = w[s : s + chunk].to(torch.int64)
        i = torch.arange(s, s + x.numel(), dtype=torch.int64, device=x.device)
        c = ((i * 0x9E3779B1) & 0x3FFFFFFF) | 1  # < 2^30, odd: |x * c| < 2^45
        total += int((x * c).sum()) + int(x.sum()) * 0x632BE5AB
    return total & 0xFFFFFFFFFFFFFFFF


# ---------------------------------------------------------------------------- collecting


class _Found:
    def __init__(self) -> None:
        self.items: list[Item] = []
        self.user: list[str] = []  # the names of the user mods met (they get probed)
        self.seen: set[int] = set()
        self.closure_bytes = 0

    def add(self, what: str, t: object, *, closure: bool = False) -> None:
        if not isinstance(t, Tensor) or id(t) in self.seen:
            return
        self.seen.add(id(t))
        nbytes = t.numel() * t.element_size()
        if closure and self.closure_bytes + nbytes > CLOSURE_BYTES:
            self.items.append((what, None, f"{t.dtype} {list(t.shape)}"))
            return
        self.closure_bytes += nbytes if closure else 0
        self.items.append((what, t, ""))


def _builtin(obj: object) -> list[tuple[str, object]] | None:
    """What one of qkv's own masks or scores holds (its ``carried()``), or None for anything
    else."""
    if not isinstance(obj, (BuiltinMask, BuiltinScore)):
        return None
    carried = getattr(obj, "carried", None)
    return carried() if callable(carried) else None


def _mask(m: object, f: _Found, depth: int = 0) -> None:
    if m is None or depth > 10:
        return
    if isinstance(m, Tensor):
        f.add(f"the mask's bool tensor {list(m.shape)}", m)
    elif isinstance(m, BlockMask):
        f.add("the BlockMask's tile states", m.states)
        _mask(m.mask, f, depth + 1)
    elif is_flex_block_mask(m):
        for name in _FLEX_FIELDS:
            f.add(f"the FlexAttention BlockMask's {name}", getattr(m, name, None))
        _mask(getattr(m, "mask_mod", None), f, depth + 1)
    elif (held := _builtin(m)) is not None:
        for what, x in held:  # tensors, or the parts of a combination
            if isinstance(x, Tensor):
                f.add(f"the {what} of the mask {m!r}", x)
            else:
                _mask(x, f, depth + 1)
    elif callable(m):
        _user(m, "mask_mod", f)


def _score(s: object, f: _Found) -> None:
    if s is None:
        return
    if isinstance(s, Tensor):
        f.add(f"the score_mod's bias tensor {list(s.shape)}", s)
    elif (held := _builtin(s)) is not None:
        for what, x in held:
            f.add(f"the {what} of the score_mod {s!r}", x)
    elif callable(s):
        _user(s, "score_mod", f)


def _user(fn: object, kind: str, f: _Found) -> None:
    name = callable_name(fn)
    f.user.append(f"{kind} {name}")
    found: list[Tensor] = []
    _walk(fn, found, f, set(), 0)
    for i, t in enumerate(found):
        f.add(f"tensor {i} {list(t.shape)} that the {kind} {name} closes over", t, closure=True)


def _walk(obj: Any, out: list[Tensor], f: _Found, seen: set[int], depth: int) -> None:
    """Every tensor ``obj`` reaches (as ``backends.blocksparse.autograd.captured`` looks for
    learnable ones); qkv's built-ins met on the way give their own tensors, not their
    per-device caches (which differ by what ran before on each rank)."""
    if id(obj) in seen or depth > 10:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        out.append(obj)
    elif isinstance(obj, (BlockMask, BuiltinMask)):
        _mask(obj, f, depth)
    elif isinstance(obj, BuiltinScore):
        _score(obj, f)
    elif isinstance(obj, torch.nn.Module):
        for t in (*obj.parameters(), *obj.buffers()):
            _walk(t, out, f, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for x in obj:
            _walk(x, out, f, seen, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            _walk(x, out, f, seen, depth + 1)
    elif isinstance(obj, functools.partial):
        _walk((obj.func, obj.args, obj.keywords), out, f, seen, depth + 1)
    elif inspect.ismethod(obj):
        _walk((obj.__self__, obj.__func__), out, f, seen, depth + 1)
    elif isinstance(obj, types.FunctionType):
        cells = []
        for c in obj.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell has no contents
                cells.append(c.cell_contents)
        names = [obj.__globals__[n] for n in obj.__code__.co_names if n in obj.__globals__]
        names = [x for x in names if not isinstance(x, (types.ModuleType, type))]
        _walk(
            (cells, obj.__defaults__ or (), obj.__kwdefaults__ or {}, names),
            out,
            f,
            seen,
            depth + 1,
        )
    elif not isinstance(obj, (types.ModuleType, type, str, bytes, int, float, bool, type(None))):
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            _walk(attrs, out, f, seen, depth + 1)


def collect(mask: object, score_mod: object) -> tuple[list[Item], list[str]]:
    """The tensors the mask and score_mod carry, named, in a fixed order, and the user mods
    among them (``"mask_mod name"``): those are probed once the length is agreed."""
    f = _Found()
    _mask(mask, f)
    _score(score_mod, f)
    return f.items, f.user


def checksums(items: list[Item], device_type: str) -> list[int]:
    return [
        checksum(t, device_type) if t is not None else zlib.crc32(meta.encode())
        for _, t, meta in items
    ]


# ------------------------------------------------------------------------------- probing


def positions(L: int) -> list[int]:
    """The global positions a user mod is probed at: both ends, spread over the sequence,
    and a few from a generator seeded by ``L`` (the same on every rank); at most 16."""
    spread = {0, 1, L - 2, L - 1, *(L * i // 8 for i in range(1, 8))}
    g = torch.Generator().manual_seed(L)
    spread |= set(torch.randint(0, L, (5,), generator=g).tolist())
    return sorted(p for p in spread if 0 <= p < L)


def probe(p: Problem) -> tuple[int, int]:
    """Checksums of the classified mask's and score's results on a fixed grid: batches and
    heads ``0..min(n, 4)``, queries and keys at :func:`positions` of the global problem."""
    dev = p.device
    pos = torch.tensor(positions(p.Lq), dtype=torch.int64, device=dev)
    nb, nh, n = min(p.B, 4), min(p.Hq, 4), pos.numel()
    at = ((0, nb), (0, nh), pos, pos)
    shape = (nb, nh, n, n)
    m = s = 0
    with torch.no_grad():
        mask = mask_at(p.mask, *at, dev)
        if mask is not None:
            m = checksum(mask.expand(shape), "cpu")
        if p.score.score_mod is not None:
            wd = torch.float64 if p.dtype == torch.float64 else torch.float32
            score = torch.linspace(-3.0, 3.0, nb * nh * n * n, dtype=wd, device=dev)
            # Unchecked: a bad result is the call's own error, raised where it would be.
            got = score_at(p.score, score.view(shape), *at, check=False)
            s = checksum(torch.as_tensor(got).to(wd).expand(shape), "cpu")
    return m, s
