"""The Triton kernels of ``backend="triton"``: a FlashAttention-2 forward and backward that
walk a block-sparse plan.

Each program owns one tile row: a query block (forward, dQ) or a key block (dK/dV), and loops
over the blocks its list names (``num [Bm, Hm, n]``, ``idx`` / ``tag [Bm, Hm, n, W]``; ``Bm``
and ``Hm`` are 1 where the mask is the same for every batch element / head, reached through a
zero stride). A tag of -1 marks a full tile: no mask is evaluated. A tag >= 0 marks a partial
tile, masked in the kernel by the built-in masks' parameters (``HAS_BAND``: ``lo <= kv - q <=
hi``; ``HAS_PREFIX``: ``kv < prefix`` or causal; ``HAS_PAD``: ``start[b] <= kv < limit[b]``;
``HAS_DOC``: ``ids[b, q] == ids[b, kv]``, one row of ids per batch element ``sid`` apart,
or one shared row with ``sid = 0``; all and-ed), or by bit-packed tile ``tag`` of ``BITS``
(``[T, BM, BN // 32]`` int32 words) for any other mask: those are evaluated ahead, in
PyTorch, for the partial tiles only, so no user code is compiled.

Scores follow qkv's contract: ``s = (q . k) * scale``, then the score mod (``SCORE``: 0 none,
1 an additive bias tensor, 2 ALiBi, 3 softcap, 4 relative-position table), then the mask. The
softmax is online in float32 (``exp``, natural log-sum-exp); a row that sees no key gives 0
and lse ``-inf``. Matrix products accumulate in float32 with ``input_precision="ieee"`` (no
TF32 on float32 inputs: the contract is float32 arithmetic).

The layout follows Triton's fused-attention tutorial and FlashAttention-2 (Dao, 2023): the
backward recomputes the probabilities from the saved lse; dK/dV loop over the query blocks
that see a key block (the transposed lists), dQ over the key blocks a query block sees; a
grouped-query key/value head sums over its group's query heads in one program (no copies,
no atomics). Learnable score-mod tensors (ALiBi slopes, the relative table) get their
gradient by atomic adds in the dQ kernel, as does a bias tensor (summed over the dimensions
it broadcasts over).

This package is imported only when the backend runs (``TRITON_INTERPRET=1`` is read by
``triton.jit`` at import, which is how the tests run these kernels on a CPU).
"""

from __future__ import annotations

import os

# triton.jit reads TRITON_INTERPRET when it decorates: this package's kernels are interpreted
# for the life of the process when it was set at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

from .backward import attn_bwd_dkdv, attn_bwd_dq  # noqa: E402
from .forward import attn_fwd  # noqa: E402

__all__ = ["INTERPRETED", "attn_bwd_dkdv", "attn_bwd_dq", "attn_fwd"]
