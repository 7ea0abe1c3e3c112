// What every qkv CPU kernel source includes first: the vector ISA it is built for, then ATen.
//
// qkv.native builds each library for the capability torch dispatches to (-mavx512f... or
// -mavx2 -mfma -mf16c, or nothing) and puts this folder on the include path. ATen's
// Vectorized<float> picks its AVX-512 / AVX2 implementation from CPU_CAPABILITY_*, which
// torch's own build defines per compilation unit; an extension must define it itself, before
// the first ATen include, or Vectorized falls back to its scalar emulation.
//
//   QKV_AVX512 / QKV_AVX2   set when the matching intrinsics may be used directly
//   Vec                     at::vec::Vectorized<float>

#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define QKV_AVX512 1
#define CPU_CAPABILITY_AVX512 1
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QKV_AVX2 1
#define CPU_CAPABILITY_AVX2 1
#define CPU_CAPABILITY AVX2
#endif

// (The pieces of ATen the kernels use, not <ATen/ATen.h>: that one header took ~3 s more of
// each source's ~10 s build, for every CPU variant built.)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#if defined(QKV_AVX512) || defined(QKV_AVX2)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

namespace qkv_cpu {
using Vec = at::vec::Vectorized<float>;

// Row maxima that keep a NaN: std::max(m, x) returns m when x is NaN, so a row whose scores
// are all NaN (a NaN query) would keep its max at -inf and look like a row that sees no key
// (output 0) instead of giving NaN, as the formula does.
inline float nan_max(float a, float b) { return (std::isnan(a) || a >= b) ? a : b; }

// The GGUF kernels' weight rows: decoding streams each weight matrix from memory once per
// token (SmolLM2-135M: ~100 MB, far beyond the caches), and one core's hardware prefetcher
// alone kept ~5 GB/s of it. Asking for the bytes this far ahead of the row being multiplied
// doubled the rate on a Xeon (benchmarks/RESULTS.md); past the matrix's end it is a no-op.
constexpr int64_t PREFETCH_AHEAD = 4096;

inline void prefetch_row(const uint8_t* row, int64_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const uint8_t* p = row + PREFETCH_AHEAD;
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
#else
  (void)row;
  (void)bytes;
#endif
}
}  // namespace qkv_cpu
