#!/usr/bin/env bash
# The one prepared GPU run (qkv on CUDA), for a machine with one NVIDIA GPU (an
# H200 here) and torch + triton already installed; it installs nothing. From the repository
# root:   bash benchmarks/gpu_check.sh [OUT_DIR]      (default: $OUT, else ./gpu-results)
#
# Within 8 minutes, most valuable first, each step bounded and writing its own files so that
# a step that fails or runs out of time costs only itself:
#   1. env.txt          GPU, driver, torch and triton versions
#   2. sanity.txt       one forward+backward per kernel family against float32 SDPA (~30 s:
#                       compiles the kernels; a broken build shows here first)
#   3. results.md/json  benchmarks/bench_gpu.py: the issue's benchmark table (~4 min)
#   4. cuda_tests.txt   the CUDA suite: tests/test_triton.py (every test, on the GPU), the
#                       oracle matrix's triton cases on CUDA, and every `-m cuda` test
set -u
out=${1:-${OUT:-gpu-results}}
mkdir -p "$out"
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MPLCONFIGDIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
unset TRITON_INTERPRET
py=${PYTHON:-python3}
start=$(date +%s)

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $py -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

timeout 120 $py - >"$out/sanity.txt" 2>&1 <<'PY'
import time, torch, torch.nn.functional as F, qkv
dev, dt = "cuda", torch.bfloat16
for mask, dense in [(qkv.causal, "causal"), (qkv.sliding_window(100), "window"), (lambda b, h, q, k: (q - k) % 3 == 0, "mod")]:
    q, k, v = (torch.randn(1, 8, 1000, 128, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    t = time.perf_counter()
    out = qkv.attention(q, k, v, mask=mask, backend="triton")
    out.float().pow(2).sum().backward()
    torch.cuda.synchronize()
    i = torch.arange(1000, device=dev)
    m = (mask(None, None, i[:, None], i[None, :]) if dense == "mod" else (i[:, None] >= i[None, :])
         & ((i[:, None] - i[None, :] <= 100) if dense == "window" else True))
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=m)
    ref.pow(2).sum().backward()
    errs = [float((a.float() - b).abs().max()) for a, b in [(out, ref), (q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)]]
    print(f"{dense}: {time.perf_counter() - t:.1f} s (compile included), max |err| out/dq/dk/dv vs float32 SDPA: " + " ".join(f"{e:.2e}" for e in errs))
PY
cat "$out/sanity.txt"

timeout 330 $py benchmarks/bench_gpu.py --out "$out" --rounds 5 --reps 5 >"$out/bench.txt" 2>&1
echo "bench exit $? after $(( $(date +%s) - start )) s"; tail -25 "$out/bench.txt"

left=$(( 470 - ($(date +%s) - start) ))
[ "$left" -gt 30 ] || left=30
per_test=$($py -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120")
timeout "$left" $py -m pytest -p no:cacheprovider -q --maxfail=20 $per_test \
  tests/test_triton.py "tests/test_backends.py::test_backend_matches_oracle" -k "triton or cuda" \
  >"$out/cuda_tests.txt" 2>&1
echo "triton tests exit $?"; tail -15 "$out/cuda_tests.txt"
timeout 60 $py -m pytest -p no:cacheprovider -q -m cuda tests/test_blocksparse_oracle.py \
  >>"$out/cuda_tests.txt" 2>&1
echo "cuda-marked tests exit $? after $(( $(date +%s) - start )) s"; tail -5 "$out/cuda_tests.txt"
