"""Look inside attention: exact weights and statistics from the fast path, and recording.

- :func:`weights` rebuilds the exact weights of chosen query rows/heads from the lse that
  ``qkv.attention(..., return_lse=True)`` returns, in ``O(rows × Lk)`` memory.
- :func:`stats` computes per-key received mass, per-row entropy and per-row top-k keys block by
  block, never forming the ``Lq × Lk`` matrix.
- :func:`record` captures what every qkv attention call inside a model saw, per layer.
"""

from ._record import Capture, Recording, record
from ._stats import Stats, stats
from ._weights import weights

__all__ = ["Capture", "Recording", "Stats", "record", "stats", "weights"]
