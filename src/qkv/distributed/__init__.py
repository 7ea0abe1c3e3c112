"""qkv.distributed: exact attention over a sequence split across processes (context
parallelism), on ``torch.distributed``.

Each rank holds its shard of the sequence, ``[B, H, L_local, D]``; :func:`attention` returns
its rows of the full attention, moving by ``isend``/``irecv`` only the key/value chunks that
the mask lets some of its queries see (qkv's block classification at global positions), and
:func:`plan` says in advance which, how many bytes and how many FLOPs per rank. Not imported
by ``import qkv``: ``import qkv.distributed as qd``.

    q_l, k_l, v_l = (qd.shard(t, layout="zigzag") for t in (q, k, v))
    out_l = qd.attention(q_l, k_l, v_l, mask=qkv.causal, layout="zigzag")
    out = qd.unshard(out_l, layout="zigzag")
    print(qd.plan(B, H, L, D, mask=qkv.causal, world_size=4, layout="zigzag"))

A model built from ``qkv.MultiHeadAttention`` runs over a split sequence with
``mha(x_local, mask=qkv.causal, context_parallel=True)`` (or a group, or
``qd.ContextParallel(group, layout)``).
"""

from .api import attention, plan, shard, unshard
from .layout import LAYOUTS, Layout
from .module import ContextParallel
from .plan import Plan, RankPlan, Step
from .transport import Traffic, traffic

__all__ = [
    "LAYOUTS",
    "ContextParallel",
    "Layout",
    "Plan",
    "RankPlan",
    "Step",
    "Traffic",
    "attention",
    "plan",
    "shard",
    "traffic",
    "unshard",
]
