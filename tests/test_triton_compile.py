"""The Triton kernels compile for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter (the oracle matrix's ``triton`` cases) runs the kernels' arithmetic but not
Triton's compiler: type errors in loop-carried values, layouts, shared memory beyond the
chip's limit only show when compiling. Triton and ptxas compile for a GPU on any machine, so
every kernel family is compiled here as a launch would specialise it (``qkv.backends.triton.
ahead``: every dtype, the three head-dim tiers, each in-kernel mask term, bits, every score
kind with its gradient; ``--quick``: one variant per head-dim tier and dtype), in a fresh
process without ``TRITON_INTERPRET``. ``python -m qkv.backends.triton.ahead`` compiles all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

# Hopper's largest shared memory per block (227 KB): a kernel needing more fails at launch.
SM90_SHARED = 232448
KERNELS = {"attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"}


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")])
    res = subprocess.run(
        [sys.executable, "-m", "qkv.backends.triton.ahead", "90", "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    variants = {r["variant"] for r in rows}
    assert len(variants) >= 5 and len(rows) == 3 * len(variants)
    for v in variants:
        assert {r["kernel"] for r in rows if r["variant"] == v} == KERNELS, v
    for r in rows:
        assert 0 < r["shared"] <= SM90_SHARED, r
        assert r["registers"] > 0, r
    # bfloat16 and float16 run on Hopper's tensor cores (wgmma) forward
    low = [r for r in rows if r["kernel"] == "attn_fwd" and not r["variant"].startswith("fp32")]
    assert low and all(r["wgmma"] for r in low), low
