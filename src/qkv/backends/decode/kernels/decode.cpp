// qkv's CPU decode kernel: a few query rows against a long run of keys (a decode step
// against a KV cache), with the keys split across threads (split-key, "flash-decoding").
//
// Built on first use by qkv/backends/decode/__init__.py (qkv.native.NativeLibrary) and registered
// as torch.ops.qkv_decode.decode_forward. float32; q contiguous [B, Hq, Lq, D]; k [B, Hkv, Lk, D]
// and v [B, Hkv, Lk, Dv] with any batch/head/row strides and contiguous rows (a view of a
// preallocated cache works as it is). Grouped-query heads: the G = Hq / Hkv query heads of a
// kv head and their Lq rows are R = G * Lq rows of one problem, so each key and value row is
// read once for all of them.
//
// Why it exists (benchmarks/RESULTS.md): torch's fused CPU kernel parallelises over
// (batch, head, query block). A decode step has one query block per head, so with 3 kv heads on
// 2 threads one thread does twice the other's work, and every call pays for blocking and
// packing meant for long query runs. Here the work items are (batch, kv head, key split): the
// splits keep every thread busy whatever the head count, each item runs an online softmax over
// its keys, and the items' (max, sum, output) are merged at the end.
//
// Row (b, g, i) sees the keys j with lo <= j - i <= hi and start[b] <= j < end[b]: no mask,
// causal, sliding windows (bands) and right/left padding (per-batch key ranges), and their
// intersections. Rows that see no key get output 0 and lse -inf.

#include "qkv_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using qkv_cpu::Vec;
constexpr int64_t MAX_ROWS = 16;  // rows per kv head (G * Lq); the Python side checks it too
constexpr int64_t TILE = 64;      // keys scored at a time (the score tile stays in L1)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float hsum(Vec x) {
#if defined(QKV_AVX512)
  return _mm512_reduce_add_ps(x);
#elif defined(QKV_AVX2)
  const __m256 v = x;
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
#else
  float b[Vec::size()];
  x.store(b);
  float s = 0.f;
  for (int64_t i = 0; i < Vec::size(); ++i) s += b[i];
  return s;
#endif
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  }
  float s = hsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// a[0, Dv) += sum_j p[j] * v[j * vs + (0, Dv)] for j < n: four vectors of a held in registers
// while the tile's value rows stream past.
void accumulate(float* a, const float* p, const float* v, int64_t vs, int64_t n, int64_t Dv) {
  constexpr int64_t V = Vec::size(), W = 4 * V;
  int64_t d = 0;
  for (; d + W <= Dv; d += W) {
    Vec a0 = Vec::loadu(a + d), a1 = Vec::loadu(a + d + V), a2 = Vec::loadu(a + d + 2 * V),
        a3 = Vec::loadu(a + d + 3 * V);
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = v + j * vs + d;
      const Vec pj(p[j]);
      a0 = at::vec::fmadd(pj, Vec::loadu(vj), a0);
      a1 = at::vec::fmadd(pj, Vec::loadu(vj + V), a1);
      a2 = at::vec::fmadd(pj, Vec::loadu(vj + 2 * V), a2);
      a3 = at::vec::fmadd(pj, Vec::loadu(vj + 3 * V), a3);
    }
    a0.store(a + d);
    a1.store(a + d + V);
    a2.store(a + d + 2 * V);
    a3.store(a + d + 3 * V);
  }
  for (; d + V <= Dv; d += V) {
    Vec a0 = Vec::loadu(a + d);
    for (int64_t j = 0; j < n; ++j) a0 = at::vec::fmadd(Vec(p[j]), Vec::loadu(v + j * vs + d), a0);
    a0.store(a + d);
  }
  for (; d < Dv; ++d) {
    float t = a[d];
    for (int64_t j = 0; j < n; ++j) t += p[j] * v[j * vs + d];
    a[d] = t;
  }
}

// One work item: R query rows against keys [j0, j1), row r seeing only [ra[r], re[r]).
// Leaves the running max m[r] (of scaled scores), sum l[r] and unnormalised acc[r, Dv].
// Tile by tile, every row in turn: a tile's key and value rows come from memory once and
// from L1 for the other rows.
void partial(const float* q, int64_t R, int64_t D, const float* k, int64_t ks, const float* v,
             int64_t vs, int64_t Dv, int64_t j0, int64_t j1, const int64_t* ra, const int64_t* re,
             float scale, float* m, float* l, float* acc) {
  alignas(64) float s[TILE];
  std::fill(m, m + R, NEG_INF);
  std::fill(l, l + R, 0.f);
  std::fill(acc, acc + R * Dv, 0.f);
  for (int64_t t0 = j0; t0 < j1; t0 += TILE) {
    const int64_t t1 = std::min(j1, t0 + TILE);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t a = std::max(t0, ra[r]), n = std::min(t1, re[r]) - a;
      if (n <= 0 || std::isnan(m[r])) continue;  // (a NaN row stays NaN: nothing to add)
      const float* qr = q + r * D;
      float hi = NEG_INF;
      bool nan = false;
      for (int64_t j = 0; j < n; ++j) {
        s[j] = dot(qr, k + (a + j) * ks, D) * scale;
        hi = std::max(hi, s[j]);
        nan |= std::isnan(s[j]);
      }
      if (nan || hi == -NEG_INF) {
        // A NaN score (a NaN query or key), or a +inf one (inf - inf in the softmax), makes
        // the row NaN, as in the formula. Said explicitly: exp_u20 clamps its input with
        // min/max, which turn NaN into a finite number on some ISAs (AVX-512).
        m[r] = l[r] = std::numeric_limits<float>::quiet_NaN();
        std::fill(acc + r * Dv, acc + (r + 1) * Dv, m[r]);
        continue;
      }
      const float mnew = std::max(m[r], hi);
      if (mnew == NEG_INF) continue;  // -inf scores (infinite inputs): no weight anywhere
      const Vec vm(mnew);
      Vec vsum(0.f);
      int64_t j = 0;
      for (; j + Vec::size() <= n; j += Vec::size()) {
        const Vec t = (Vec::loadu(s + j) - vm).exp_u20();
        vsum += t;
        t.store(s + j);
      }
      float sum = hsum(vsum);
      for (; j < n; ++j) {
        s[j] = std::exp(s[j] - mnew);
        sum += s[j];
      }
      float* ar = acc + r * Dv;
      if (m[r] != mnew && m[r] != NEG_INF) {  // rescale what earlier tiles accumulated
        const float alpha = std::exp(m[r] - mnew);
        l[r] *= alpha;
        for (int64_t d = 0; d < Dv; ++d) ar[d] *= alpha;
      }
      l[r] += sum;
      m[r] = mnew;
      accumulate(ar, s, v + a * vs, vs, n, Dv);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> decode_forward(const at::Tensor& q_, const at::Tensor& k_,
                                                  const at::Tensor& v_, const at::Tensor& start,
                                                  const at::Tensor& end, int64_t lo, int64_t hi,
                                                  double scale_, int64_t splits) {
  TORCH_CHECK(q_.dim() == 4 && k_.dim() == 4 && v_.dim() == 4, "decode_forward: 4-D q, k, v");
  TORCH_CHECK(q_.scalar_type() == at::kFloat && k_.scalar_type() == at::kFloat &&
                  v_.scalar_type() == at::kFloat,
              "decode_forward: float32 tensors");
  // q as one block of rows; k and v as they are (a cache view) unless their rows are strided
  const at::Tensor q = q_.contiguous();
  const at::Tensor k = k_.stride(3) == 1 ? k_ : k_.contiguous();
  const at::Tensor v = v_.stride(3) == 1 ? v_ : v_.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Dv = v.size(3);
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "decode_forward: Hq must be a multiple of Hkv");
  const int64_t G = Hq / Hkv, R = G * Lq;
  TORCH_CHECK(R <= MAX_ROWS, "decode_forward: at most ", MAX_ROWS, " rows per kv head, got ", R);
  const bool ranged = start.numel() > 0;
  TORCH_CHECK(!ranged || (start.numel() == B && end.numel() == B &&
                          start.scalar_type() == at::kLong && end.scalar_type() == at::kLong),
              "decode_forward: start and end are int64 [B] tensors (or both empty)");
  const float scale = static_cast<float>(scale_);

  auto out = at::empty({B, Hq, Lq, Dv}, q.options());
  auto lse = at::empty({B, Hq, Lq}, q.options());
  if (B * Hq * Lq == 0) return {out, lse};

  // Each row's visible keys [ra, re): the band around its query index, the batch's range.
  std::vector<int64_t> ra(B * R), re(B * R);
  const at::Tensor starts = start.contiguous(), ends = end.contiguous();  // alive below
  const int64_t* sp = ranged ? starts.data_ptr<int64_t>() : nullptr;
  const int64_t* ep = ranged ? ends.data_ptr<int64_t>() : nullptr;
  int64_t u0 = Lk, u1 = 0;  // the union of all rows' ranges: what the splits divide
  for (int64_t b = 0; b < B; ++b) {
    const int64_t b0 = ranged ? std::max<int64_t>(0, sp[b]) : 0;
    const int64_t b1 = ranged ? std::min<int64_t>(Lk, ep[b]) : Lk;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = r % Lq;
      // lo/hi arrive clamped to [-Lk - Lq, Lk + Lq] by the caller: no overflow here
      ra[b * R + r] = std::max(b0, i + lo);
      re[b * R + r] = std::min(b1, i + hi + 1);
      if (ra[b * R + r] < re[b * R + r]) {
        u0 = std::min(u0, ra[b * R + r]);
        u1 = std::max(u1, re[b * R + r]);
      }
    }
  }
  const int64_t span = std::max<int64_t>(0, u1 - u0);

  // Splits: enough items to keep every thread busy (4 per thread), each of >= 64 keys; one
  // item per (batch, kv head) when the whole call is too small to be worth a parallel region
  // (measured: below ~2k key-rows the threads' start costs more than they save).
  const int64_t threads = at::get_num_threads();
  const bool small = B * Hkv * span * R < 2048;
  int64_t S = splits;
  if (S <= 0) {
    S = 1;
    if (threads > 1 && !small) {
      S = (4 * threads + B * Hkv - 1) / (B * Hkv);
      S = std::min(S, std::max<int64_t>(1, span / 64));
    }
  }
  S = std::max<int64_t>(1, std::min(S, std::max<int64_t>(1, span)));
  const int64_t chunk = std::max<int64_t>(1, (span + S - 1) / S);
  const int64_t items = B * Hkv * S;

  std::vector<float> M(items * R), L(items * R), A(items * R * Dv);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t kb = k.stride(0), kh = k.stride(1), ks = k.stride(2);
  const int64_t vb = v.stride(0), vh = v.stride(1), vs = v.stride(2);
  auto work = [&](int64_t begin, int64_t stop) {
    for (int64_t it = begin; it < stop; ++it) {
      const int64_t sp_ = it % S, bh = it / S, b = bh / Hkv, h = bh % Hkv;
      const int64_t j0 = u0 + sp_ * chunk, j1 = std::min(u1, j0 + chunk);
      partial(qp + (b * Hq + h * G) * Lq * D, R, D, kp + b * kb + h * kh, ks,
              vp + b * vb + h * vh, vs, Dv, j0, std::max(j0, j1), &ra[b * R], &re[b * R], scale,
              &M[it * R], &L[it * R], &A[it * R * Dv]);
    }
  };
  if (S == 1 && splits <= 0 && small) {
    work(0, items);  // too small for a parallel region: it would cost more than it saves
  } else {
    at::parallel_for(0, items, 1, work);
  }

  // Merge the splits of each row: out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s.
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  for (int64_t bh = 0; bh < B * Hkv; ++bh) {
    const int64_t row0 = (bh / Hkv) * Hq * Lq + (bh % Hkv) * G * Lq;  // [B, Hq, Lq] index
    for (int64_t r = 0; r < R; ++r) {
      float mx = NEG_INF;
      for (int64_t s = 0; s < S; ++s) mx = qkv_cpu::nan_max(mx, M[(bh * S + s) * R + r]);
      float* o = op + (row0 + r) * Dv;
      std::fill(o, o + Dv, 0.f);
      if (mx == NEG_INF) {  // the row sees no key
        lp[row0 + r] = NEG_INF;
        continue;
      }
      float total = 0.f;
      for (int64_t s = 0; s < S; ++s) {
        const int64_t it = bh * S + s;
        if (M[it * R + r] == NEG_INF) continue;
        const float w = std::exp(M[it * R + r] - mx);
        total += w * L[it * R + r];
        const float* a = &A[(it * R + r) * Dv];
        for (int64_t d = 0; d < Dv; ++d) o[d] += w * a[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
      lp[row0 + r] = mx + std::log(total);
    }
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(qkv_decode, m) {
  m.def(
      "decode_forward(Tensor q, Tensor k, Tensor v, Tensor start, Tensor end, int lo, int hi, "
      "float scale, int splits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(qkv_decode, CPU, m) { m.impl("decode_forward", &decode_forward); }
