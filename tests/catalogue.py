"""The test catalogue: the named masks, score_mods, shapes and dtypes every oracle test draws
from, and the one q/k/v factory.

Each oracle test file used to write its own list of masks and score_mods; they drifted (five
sliding windows of different widths, four ways to make q, k, v). Now a test names what it
wants and the catalogue builds it:

    shape = Shape(B=2, Hq=4, Hkv=2, Lq=70, Lk=90, D=24, Dv=16)
    gen = torch.Generator().manual_seed(0)
    q, k, v = make_qkv(shape, dtype=torch.bfloat16, gen=gen)
    mask = make_mask("document", shape, gen)
    score_mod, params = make_score("relative", shape, gen)   # params: tensors it closes over

``MASKS`` and ``SCORES`` map a name to an :class:`Entry` whose ``doc`` says what the case is
for and whose flags let a test pick a subset (``analytic`` built-ins for the block-mask
planner, no ``tensor`` entries for FlexAttention, ``dead_rows`` for the fully-masked-row
contract). Every factory draws its random values from the generator it is given, so a case
is reproducible from its seed alone. Everything here goes through qkv's public API.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import qkv

Tensor = torch.Tensor

# ------------------------------------------------------------------------------ the axes

BATCHES = [1, 2]
# (Hq, Hkv): one head, multi-head, grouped-query (4 query heads per kv head), multi-query.
HEADS = [(1, 1), (4, 4), (8, 2), (8, 1)]
# Lengths that are not multiples of any block size (1, 7, 113, 1025), and one that is (256).
LENGTHS = [1, 7, 113, 256, 1025]
# (Lq, Lk) pairs with Lq != Lk both ways, single keys and queries, and one square pair.
LENGTH_PAIRS = [
    (1, 7),
    (7, 113),
    (113, 256),
    (256, 7),
    (1025, 113),
    (113, 1025),
    (7, 1),
    (256, 256),
]
# Odd head dims (59, 111) beside the usual ones.
HEAD_DIMS = [8, 59, 64, 111, 128]
# (D, Dv) pairs: value dims that differ from the head dim both ways.
DIM_PAIRS = [(8, 8), (59, 59), (64, 32), (111, 111), (128, 128), (64, 64), (59, 111)]
# The matrix's dtypes: float32, and bfloat16 (accumulated in float32 by the contract).
DTYPES = [torch.float32, torch.bfloat16]
# The dtypes the matrix leaves to dedicated tests: float16 (same contract as bfloat16) and
# float64 (exact against the oracle up to summation order).
OTHER_DTYPES = [torch.float16, torch.float64]
# Every name `backend=` takes. test_backends checks that qkv's own error message lists
# exactly these, so a new backend cannot miss the oracle matrix.
BACKENDS = ["auto", "decode", "sdpa", "triton", "blocksparse", "reference"]
# Memory layouts of the same values (the contract: the answer never depends on them):
# - contiguous;
# - transposed: stored [.., D, L] and viewed back (last-dim stride L, as x.mT gives);
# - every_other: every other element of a wider buffer (x[..., ::2]: last-dim stride 2);
# - permuted: stored [L, B, H, D] (a [B, L, H, D] projection viewed as heads);
# - offset: a view 7 elements into its storage;
# - expanded: one head expanded over all (stride 0 along heads; the values change, as a
#   user's expanded tensor's do, and the oracle sees the same tensor).
# "every_other" and "offset" fill the storage they skip with NaN, so a kernel that reads
# outside its view fails loudly instead of quietly.
LAYOUTS = ["contiguous", "transposed", "every_other", "permuted", "offset", "expanded"]


@dataclass(frozen=True)
class Shape:
    """A problem's sizes in the house vocabulary: ``q [B, Hq, Lq, D]``, ``k [B, Hkv, Lk, D]``,
    ``v [B, Hkv, Lk, Dv]``. ``Dv`` defaults to ``D``."""

    B: int
    Hq: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    Dv: int | None = None

    def __post_init__(self) -> None:
        if self.Dv is None:
            object.__setattr__(self, "Dv", self.D)

    def replace(self, **changes: int) -> Shape:
        """This shape with some sizes changed (``Dv`` stays as it was unless given)."""
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return f"B{self.B}-H{self.Hq}x{self.Hkv}-L{self.Lq}x{self.Lk}-D{self.D}x{self.Dv}"


SHAPES = {
    # The block-level default: GQA, Lq != Lk, Dv != D, lengths that no block size of 16
    # divides (70 = 4x16 + 6, 90 = 5x16 + 10).
    "tiles": Shape(2, 4, 2, 70, 90, 24, 16),
    # Small and odd: GQA, Lq != Lk, an odd head dim.
    "odd": Shape(2, 4, 2, 37, 29, 59),
    # Every mask on one tiny GQA problem (cheap enough to run with every score_mod).
    "tiny": Shape(2, 4, 2, 7, 13, 16),
    # FlexAttention's eager CPU path is slow: a small GQA problem with Lq != Lk.
    "flex": Shape(2, 4, 2, 40, 56, 16),
}


def as_generator(gen: torch.Generator | int | None) -> torch.Generator:
    """``gen`` itself, or a CPU generator seeded with it (``None`` means seed 0)."""
    if isinstance(gen, torch.Generator):
        return gen
    return torch.Generator().manual_seed(0 if gen is None else gen)


def make_qkv(
    shape: Shape,
    *,
    dtype: torch.dtype = torch.float32,
    gen: torch.Generator | int | None = None,
    requires_grad: bool = False,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Standard-normal ``q [B, Hq, Lq, D]``, ``k [B, Hkv, Lk, D]``, ``v [B, Hkv, Lk, Dv]``.

    Drawn in float32 from ``gen`` (a generator, which the caller may go on drawing masks
    from, or a seed), in the order q, k, v, then cast to ``dtype`` and moved to ``device``:
    the same seed gives the same numbers in every dtype. ``requires_grad`` makes them leaves
    that need a gradient."""
    g = as_generator(gen)
    s = shape
    q = torch.randn(s.B, s.Hq, s.Lq, s.D, generator=g)
    k = torch.randn(s.B, s.Hkv, s.Lk, s.D, generator=g)
    v = torch.randn(s.B, s.Hkv, s.Lk, s.Dv, generator=g)  # type: ignore[arg-type]
    out = tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))
    if requires_grad:
        out = tuple(t.requires_grad_() for t in out)
    return out  # type: ignore[return-value]


def lay_out(t: Tensor, layout: str) -> Tensor:
    """``t [B, H, L, X]`` (contiguous) in the memory ``layout`` (one of :data:`LAYOUTS`), as a
    view that autograd can differentiate through to ``t``."""
    if layout == "contiguous":
        return t
    if layout == "transposed":
        return t.detach().mT.contiguous().mT.requires_grad_(t.requires_grad)
    if layout == "every_other":
        wide = torch.stack([t.detach(), torch.full_like(t.detach(), float("nan"))], dim=-1)
        return wide[..., 0].requires_grad_(t.requires_grad)  # [B, H, L, X], stride(-1) == 2
    if layout == "permuted":
        stored = t.detach().permute(2, 0, 1, 3).contiguous()  # [L, B, H, X]
        return stored.permute(1, 2, 0, 3).requires_grad_(t.requires_grad)  # [B, H, L, X]
    if layout == "offset":
        buf = torch.full((t.numel() + 7,), float("nan"), dtype=t.dtype, device=t.device)
        buf[7:].copy_(t.detach().reshape(-1))
        return buf[7:].view(t.shape).requires_grad_(t.requires_grad)
    if layout == "expanded":
        return t.detach()[:, :1].expand(t.shape).requires_grad_(t.requires_grad)
    raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")


def index_tensors(
    B: int, H: int, Lq: int, Lk: int, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The broadcastable int64 index tensors qkv calls a mask_mod or score_mod with, built from
    the README's contract: ``b [B,1,1,1]``, ``h [1,H,1,1]``, ``q_idx [1,1,Lq,1]``,
    ``kv_idx [1,1,1,Lk]``."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)  # [B, 1, 1, 1]
    h = torch.arange(H, device=device).view(1, H, 1, 1)  # [1, H, 1, 1]
    qi = torch.arange(Lq, device=device).view(1, 1, Lq, 1)  # [1, 1, Lq, 1]
    ki = torch.arange(Lk, device=device).view(1, 1, 1, Lk)  # [1, 1, 1, Lk]
    return b, h, qi, ki


# ----------------------------------------------------------------------------- the entries


@dataclass(frozen=True)
class Entry:
    """One named case. ``make(shape, gen, device)`` builds it: a mask (a mask_mod, a bool
    tensor or ``None``), or a score_mod (see :func:`make_score`)."""

    doc: str
    make: Callable[..., Any]
    # A built-in mask or an and/or of built-ins: qkv plans its tiles from its structure,
    # never evaluating a position.
    analytic: bool = False
    # A tensor rather than a callable (FlexAttention takes callables only).
    tensor: bool = False
    # Some query rows see no key at all (output 0, lse -inf, zero gradients).
    dead_rows: bool = False


def _sorted_ids(shape: Shape, gen: torch.Generator, device: Any) -> Tensor:
    n = max(shape.Lq, shape.Lk)
    return torch.sort(torch.randint(0, 4, (n,), generator=gen))[0].to(device)


def _padding(s: Shape, g: torch.Generator, d: Any) -> Any:
    lengths = torch.randint(0, s.Lk + 1, (s.B,), generator=g)
    if s.B == 1:
        return qkv.padding(lengths.to(d))  # right padding
    lengths[0] = 0  # a batch element with no keys at all: every row fully masked
    # Left (and both-sided) padding: each row's keys start anywhere that leaves room.
    start = (torch.rand(s.B, generator=g) * (s.Lk - lengths + 1)).long()
    return qkv.padding(lengths.to(d), start=start.to(d))


def _rows_masked(s: Shape, g: torch.Generator, d: Any) -> Tensor:
    m = torch.rand(s.Lq, s.Lk, generator=g) > 0.5
    m[::3] = False  # every third query row sees nothing
    return m.to(d)


def _prefix_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return kv_idx < 5


def _dilated(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (q_idx - kv_idx) % 3 == 0


def _head_dependent(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return kv_idx <= q_idx + 2 * h


def _dead_rows(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (q_idx % 5 != 0) & (kv_idx <= q_idx)


def _key_zero(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return kv_idx == 0


MASKS: dict[str, Entry] = {
    "none": Entry("no mask: every query sees every key", lambda s, g, d: None),
    "causal": Entry(
        "qkv.causal, top-left aligned (Lq != Lk included)",
        lambda s, g, d: qkv.causal,
        analytic=True,
    ),
    "window": Entry(
        "a narrow causal band, sliding_window(5): six keys per row, inside one or two tiles",
        lambda s, g, d: qkv.sliding_window(5),
        analytic=True,
    ),
    "window2": Entry(
        "a two-sided band reaching further ahead than a 16-wide tile, sliding_window(3, 20)",
        lambda s, g, d: qkv.sliding_window(3, 20),
        analytic=True,
    ),
    "diagonal": Entry(
        "the narrowest band, sliding_window(0): each query sees only the key at its position",
        lambda s, g, d: qkv.sliding_window(0),
        analytic=True,
    ),
    "document": Entry(
        "packed documents with sorted ids (4 documents at random boundaries): the engine runs "
        "them as mask-free segments",
        lambda s, g, d: qkv.document(_sorted_ids(s, g, d)),
        analytic=True,
    ),
    "document_unsorted": Entry(
        "document ids in no order (3 ids interleaved): tiles hold several documents",
        lambda s, g, d: qkv.document(torch.randint(0, 3, (max(s.Lq, s.Lk),), generator=g).to(d)),
        analytic=True,
    ),
    "padding": Entry(
        "key padding with random lengths in [0, Lk]; with B > 1 batch 0 has no keys at all "
        "and each row's keys start at a random position (left padding)",
        _padding,
        analytic=True,
        dead_rows=True,
    ),
    "prefix_lm": Entry(
        "prefix_lm(9): a 9-key prefix every query sees, causal after it (the whole of Lk < 9)",
        lambda s, g, d: qkv.prefix_lm(9),
        analytic=True,
    ),
    "and": Entry(
        "and_masks of two built-ins: causal within sorted documents (planned analytically)",
        lambda s, g, d: qkv.and_masks(qkv.causal, qkv.document(_sorted_ids(s, g, d))),
        analytic=True,
    ),
    "or": Entry(
        "or_masks of two built-ins: a window or a prefix (planned analytically)",
        lambda s, g, d: qkv.or_masks(qkv.sliding_window(3), qkv.prefix_lm(5)),
        analytic=True,
    ),
    "and_mod": Entry(
        "and_masks of a built-in and an arbitrary mask_mod: causal and dilated (evaluated)",
        lambda s, g, d: qkv.and_masks(qkv.causal, _dilated),
    ),
    "or_mod": Entry(
        "or_masks of a built-in and an arbitrary mask_mod: a window or key 0 (evaluated)",
        lambda s, g, d: qkv.or_masks(qkv.sliding_window(2), _key_zero),
    ),
    "bool": Entry(
        "a random bool tensor [B, 1, Lq, Lk]: varies over batch, broadcast over heads",
        lambda s, g, d: (torch.rand(s.B, 1, s.Lq, s.Lk, generator=g) > 0.3).to(d),
        tensor=True,
    ),
    "rows_masked": Entry(
        "a random bool tensor [Lq, Lk] (broadcast over batch and heads) whose every third "
        "row is all False",
        _rows_masked,
        tensor=True,
        dead_rows=True,
    ),
    "prefix_mod": Entry(
        "an arbitrary mask_mod of the key index only: kv_idx < 5",
        lambda s, g, d: _prefix_mod,
    ),
    "dilated": Entry(
        "an arbitrary mask_mod with no block structure, (q - k) % 3 == 0: every tile partial",
        lambda s, g, d: _dilated,
    ),
    "head_dependent": Entry(
        "an arbitrary mask_mod that reads the head: kv_idx <= q_idx + 2 h",
        lambda s, g, d: _head_dependent,
    ),
    "dead_rows": Entry(
        "an arbitrary mask_mod under which every fifth query row sees no key",
        lambda s, g, d: _dead_rows,
        dead_rows=True,
    ),
}


def make_mask(
    name: str,
    shape: Shape,
    gen: torch.Generator | int | None = None,
    *,
    device: torch.device | str | None = None,
) -> Any:
    """The mask ``MASKS[name]`` for a problem of ``shape`` (random parts drawn from ``gen``,
    tensors on ``device``): a mask_mod, a bool tensor or ``None``."""
    return MASKS[name].make(shape, as_generator(gen), device)


def _learnable(t: Tensor, grad: bool, device: Any) -> Tensor:
    return t.to(device).requires_grad_(grad)


def _alibi(s: Shape, g: torch.Generator, d: Any, grad: bool) -> tuple[Any, tuple[Tensor, ...]]:
    slopes = _learnable(qkv.alibi_slopes(s.Hq), grad, d)
    return qkv.alibi(slopes), (slopes,) if grad else ()


def _relative(s: Shape, g: torch.Generator, d: Any, grad: bool) -> tuple[Any, tuple[Tensor, ...]]:
    table = _learnable(torch.randn(2 * 4 + 1, s.Hq, generator=g), grad, d)
    return qkv.relative_bias(table, 4), (table,) if grad else ()


def _closure(s: Shape, g: torch.Generator, d: Any, grad: bool) -> tuple[Any, tuple[Tensor, ...]]:
    w = _learnable(torch.randn(s.Hq, generator=g), grad, d)

    def head_gate(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score * torch.sigmoid(w)[h] * 2 + w[h] * torch.cos((q_idx - kv_idx).float() / 7)

    return head_gate, (w,) if grad else ()


SCORES: dict[str, Entry] = {
    "none": Entry("no score_mod", lambda s, g, d, grad: (None, ())),
    "bias": Entry(
        "an additive bias tensor [1, Hq, Lq, Lk] (per head, broadcast over batch): its "
        "gradient is a reduction over the batch",
        lambda s, g, d, grad: (torch.randn(1, s.Hq, s.Lq, s.Lk, generator=g).to(d), ()),
        tensor=True,
    ),
    "bias_batch": Entry(
        "an additive bias tensor [B, 1, Lq, Lk] (per batch element, broadcast over heads): "
        "its gradient is a reduction over the heads",
        lambda s, g, d, grad: (torch.randn(s.B, 1, s.Lq, s.Lk, generator=g).to(d), ()),
        tensor=True,
    ),
    "alibi": Entry(
        "qkv.alibi with the standard slopes, as a learnable tensor [Hq] the score_mod closes over",
        _alibi,
    ),
    "softcap": Entry(
        "qkv.softcap(2.0): a score_mod whose derivative is not 1",
        lambda s, g, d, grad: (qkv.softcap(2.0), ()),
    ),
    "relative": Entry(
        "qkv.relative_bias with a learnable random table [2*4+1, Hq] (distance clamped at 4)",
        _relative,
    ),
    "closure": Entry(
        "a plain Python function closing over a learnable w [Hq]: score * 2 sigmoid(w[h]) + "
        "w[h] cos((q - k) / 7), so its gradient depends on the score and on the position",
        _closure,
    ),
}


def make_score(
    name: str,
    shape: Shape,
    gen: torch.Generator | int | None = None,
    *,
    grad: bool = True,
    device: torch.device | str | None = None,
) -> tuple[Any, tuple[Tensor, ...]]:
    """``(score_mod, params)``: the score_mod ``SCORES[name]`` for a problem of ``shape`` and
    the tensors it closes over. With ``grad`` (the default) those are float32 leaves that need
    a gradient, for ``compare_to_oracle(..., extra_params=params)``; without it ``params`` is
    empty and nothing needs a gradient (inspection, FlexAttention). A bias tensor is returned
    as the score_mod itself; ``compare_to_oracle`` differentiates it on its own."""
    return SCORES[name].make(shape, as_generator(gen), device, grad)  # type: ignore[no-any-return]
