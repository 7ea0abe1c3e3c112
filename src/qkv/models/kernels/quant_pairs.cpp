// quant_int.cpp's integer products under AVX-512: two blocks of 32 per 512-bit vector.
//
// The arithmetic is quant_int.cpp's (see there): per weight block j and quantised input
// block j, the integer dot product of the 32 small integers times dw * d, plus the block's
// bias term (Q4_1: m * s; Q4_0: -8 dw * s). Only the order of the float32 sums differs.
//
// Why (benchmarks/RESULTS.md): decoding SmolLM2 with 8-bit activations, quant_int.cpp's
// 256-bit loop (one block per pass: ~12 instructions) was bound by instructions, not memory.
// Here a pass takes blocks j and j + 1 at once: their 32 bytes of nibbles unpacked into one
// 512-bit vector in the activation's order (block j's 32 weights, then block j + 1's), one
// multiply-add of 64 byte pairs into 16 int32 lanes (lanes 0-7 sum to block j's product,
// 8-15 to block j + 1's), and one FMA with the two blocks' scales spread over their lanes.
// The multiply-add is AVX-512 VNNI's vpdpbusd where the CPU has it, else AVX512BW's
// vpmaddubsw + vpmaddwd (the same exact integer sums). Setting QKV_QUANT_VNNI=0 takes the
// second on any CPU (the tests run both).
//
// Compiled to nothing outside the AVX-512 build; quant_int.cpp calls it only there.

#include "qkv_cpu.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace qkv_quant_pairs {

struct Q8Row {  // quant_int.cpp's quantised input row
  const int8_t* q;
  const float* ds;
};

void rows_times_pairs(int64_t qtype, int rows, const Q8Row* a, int64_t nb, const uint8_t* wq,
                      int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t N);

}  // namespace qkv_quant_pairs

#if defined(QKV_AVX512)

namespace {

using qkv_quant_pairs::Q8Row;

constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q8_0 = 8;
constexpr int64_t QK = 32;
constexpr int64_t PREFETCH_AHEAD = 4096;  // as quant_int.cpp

// u unsigned, s signed bytes: 16 int32 lanes, lane i the sum of the products of bytes
// 4i..4i+3. vpmaddubsw's int16 pairs cannot saturate here: |u * s| <= 128 * 127.
template <bool VNNI>
inline __m512i dot(__m512i u, __m512i s) {
  if constexpr (VNNI) {
    __m512i acc = _mm512_setzero_si512();
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));  // (no target attribute needed)
    return acc;
  } else {
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
  }
}

template <bool VNNI>
inline __m256i dot(__m256i u, __m256i s) {
  if constexpr (VNNI) {
    __m256i acc = _mm256_setzero_si256();
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
  } else {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
  }
}

// The fp16 scale pairs of two blocks as float32 [d0, e0, d1, e1]: e is Q4_1's minimum m,
// Q4_0's -8 d (its offset term's scale); for Q8_0 only d0 and d1 are used.
template <int64_t T>
inline __m128 scales(const uint8_t* b0, const uint8_t* b1) {
  int32_t h0, h1;
  std::memcpy(&h0, b0, 4);
  std::memcpy(&h1, b1, 4);
  __m128 dm = _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(h0), _mm_cvtsi32_si128(h1)));
  if constexpr (T == Q4_0) {
    dm = _mm_mul_ps(_mm_shuffle_ps(dm, dm, _MM_SHUFFLE(2, 2, 0, 0)), _mm_setr_ps(1.f, -8.f, 1.f, -8.f));
  }
  return dm;
}

template <int64_t T, int R, bool VNNI>
void pairs(const Q8Row* a, int64_t nb, const uint8_t* wq, int64_t row_bytes, int64_t n0,
           int64_t n1, float* out, int64_t N) {
  constexpr int64_t bb = T == Q4_0 ? 18 : T == Q4_1 ? 20 : 34;
  constexpr int64_t off = T == Q4_1 ? 4 : 2;  // where the 4- or 8-bit values start
  const __m512i shifts = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
  const __m512i low4 = _mm512_set1_epi8(15);
  // lanes 0-7 take lane 0 of a [d0 d, ., d1 d, .] product, lanes 8-15 its lane 2
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wq + n * row_bytes;
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + PREFETCH_AHEAD + o, _MM_HINT_T0);
    __m512 acc[R];
    __m128 bias4[R];  // lanes 1 and 3: the blocks' bias terms (lanes 0 and 2 unused)
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_setzero_ps();
      bias4[r] = _mm_setzero_ps();
    }
    int64_t j = 0;
    for (; j + 1 < nb; j += 2) {
      const uint8_t* b0 = row + j * bb;
      const uint8_t* b1 = b0 + bb;
      const __m128 dm = scales<T>(b0, b1);
      __m512i u;
      __mmask64 neg = 0;
      if constexpr (T == Q8_0) {
        const __m512i w = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + off))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + off)), 1);
        neg = _mm512_movepi8_mask(w);  // the weights' signs move to the input
        u = _mm512_abs_epi8(w);        // (as unsigned: -128 -> 128)
      } else {
        // [q0 q0 q1 q1] (16 bytes each), shifted by [0 4 0 4]: block 0's 32 nibbles in
        // weight order (byte i's low nibble is weight i, its high nibble weight i + 16),
        // then block 1's
        const __m512i q = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + off)))),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b1 + off))), 1);
        u = _mm512_and_si512(_mm512_srlv_epi64(q, shifts), low4);
      }
      for (int r = 0; r < R; ++r) {
        __m512i x = _mm512_loadu_si512(a[r].q + j * QK);
        if constexpr (T == Q8_0) x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
        const __m128 p = _mm_mul_ps(dm, _mm_loadu_ps(a[r].ds + 2 * j));  // [dw0 d0, bias0, dw1 d1, bias1]
        const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(p));
        acc[r] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot<VNNI>(u, x)), acc[r]);
        if constexpr (T != Q8_0) bias4[r] = _mm_add_ps(bias4[r], p);
      }
    }
    if (j < nb) {  // an odd number of blocks: the last one alone, in 256 bits
      const uint8_t* b = row + j * bb;
      const __m128 dm = scales<T>(b, b);
      __m256i u, w;
      if constexpr (T == Q8_0) {
        w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + off));
        u = _mm256_sign_epi8(w, w);
      } else {
        const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off)));
        u = _mm256_and_si256(_mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(15));
      }
      for (int r = 0; r < R; ++r) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[r].q + j * QK));
        if constexpr (T == Q8_0) x = _mm256_sign_epi8(x, w);
        const __m128 ds = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(a[r].ds + 2 * j)));
        const __m128 p = _mm_mul_ps(dm, ds);  // [dw d, bias, 0, 0]
        const __m256 t = _mm256_mul_ps(_mm256_broadcastss_ps(p), _mm256_cvtepi32_ps(dot<VNNI>(u, x)));
        acc[r] = _mm512_add_ps(acc[r], _mm512_zextps256_ps512(t));
        if constexpr (T != Q8_0) bias4[r] = _mm_add_ps(bias4[r], _mm_and_ps(p, _mm_castsi128_ps(_mm_setr_epi32(0, -1, 0, 0))));
      }
    }
    for (int r = 0; r < R; ++r) {
      float bias = 0.f;
      if constexpr (T != Q8_0) {
        alignas(16) float b4[4];
        _mm_store_ps(b4, bias4[r]);
        bias = b4[1] + b4[3];
      }
      out[r * N + n] = _mm512_reduce_add_ps(acc[r]) + bias;
    }
  }
}

template <int64_t T, bool VNNI>
void rows_of(int rows, const Q8Row* a, int64_t nb, const uint8_t* wq, int64_t row_bytes,
             int64_t n0, int64_t n1, float* out, int64_t N) {
  switch (rows) {
    case 1: pairs<T, 1, VNNI>(a, nb, wq, row_bytes, n0, n1, out, N); break;
    case 2: pairs<T, 2, VNNI>(a, nb, wq, row_bytes, n0, n1, out, N); break;
    case 3: pairs<T, 3, VNNI>(a, nb, wq, row_bytes, n0, n1, out, N); break;
    default: pairs<T, 4, VNNI>(a, nb, wq, row_bytes, n0, n1, out, N); break;
  }
}

template <bool VNNI>
void by_type(int64_t qtype, int rows, const Q8Row* a, int64_t nb, const uint8_t* wq,
             int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t N) {
  switch (qtype) {
    case Q4_0: rows_of<Q4_0, VNNI>(rows, a, nb, wq, row_bytes, n0, n1, out, N); break;
    case Q4_1: rows_of<Q4_1, VNNI>(rows, a, nb, wq, row_bytes, n0, n1, out, N); break;
    default: rows_of<Q8_0, VNNI>(rows, a, nb, wq, row_bytes, n0, n1, out, N); break;
  }
}

}  // namespace

namespace qkv_quant_pairs {

// out[r, n] for `rows` (1-4) quantised rows and output rows [n0, n1) of a weight in format
// `qtype` (Q4_0, Q4_1 or Q8_0) with nb >= 1 blocks a row.
void rows_times_pairs(int64_t qtype, int rows, const Q8Row* a, int64_t nb, const uint8_t* wq,
                      int64_t row_bytes, int64_t n0, int64_t n1, float* out, int64_t N) {
  static const bool has_vnni = __builtin_cpu_supports("avx512vnni");
  const char* env = std::getenv("QKV_QUANT_VNNI");
  if (has_vnni && !(env != nullptr && env[0] == '0')) {
    by_type<true>(qtype, rows, a, nb, wq, row_bytes, n0, n1, out, N);
  } else {
    by_type<false>(qtype, rows, a, nb, wq, row_bytes, n0, n1, out, N);
  }
}

}  // namespace qkv_quant_pairs

#endif  // QKV_AVX512
