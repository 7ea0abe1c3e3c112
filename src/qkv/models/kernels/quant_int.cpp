// qkv's integer products for GGUF blocks (Q4_0, Q4_1, Q8_0): x @ W.T for inputs of a few
// rows with the activations quantised to 8 bits, the arithmetic llama.cpp decodes with.
// Registered as torch.ops.qkv_quant.linear_q8 (beside quant.cpp's exact float32 linear).
//
// Each row of x is cut into blocks of 32 values, as the weights are, and each block stored as
// a scale and 32 int8 (a "Q8" block):
//   d = max|x| / 127,  q[i] = clamp(round_half_even(x[i] / d), -127, 127)  (q = 0 when d = 0),
//   s = d * sum(q)
// so x[i] ~ d * q[i] (error at most d / 2). A weight block times an activation block is then
// one integer dot product of 32 small integers and two float products:
//   Q4_1  sum_i (dw qw[i] + m) * d q[i] = dw d * sum_i qw[i] q[i] + m * s
//   Q4_0  sum_i dw (qw[i] - 8) * d q[i] = dw d * sum_i qw[i] q[i] - 8 dw * s
//   Q8_0  sum_i dw qw[i] * d q[i]       = dw d * sum_i qw[i] q[i]
// The integer sums are exact (|sum| <= 32 * 128 * 127); the result equals float32 F.linear of
// the dequantised weights and the dequantised activations up to float32 rounding
// (tests/test_quant_int.py checks it against that torch formula).
//
// Why (benchmarks/RESULTS.md): decoding SmolLM2-135M spent 73% of its time in quant.cpp's
// float path, which widens every 4-bit weight to float32 before its FMA; here 32 weights take
// one byte-wise multiply-add (_mm256_maddubs_epi16) and one pairwise add (_mm256_madd_epi16).
//
// A row holding a NaN or an infinity cannot be quantised (its scale would be NaN or inf); such
// a row is multiplied in float32 instead, so NaN and inf reach the output as F.linear gives them.
//
// This file repeats the block layout of quant.cpp (type codes, sizes, the fp16 read) rather
// than sharing a header: the native builder's stamp covers the sources it compiles, not
// headers beside them.

#include "qkv_cpu.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

// quant_pairs.cpp: the products under AVX-512, two blocks per vector (declared again here:
// see above on headers)
namespace qkv_quant_pairs {

struct Q8Row {
  const int8_t* q;
  const float* ds;
};

void rows_times_pairs(int64_t qtype, int rows, const Q8Row* a, int64_t nb, const uint8_t* wq,
                      int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t N);

}  // namespace qkv_quant_pairs

namespace {

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

// ------------------------------------------------------------- activations to Q8 blocks

// One row's blocks: q [nb * 32] int8 and ds [nb * 2], block j's scale d at 2j and
// s = d * sum(q of the block) at 2j + 1 (side by side: the kernel loads both at once).
using qkv_quant_pairs::Q8Row;

// Quantise x [K] into q and ds; false (the row left unfinished) where a value is not finite.
bool quantize_row(const float* x, int64_t K, int8_t* q, float* ds) {
  for (int64_t j = 0; j < K / QK; ++j) {
    const float* xb = x + j * QK;
    int8_t* qb = q + j * QK;
#if defined(QKV_AVX512) || defined(QKV_AVX2)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], a = _mm256_setzero_ps();
    int finite = 0xff;
    for (int h = 0; h < 4; ++h) {
      v[h] = _mm256_loadu_ps(xb + 8 * h);
      const __m256 m = _mm256_andnot_ps(sign, v[h]);  // |x|
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(m, _mm256_set1_ps(FLT_MAX), _CMP_LE_OQ));
      a = _mm256_max_ps(a, m);
    }
    if (finite != 0xff) return false;
    __m128 a4 = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    a4 = _mm_max_ps(a4, _mm_movehl_ps(a4, a4));
    a4 = _mm_max_ss(a4, _mm_shuffle_ps(a4, a4, 1));
    const float dj = _mm_cvtss_f32(a4) / 127.f;
    __m256i sum = _mm256_setzero_si256();
    if (dj > 0.f) {
      const __m256 dv = _mm256_set1_ps(dj);
      __m256i iv[4];
      for (int h = 0; h < 4; ++h) {
        __m256 r = _mm256_round_ps(_mm256_div_ps(v[h], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
        iv[h] = _mm256_cvtps_epi32(r);
        sum = _mm256_add_epi32(sum, iv[h]);
      }
      // int32 -> int8 (no saturation: |q| <= 127); packs interleave the 128-bit lanes, the
      // permute puts the 32 values back in order
      const __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]), p16b = _mm256_packs_epi32(iv[2], iv[3]);
      const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm256_permutevar8x32_epi32(p8, order));
    } else {
      std::memset(qb, 0, QK);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    const int total = _mm_cvtsi128_si32(s4);
#else
    float amax = 0.f;
    for (int i = 0; i < QK; ++i) {
      const float m = std::fabs(xb[i]);
      if (!(m <= FLT_MAX)) return false;  // NaN or inf
      amax = std::max(amax, m);
    }
    const float dj = amax / 127.f;
    int total = 0;
    for (int i = 0; i < QK; ++i) {
      // nearbyint rounds half to even in the default rounding mode, as _mm256_round_ps does
      const float r = dj > 0.f ? std::min(127.f, std::max(-127.f, std::nearbyint(xb[i] / dj))) : 0.f;
      qb[i] = static_cast<int8_t>(r);
      total += qb[i];
    }
#endif
    ds[2 * j] = dj;
    ds[2 * j + 1] = dj * static_cast<float>(total);
  }
  return true;
}

// ----------------------------------------------------------- one weight block, 32 integers

#if defined(QKV_AVX512) || defined(QKV_AVX2)
// The 32 weights of a 4-bit block as unsigned bytes in weight order: byte i's low nibble is
// weight i, its high nibble weight i + 16.
inline __m256i nibbles(const uint8_t* q) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
}

// 8 int32 lanes summing to sum_i u[i] * s[i], u unsigned and s signed bytes. The int16
// pairs cannot saturate: |u * s| <= 128 * 127, two of them < 32768.
inline __m256i dot_u8_i8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}
#endif

// out[r, n] for R quantised rows and output rows [n0, n1); each weight block is unpacked once
// and used by all R rows.
template <int64_t T, int R>
void rows_times_blocks(const Q8Row* a, int64_t nb, const uint8_t* wq, int64_t row_bytes,
                       int64_t n0, int64_t n1, float* out, int64_t N) {
  const int64_t bb = block_bytes(T);
  const int64_t off = T == Q4_1 ? 4 : 2;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wq + n * row_bytes;
    qkv_cpu::prefetch_row(row, row_bytes);
#if defined(QKV_AVX512) || defined(QKV_AVX2)
    // Two accumulators per row (even and odd blocks), so that consecutive FMAs do not wait
    // on each other. The block's fp16 scales are read as one pair and multiplied by the
    // activation's (d, s) pair: lane 0 is the integer sum's scale dw * d, lane 1 the bias
    // term (m * s for Q4_1, -8 dw * s for Q4_0), summed across blocks in `bias`.
    __m256 acc[R][2];
    __m128 bias4[R];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      bias4[r] = _mm_setzero_ps();
    }
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* b = row + j * bb;
      int32_t pair;
      std::memcpy(&pair, b, 4);  // Q4_1: d, m; the others: d, then bytes not used
      __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(pair));  // [dw, m, ., .]
      if constexpr (T == Q4_0) dm = _mm_mul_ps(_mm_shuffle_ps(dm, dm, 0), _mm_setr_ps(1.f, -8.f, 0.f, 0.f));
      __m256i u, w;
      if constexpr (T == Q8_0) {
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + off));
        u = _mm256_sign_epi8(w, w);  // |w| (as unsigned: -128 -> 128); its sign moves to x
      } else {
        u = nibbles(b + off);
      }
      const int e = static_cast<int>(j & 1);
      for (int r = 0; r < R; ++r) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r].q + j * QK));
        if constexpr (T == Q8_0) x = _mm256_sign_epi8(x, w);
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8_i8(u, x));
        const __m128 ds = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(a[r].ds + 2 * j)));
        const __m128 p = _mm_mul_ps(dm, ds);  // [dw * d, bias term, ., .]
        acc[r][e] = _mm256_fmadd_ps(_mm256_broadcastss_ps(p), dot, acc[r][e]);
        if constexpr (T != Q8_0) bias4[r] = _mm_add_ps(bias4[r], p);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float bias = T == Q8_0 ? 0.f : _mm_cvtss_f32(_mm_shuffle_ps(bias4[r], bias4[r], 1));
      out[r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + bias;
    }
#else
    float acc[R], bias[R];
    for (int r = 0; r < R; ++r) acc[r] = bias[r] = 0.f;
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* b = row + j * bb;
      const float dw = half_at(b);
      int32_t wv[QK];
      for (int i = 0; i < QK; ++i) {
        if constexpr (T == Q8_0) {
          wv[i] = static_cast<int8_t>(b[off + i]);
        } else {
          wv[i] = i < QK / 2 ? (b[off + i] & 15) : (b[off + i - QK / 2] >> 4);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a[r].q + j * QK;
        int32_t dot = 0;
        for (int i = 0; i < QK; ++i) dot += wv[i] * x[i];
        acc[r] += dw * a[r].ds[2 * j] * static_cast<float>(dot);
        if constexpr (T == Q4_1) bias[r] += half_at(b + 2) * a[r].ds[2 * j + 1];
        if constexpr (T == Q4_0) bias[r] += -8.f * dw * a[r].ds[2 * j + 1];
      }
    }
    for (int r = 0; r < R; ++r) out[r * N + n] = acc[r] + bias[r];
#endif
  }
}

// A row that could not be quantised: float32 products of its values and the exact weights.
template <int64_t T>
void float_row(const float* x, int64_t nb, const uint8_t* wq, int64_t row_bytes, int64_t n0,
               int64_t n1, float* out) {
  const int64_t bb = block_bytes(T);
  for (int64_t n = n0; n < n1; ++n) {
    float acc = 0.f;
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* b = wq + n * row_bytes + j * bb;
      const float dw = half_at(b);
      for (int i = 0; i < QK; ++i) {
        float w;
        if constexpr (T == Q8_0) {
          w = dw * static_cast<float>(static_cast<int8_t>(b[2 + i]));
        } else {
          const uint8_t* q = b + (T == Q4_1 ? 4 : 2);
          const int v = i < QK / 2 ? (q[i] & 15) : (q[i - QK / 2] >> 4);
          w = T == Q4_1 ? dw * static_cast<float>(v) + half_at(b + 2) : dw * static_cast<float>(v - 8);
        }
        acc += w * x[j * QK + i];
      }
    }
    out[n] = acc;
  }
}

constexpr int ROWS = 4;  // quantised rows per pass over a weight row

template <int64_t T>
void linear_rows(const Q8Row* a, const float* x, const bool* ok, int64_t M, int64_t K,
                 const uint8_t* wq, int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t N) {
  const int64_t nb = K / QK;
  std::vector<Q8Row> good;  // the quantised rows, in order, and where their outputs go
  std::vector<int64_t> where;
  for (int64_t r = 0; r < M; ++r) {
    if (ok[r]) {
      good.push_back(a[r]);
      where.push_back(r);
    } else {
      float_row<T>(x + r * K, nb, wq, row_bytes, n0, n1, out + r * N);
    }
  }
  const int64_t G = static_cast<int64_t>(good.size());
  const bool dense = G == M;  // no row fell back: outputs go straight to out
  std::vector<float> scratch(dense ? 0 : ROWS * N);
  for (int64_t r = 0; r < G; r += ROWS) {
    const int64_t m = std::min<int64_t>(ROWS, G - r);
    float* o = dense ? out + r * N : scratch.data();
#if defined(QKV_AVX512)
    qkv_quant_pairs::rows_times_pairs(T, static_cast<int>(m), good.data() + r, nb, wq, row_bytes, n0, n1, o, N);
#else
    switch (m) {
      case 1: rows_times_blocks<T, 1>(good.data() + r, nb, wq, row_bytes, n0, n1, o, N); break;
      case 2: rows_times_blocks<T, 2>(good.data() + r, nb, wq, row_bytes, n0, n1, o, N); break;
      case 3: rows_times_blocks<T, 3>(good.data() + r, nb, wq, row_bytes, n0, n1, o, N); break;
      default: rows_times_blocks<T, 4>(good.data() + r, nb, wq, row_bytes, n0, n1, o, N); break;
    }
#endif
    if (!dense) {
      for (int64_t i = 0; i < m; ++i) {
        std::copy(o + i * N + n0, o + i * N + n1, out + where[r + i] * N + n0);
      }
    }
  }
}

// x [M, K] float32 @ W.T with x quantised to Q8 blocks, W [N, K] as blocks [N, K / 32 * bytes].
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t K) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2,
              "qkv_quant: blocks must be a CPU uint8 tensor [out_features, bytes per row]");
  TORCH_CHECK(K > 0 && K % QK == 0, "qkv_quant: in_features must be a positive multiple of 32, got ", K);
  TORCH_CHECK(blocks.size(1) == K / QK * block_bytes(qtype), "qkv_quant: rows of ", blocks.size(1),
              " bytes do not hold ", K, " weights of type code ", qtype);
  TORCH_CHECK(blocks.is_contiguous(), "qkv_quant: blocks must be contiguous");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == K,
              "qkv_quant.linear_q8: x must be float32 CPU [rows, ", K, "], got ", x.sizes());
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), N = blocks.size(0), row_bytes = blocks.size(1), nb = K / QK;
  at::Tensor out = at::empty({M, N}, xc.options());
  if (M == 0) return out;
  const float* xp = xc.data_ptr<float>();
  // the activations, quantised once per call (M * K values, small beside the N * K weights)
  std::vector<int8_t> q(M * K);
  std::vector<float> ds(M * nb * 2);
  std::vector<Q8Row> rows(M);
  std::unique_ptr<bool[]> ok(new bool[M]);
  for (int64_t r = 0; r < M; ++r) {
    ok[r] = quantize_row(xp + r * K, K, q.data() + r * K, ds.data() + r * nb * 2);
    rows[r] = {q.data() + r * K, ds.data() + r * nb * 2};
  }
  const uint8_t* wq = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (qtype) {
      case Q4_0: linear_rows<Q4_0>(rows.data(), xp, ok.get(), M, K, wq, row_bytes, n0, n1, op, N); break;
      case Q4_1: linear_rows<Q4_1>(rows.data(), xp, ok.get(), M, K, wq, row_bytes, n0, n1, op, N); break;
      default: linear_rows<Q8_0>(rows.data(), xp, ok.get(), M, K, wq, row_bytes, n0, n1, op, N); break;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(qkv_quant, m) {
  m.def("linear_q8(Tensor x, Tensor blocks, int qtype, int in_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(qkv_quant, CPU, m) {
  m.impl("linear_q8", &linear_q8);
}
