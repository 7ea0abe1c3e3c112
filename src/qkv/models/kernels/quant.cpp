// qkv's CPU kernels for GGUF block-quantised weights (llama.cpp's Q4_0, Q4_1 and Q8_0): the
// product x @ W.T straight from the blocks, for inputs of a few rows (decoding), and the
// blocks dequantised to float32 (an embedding lookup, the many-row path); and, at the end, the
// decoder's RMSNorm rows (here rather than in a file of their own: each translation unit
// spends ~10 s on ATen's headers, for every CPU variant built).
//
// Built on first use by qkv/models/quantized.py (qkv.native.NativeLibrary) and registered as
// torch.ops.qkv_quant.linear, torch.ops.qkv_quant.dequantize and torch.ops.qkv_quant.rms_norm.
//
// Why it exists (benchmarks/RESULTS.md): one decode step of SmolLM2-135M streams
// all its weights; as float32 they are 538 MB a token, as the file's blocks 96 MB (Q4_1: 20
// bytes per 32 weights, Q8_0: 34).
//
// A weight row of K = 32 * nb features is nb blocks of 32 weights, laid out as in the file:
//   Q4_0: fp16 d, 16 bytes q        w[i] = d * (q[i] - 8)
//   Q4_1: fp16 d, fp16 m, 16 bytes  w[i] = d * q[i] + m
//   Q8_0: fp16 d, 32 int8 q         w[i] = d * q[i]
// where the 4-bit q[i] of weight i < 16 is the low nibble of byte i and of weight i + 16 its
// high nibble. Every weight is computed exactly as gguf.quants.dequantize computes it (a
// float32 product, then the float32 sum for Q4_1: this source is built with
// -ffp-contract=off so that the compiler does not fuse the two into one rounding), so
// dequantize() equals gguf's bit for bit and linear() is float32 F.linear on those weights up
// to the order of its float32 sums. Products with x accumulate in float32 (FMA where the CPU
// has it).

#include "qkv_cpu.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// GGML type codes (gguf.GGMLQuantizationType) and the bytes of one block of 32 weights.
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;
constexpr int64_t QK = 32;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: TORCH_CHECK(false, "qkv_quant: unsupported GGML type code ", qtype, " (Q4_0=2, Q4_1=3, Q8_0=8)");
  }
  return 0;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(QKV_AVX512) || defined(QKV_AVX2)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// ---------------------------------------------------------------------------- one block
// A block's 32 weights as W vectors of L floats (ATen's Vectorized: 16 lanes on AVX-512, 8 on
// AVX2 and in the portable build), in weight order.

using qkv_cpu::Vec;
constexpr int L = Vec::size(), W = QK / L;

#if defined(QKV_AVX512)
template <int64_t T>
inline void block(const uint8_t* b, Vec* w) {
  if constexpr (T == Q8_0) {
    const __m512 d = _mm512_set1_ps(half_at(b));
    for (int h = 0; h < 2; ++h) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * h));
      w[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
  } else {
    // The block's 16 possible weights, d * v + m (Q4_1) or d * (v - 8) (Q4_0) for v = 0..15,
    // each rounded as gguf rounds it, then looked up by nibble (vpermps reads the low 4 bits
    // of each index): fewer instructions than converting and scaling all 32.
    const int off = T == Q4_1 ? 4 : 2;
    const __m512 v = T == Q4_1 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                               : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    // d and m (Q4_1) in every lane from one 4-byte broadcast: [d, m, d, m, ...] shuffled
    int32_t pair;
    std::memcpy(&pair, b, 4);
    const __m512 dm = _mm512_cvtph_ps(_mm256_set1_epi32(pair));
    __m512 table = _mm512_mul_ps(_mm512_permute_ps(dm, 0x00), v);
    if constexpr (T == Q4_1) table = _mm512_add_ps(table, _mm512_permute_ps(dm, 0x55));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off)));
    w[0] = _mm512_permutexvar_ps(q, table);                        // low nibbles: weights 0-15
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);  // high: weights 16-31
  }
}

#elif defined(QKV_AVX2)
template <int64_t T>
inline void block(const uint8_t* b, Vec* w) {
  const __m256 d = _mm256_set1_ps(half_at(b));
  if constexpr (T == Q8_0) {
    for (int h = 0; h < 4; ++h) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * h));
      w[h] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  } else {
    const int off = T == Q4_1 ? 4 : 2;
    const __m256 m = T == Q4_1 ? _mm256_set1_ps(half_at(b + 2)) : _mm256_setzero_ps();
    for (int h = 0; h < 2; ++h) {  // bytes 8h..8h+7: weights 8h.. (low nibbles), 16+8h.. (high)
      const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + off + 8 * h)));
      __m256i lo = _mm256_and_si256(q, _mm256_set1_epi32(15));
      __m256i hi = _mm256_srli_epi32(q, 4);
      if constexpr (T == Q4_0) {
        lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(8));
        hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(8));
      }
      __m256 w0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo));
      __m256 w1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi));
      if constexpr (T == Q4_1) {
        w0 = _mm256_add_ps(w0, m);
        w1 = _mm256_add_ps(w1, m);
      }
      w[h] = w0;
      w[2 + h] = w1;
    }
  }
}

#else  // portable: plain C++ into a buffer, loaded as W vectors
template <int64_t T>
inline void block(const uint8_t* b, Vec* w) {
  const float d = half_at(b);
  float out[QK];
  if constexpr (T == Q8_0) {
    for (int i = 0; i < QK; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
  } else {
    const uint8_t* q = b + (T == Q4_1 ? 4 : 2);
    const float m = T == Q4_1 ? half_at(b + 2) : 0.f;
    const int shift = T == Q4_0 ? 8 : 0;
    for (int i = 0; i < QK / 2; ++i) {
      out[i] = d * static_cast<float>((q[i] & 15) - shift);
      out[i + QK / 2] = d * static_cast<float>((q[i] >> 4) - shift);
      if constexpr (T == Q4_1) {
        out[i] += m;
        out[i + QK / 2] += m;
      }
    }
  }
  for (int h = 0; h < W; ++h) w[h] = Vec::loadu(out + h * L);
}
#endif

static_assert(L * W == QK, "a block is W vectors of L floats");

// ------------------------------------------------------------------------ the kernels

// One block's products into acc[r][c] for R rows of x (x row stride K, at the block).
template <int64_t T, int R, int C>
inline void add_block(const uint8_t* b, const float* x, int64_t K, Vec (*acc)[C]) {
  Vec w[W];
  block<T>(b, w);
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < W; ++h) acc[r][h % C] = at::vec::fmadd(w[h], Vec::loadu(x + r * K + h * L), acc[r][h % C]);
  }
}

// out[r, n] = sum_k x[r, k] * w[n, k] for R rows of x (x row stride K) and output rows
// [n0, n1): each block is decoded once and used by all R rows. Accumulators alternating
// between blocks keep FMA chains in flight.
template <int64_t T, int R>
void rows_times_blocks(const float* x, int64_t K, const uint8_t* wq, int64_t row_bytes,
                       int64_t n0, int64_t n1, float* out, int64_t N) {
  // One row (decoding) keeps a chain per vector of the block too (2 x W chains: a block's W
  // FMAs into one accumulator waited on each other, ~4 cycles each); more rows share theirs,
  // so that the accumulators stay in registers.
  constexpr int C = R == 1 ? W : 1;
  const int64_t nb = K / QK, bb = block_bytes(T);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wq + n * row_bytes;
    qkv_cpu::prefetch_row(row, row_bytes);
    Vec even[R][C], odd[R][C];  // (two arrays, not one indexed by j & 1: kept in registers)
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) even[r][c] = odd[r][c] = Vec(0.f);
    }
    int64_t j = 0;
    for (; j + 1 < nb; j += 2) {
      add_block<T, R, C>(row + j * bb, x + j * QK, K, even);
      add_block<T, R, C>(row + (j + 1) * bb, x + (j + 1) * QK, K, odd);
    }
    if (j < nb) add_block<T, R, C>(row + j * bb, x + j * QK, K, even);
    for (int r = 0; r < R; ++r) {
      Vec total = even[r][0] + odd[r][0];
      for (int c = 1; c < C; ++c) total = total + (even[r][c] + odd[r][c]);
      out[r * N + n] = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, total);
    }
  }
}

constexpr int ROWS = 4;  // rows of x per pass over a weight row (4 x 2 accumulators)

template <int64_t T>
void linear_rows(const float* x, int64_t M, int64_t K, const uint8_t* wq, int64_t row_bytes,
                 int64_t n0, int64_t n1, float* out, int64_t N) {
  for (int64_t r = 0; r < M; r += ROWS) {
    const float* xr = x + r * K;
    float* o = out + r * N;
    switch (std::min<int64_t>(ROWS, M - r)) {
      case 1: rows_times_blocks<T, 1>(xr, K, wq, row_bytes, n0, n1, o, N); break;
      case 2: rows_times_blocks<T, 2>(xr, K, wq, row_bytes, n0, n1, o, N); break;
      case 3: rows_times_blocks<T, 3>(xr, K, wq, row_bytes, n0, n1, o, N); break;
      default: rows_times_blocks<T, 4>(xr, K, wq, row_bytes, n0, n1, o, N); break;
    }
  }
}

void check_blocks(const at::Tensor& blocks, int64_t qtype, int64_t K) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
              "qkv_quant: blocks must be a CPU uint8 tensor [out_features, bytes per row]");
  TORCH_CHECK(K > 0 && K % QK == 0, "qkv_quant: in_features must be a positive multiple of 32, got ", K);
  TORCH_CHECK(blocks.size(1) == K / QK * block_bytes(qtype), "qkv_quant: rows of ", blocks.size(1),
              " bytes do not hold ", K, " weights of type code ", qtype);
  TORCH_CHECK(blocks.is_contiguous(), "qkv_quant: blocks must be contiguous");
}

// Output rows per task: at least 16, and about 4 tasks per thread (rows differ little in cost).
int64_t grain(int64_t N) {
  return std::max<int64_t>(16, N / (4 * at::get_num_threads()));
}

// x [M, K] float32 @ W.T, W [N, K] given as blocks [N, K / 32 * bytes]: out [M, N].
at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t K) {
  check_blocks(blocks, qtype, K);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K,
              "qkv_quant.linear: x must be float32 CPU [rows, ", K, "], got ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), N = blocks.size(0), row_bytes = blocks.size(1);
  at::Tensor out = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wq = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    switch (qtype) {
      case Q4_0: linear_rows<Q4_0>(xp, M, K, wq, row_bytes, n0, n1, op, N); break;
      case Q4_1: linear_rows<Q4_1>(xp, M, K, wq, row_bytes, n0, n1, op, N); break;
      default: linear_rows<Q8_0>(xp, M, K, wq, row_bytes, n0, n1, op, N); break;
    }
  });
  return out;
}

template <int64_t T>
void dequantize_rows(const uint8_t* wq, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, float* out) {
  const int64_t nb = K / QK, bb = block_bytes(T);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t j = 0; j < nb; ++j) {
      Vec w[W];
      block<T>(wq + n * row_bytes + j * bb, w);
      for (int h = 0; h < W; ++h) w[h].store(out + n * K + j * QK + h * L);
    }
  }
}

// blocks [N, K / 32 * bytes] -> W [N, K] float32, equal to gguf.quants.dequantize.
at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t K) {
  check_blocks(blocks, qtype, K);
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1);
  at::Tensor out = at::empty({N, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* wq = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    switch (qtype) {
      case Q4_0: dequantize_rows<Q4_0>(wq, row_bytes, K, n0, n1, op); break;
      case Q4_1: dequantize_rows<Q4_1>(wq, row_bytes, K, n0, n1, op); break;
      default: dequantize_rows<Q8_0>(wq, row_bytes, K, n0, n1, op); break;
    }
  });
  return out;
}

// ------------------------------------------------------------------------ RMSNorm
// RMSNorm for the decoder's rows: y = x * (1 / sqrt(mean(x^2) + eps)) * weight, in float32.
//
// Decoding SmolLM2-135M calls it 61 times a token on one 576-wide row; torch's F.rms_norm is
// ~8 operators there (~10 us a call on one thread), ~0.6 ms of a ~16 ms token. One pass here.
// The products are rounded as torch's are (x * rstd, then * weight); the sum of squares is
// taken in another order (vectors of lanes), so results agree with F.rms_norm to float32
// rounding, not bit for bit.
void norm_row(const float* x, const float* w, float* y, int64_t d, float eps) {
  constexpr int64_t L = Vec::size();
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + L <= d; i += L) {
    const Vec v = Vec::loadu(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float ss = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < d; ++i) ss += x[i] * x[i];
  const float rstd = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  const Vec r(rstd);
  i = 0;
  for (; i + L <= d; i += L) ((Vec::loadu(x + i) * r) * Vec::loadu(w + i)).store(y + i);
  for (; i < d; ++i) y[i] = (x[i] * rstd) * w[i];
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1,
              "qkv_quant.rms_norm: x must be a float32 CPU tensor, got ", x.scalar_type());
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.size(0) == d,
              "qkv_quant.rms_norm: weight must be float32 [", d, "], got ", weight.sizes());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t rows = d == 0 ? 0 : xc.numel() / d;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * d, wp, yp + r * d, d, e);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(qkv_quant, m) {
  m.def("linear(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor");
  m.def("dequantize(Tensor blocks, int qtype, int in_features) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(qkv_quant, CPU, m) {
  m.impl("linear", &linear);
  m.impl("dequantize", &dequantize);
  m.impl("rms_norm", &rms_norm);
}
