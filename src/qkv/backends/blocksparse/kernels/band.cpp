// qkv's CPU kernels for band masks (sliding windows): visible iff lo <= k - q <= hi, and
// optionally (struct Extra) only keys in a per-batch range (padding) or in the query's own
// document: a padding or document mask is the band of every key with one of these.
// band_forward computes out and lse; band_backward the gradients from them (below).
//
// Built on first use by qkv/backends/blocksparse/native.py (torch.utils.cpp_extension) and registered
// as the operator torch.ops.qkv_native.band_forward. float32, contiguous [B, H, L, D] inputs,
// grouped-query heads (H a multiple of Hkv), D != Dv allowed.
//
// Why it exists (benchmarks/RESULTS.md): torch's fused CPU flash kernel, fed a band as a batch
// of strided 32-row tiles, spends most of its time in small GEMMs whose B operand (Kᵀ) is
// packed again for every tile, and its output must then be copied into place. Here each task
// (one head, a run of `chunk` query blocks) transposes its keys once into a Kᵀ panel, every
// query block multiplies against its slice of that panel with oneDNN's batch-reduce GEMM
// (no packing; a span of at most 32 keys with small_gemm below, cheaper than a library call at
// that size), and P·V is written straight into the output. Each query block sees only the
// keys its rows can see (M + hi - lo columns), and only the two triangles at the ends of that
// span are masked. One pass per block: the span is short, so no online rescaling is needed.

#include "qkv_cpu.h"

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <optional>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using qkv_cpu::Vec;

#if defined(__AVX2__)
// One 8x8 tile: dst[c * ldd + r] = src[r * lds + c] for r, c < 8 (unpack, shuffle, permute).
inline void transpose8x8(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * lds);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    const int o = 4 * i;
    u[o + 0] = _mm256_shuffle_ps(t[o + 0], t[o + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[o + 1] = _mm256_shuffle_ps(t[o + 0], t[o + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[o + 2] = _mm256_shuffle_ps(t[o + 1], t[o + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[o + 3] = _mm256_shuffle_ps(t[o + 1], t[o + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}
#endif

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols: the keys of a panel as Kᵀ.
void transpose_panel(const float* src, int64_t rows, int64_t cols, int64_t lds, float* dst,
                     int64_t ldd) {
  int64_t r0 = 0, c_end = 0;
#if defined(__AVX2__)
  c_end = cols - cols % 8;
  for (; r0 + 8 <= rows; r0 += 8) {
    for (int64_t c = 0; c < c_end; c += 8) transpose8x8(src + r0 * lds + c, lds, dst + c * ldd + r0, ldd);
  }
#endif
  // what the 8x8 tiles did not cover: the last rows (all columns), the last columns
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = (c < c_end ? r0 : 0); r < rows; ++r) dst[c * ldd + r] = src[r * lds + c];
  }
}

// c[r, 0:NV·V) = a[r, 0:K) · b[0:K, 0:NV·V) for rows r0 <= r < r0 + R (rows lda, ldb, ldc
// apart): the products of a narrow band (a block of 16 rows against a span of a few dozen keys),
// where a library GEMM's cost per call is much of the work. R rows at once, so that R·NV sums
// are in flight (one row's NV chains of dependent FMAs would wait on their latency). Columns past
// the caller's width are computed from whatever b holds there: the caller leaves room for them
// in b and c and never reads them.
template <int R, int NV>
void small_rows(int64_t r0, int64_t K, const float* a, int64_t lda, const float* b, int64_t ldb,
                float* c, int64_t ldc) {
  constexpr int64_t V = Vec::size();
  Vec acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = Vec(0.f);
  const float* ar = a + r0 * lda;
  for (int64_t p = 0; p < K; ++p) {
    const float* br = b + p * ldb;
    Vec y[NV];
    for (int j = 0; j < NV; ++j) y[j] = Vec::loadu(br + j * V);
    for (int i = 0; i < R; ++i) {
      const Vec x(ar[i * lda + p]);
      for (int j = 0; j < NV; ++j) acc[i][j] = at::vec::fmadd(x, y[j], acc[i][j]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j].store(c + (r0 + i) * ldc + j * V);
}

template <int NV>
void small_gemm(int64_t m, int64_t K, const float* a, int64_t lda, const float* b, int64_t ldb,
                float* c, int64_t ldc) {
  constexpr int R = NV <= 2 ? 4 : NV <= 4 ? 2 : 1;  // R·NV sums within the vector registers
  int64_t r = 0;
  for (; r + R <= m; r += R) small_rows<R, NV>(r, K, a, lda, b, ldb, c, ldc);
  for (; r < m; ++r) small_rows<1, NV>(r, K, a, lda, b, ldb, c, ldc);
}

// The widths small_gemm takes (in whole vectors), and the call for one of them.
constexpr int64_t SMALL_VECS = 8;
void small_product(int64_t vecs, int64_t m, int64_t K, const float* a, int64_t lda,
                   const float* b, int64_t ldb, float* c, int64_t ldc) {
  switch (vecs) {
    case 1: return small_gemm<1>(m, K, a, lda, b, ldb, c, ldc);
    case 2: return small_gemm<2>(m, K, a, lda, b, ldb, c, ldc);
    case 3: return small_gemm<3>(m, K, a, lda, b, ldb, c, ldc);
    case 4: return small_gemm<4>(m, K, a, lda, b, ldb, c, ldc);
    case 5: return small_gemm<5>(m, K, a, lda, b, ldb, c, ldc);
    case 6: return small_gemm<6>(m, K, a, lda, b, ldb, c, ldc);
    case 7: return small_gemm<7>(m, K, a, lda, b, ldb, c, ldc);
    default: return small_gemm<8>(m, K, a, lda, b, ldb, c, ldc);
  }
}

// One row of raw scores s[0, n): keep columns [a, e) as exp(s * scale - max), zero the rest.
// Returns (max, sum) of the scaled row; (-inf, 0) when the row sees no key.
std::pair<float, float> softmax_row(float* s, int64_t n, int64_t a, int64_t e, float scale) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (e <= a) {
    std::fill(s, s + n, 0.f);
    return {neg_inf, 0.f};
  }
  std::fill(s, s + a, 0.f);
  std::fill(s + e, s + n, 0.f);
  float* x = s + a;
  const int64_t len = e - a;
  const int64_t vlen = len - len % Vec::size();
  // max(s * scale) is max(s) * scale for scale >= 0 and min(s) * scale otherwise
  // (multiplying by a constant is monotonic in floating point too): one read-only pass, one
  // reduction across lanes (a row of a narrow band is one or two vectors: the reductions are
  // much of its cost).
  const bool up = scale >= 0.f;
  const float start = up ? neg_inf : std::numeric_limits<float>::infinity();
  const auto pick = [up](const Vec& u, const Vec& w) {
    return up ? at::vec::maximum(u, w) : at::vec::minimum(u, w);
  };
  Vec vx(start);
  int64_t i = 0;
  for (; i < vlen; i += Vec::size()) vx = pick(vx, Vec::loadu(x + i));
  if (i < len) {  // the last len - vlen scores: one partial vector, not a scalar loop (a
    const int64_t c = len - i;  // row of 8 keys is all tail under AVX-512's 16 lanes)
    vx = pick(vx, Vec::set(Vec(start), Vec::loadu(x + i, c), c));
  }
  // maximum/minimum propagate a NaN lane, and so does the reduction
  const float ext = at::vec::vec_reduce_all<float>(
      [&pick](Vec& u, Vec& w) { return pick(u, w); }, vx);
  const float mx = ext * scale;
  if (std::isnan(mx) || mx == -neg_inf) {
    // A NaN score (a NaN query or key), or +inf (inf - inf in the softmax), makes the row NaN,
    // as in the formula. Said explicitly: exp_u20 clamps its input with min/max, which turn
    // NaN into a finite number on some ISAs (AVX-512).
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::fill(x, x + len, nan);
    return {nan, nan};
  }
  if (mx == neg_inf) {  // -inf scores (from infinite inputs): no weight anywhere
    std::fill(x, x + len, 0.f);
    return {neg_inf, 0.f};
  }
  const Vec vscale(scale), vm(mx);
  Vec acc(0.f);
  for (i = 0; i < vlen; i += Vec::size()) {
    const Vec t = at::vec::fmsub(Vec::loadu(x + i), vscale, vm).exp_u20();
    acc += t;
    t.store(x + i);
  }
  if (i < len) {  // the tail as one partial vector; its unused lanes add nothing
    const int64_t c = len - i;
    const Vec t = Vec::set(Vec(0.f), at::vec::fmsub(Vec::loadu(x + i, c), vscale, vm).exp_u20(), c);
    acc += t;
    t.store(x + i, c);
  }
  return {mx, at::vec::vec_reduce_all<float>([](Vec& u, Vec& w) { return u + w; }, acc)};
}

// What a batch element's rows may see besides the band (both optional): keys
// [start[b], limit[b]) (a padding mask: int64 [B]), and keys of the row's own document
// (ids[b][q] == ids[b][k]: int64 ids of every position, one row that every batch element
// shares, or one row per batch element, ids_stride apart). Range limits narrow each block's
// span. A sorted row of ids is runs: each block's span and each row's columns narrow to its
// documents' keys (run_lo, run_hi); an unsorted row masks single scores inside the span.
struct Extra {
  const int64_t* start = nullptr;
  const int64_t* limit = nullptr;
  const int64_t* ids = nullptr;
  int64_t ids_stride = 0;  // between batch elements' rows of ids: 0 when one row serves all
  int64_t n = 0;           // positions per row that the runs cover: max(Lq, Lk)
  // sorted rows: position i of ids row r is in the document [lo, hi) at run_*[r * n + i]
  std::vector<int64_t> run_lo, run_hi;
  std::vector<char> sorted;  // per row of ids

  int64_t row_of(int64_t b) const { return ids_stride == 0 ? 0 : b; }
  bool runs(int64_t b) const { return !sorted.empty() && sorted[row_of(b)]; }

  void find_runs(int64_t rows, int64_t positions) {
    n = positions;
    if (ids == nullptr || n == 0) return;
    sorted.assign(rows, 0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t* id = ids + r * ids_stride;
      bool up = true;
      for (int64_t i = 1; i < n && up; ++i) up = id[i] >= id[i - 1];
      if (!up) continue;  // not sorted: this row's scores are masked one by one
      if (run_lo.empty()) {
        run_lo.resize(rows * n);
        run_hi.resize(rows * n);
      }
      sorted[r] = 1;
      int64_t* lo = run_lo.data() + r * n;
      int64_t* hi = run_hi.data() + r * n;
      for (int64_t i = 0; i < n;) {
        int64_t j = i;
        while (j < n && id[j] == id[i]) ++j;
        std::fill(lo + i, lo + j, i);
        std::fill(hi + i, hi + j, j);
        i = j;
      }
    }
  }
  // [k0, k1) narrowed to the keys of the documents of batch b's query rows [r0, r1) (a
  // sorted row of ids)
  void narrow(int64_t b, int64_t r0, int64_t r1, int64_t& k0, int64_t& k1) const {
    if (!runs(b)) return;
    const int64_t base = row_of(b) * n;
    k0 = std::max(k0, run_lo[base + r0]);
    k1 = std::min(k1, run_hi[base + r1 - 1]);
  }
  // a row's columns [a, e) of a block whose keys start at k0, narrowed the same way
  void narrow_row(int64_t b, int64_t row, int64_t k0, int64_t& a, int64_t& e) const {
    if (!runs(b)) return;
    const int64_t base = row_of(b) * n;
    a = std::clamp<int64_t>(run_lo[base + row] - k0, a, e);  // a <= e stays true
    e = std::clamp<int64_t>(run_hi[base + row] - k0, a, e);
  }

  int64_t first_key(int64_t b, int64_t Lk) const {
    return start ? std::clamp<int64_t>(start[b], 0, Lk) : 0;
  }
  int64_t end_key(int64_t b, int64_t Lk) const {  // never before first_key
    return limit ? std::clamp<int64_t>(limit[b], first_key(b, Lk), Lk) : Lk;
  }
  // s[j] = fill for j in [a, e) where key k0 + j is in another document than batch b's
  // query row `row` (an unsorted row of ids)
  void mask_row(int64_t b, float* s, int64_t row, int64_t k0, int64_t a, int64_t e,
                float fill) const {
    if (ids == nullptr || runs(b)) return;
    const int64_t* id = ids + row_of(b) * ids_stride;
    const int64_t mine = id[row];
    for (int64_t j = a; j < e; ++j) {
      if (id[k0 + j] != mine) s[j] = fill;
    }
  }
};

const int64_t* optional_ints(const std::optional<at::Tensor>& t, int64_t min_size,
                             const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kLong && t->device().is_cpu() && t->is_contiguous() &&
                  t->dim() == 1 && t->size(0) >= min_size,
              "band kernel: ", what, " must be a contiguous int64 CPU tensor of at least ",
              min_size, " entries");
  return t->const_data_ptr<int64_t>();
}

Extra extra_of(const std::optional<at::Tensor>& start, const std::optional<at::Tensor>& limit,
               const std::optional<at::Tensor>& ids, int64_t B, int64_t Lq, int64_t Lk) {
  Extra ex{optional_ints(start, B, "kstart"), optional_ints(limit, B, "klimit")};
  const int64_t n = std::max(Lq, Lk);
  int64_t rows = 1;
  if (ids.has_value() && ids->defined()) {
    // [L] or [1, L]: one row that every batch element shares; [B, L]: a row per batch element
    const at::Tensor& t = *ids;
    const bool shape_ok =
        (t.dim() == 1 || (t.dim() == 2 && (t.size(0) == 1 || t.size(0) == B))) &&
        t.size(t.dim() - 1) >= n;
    TORCH_CHECK(t.scalar_type() == at::kLong && t.device().is_cpu() && t.is_contiguous() &&
                    shape_ok,
                "band kernel: ids must be a contiguous int64 CPU tensor [L] or [1 or B, L] with "
                "L >= max(Lq, Lk) = ", n, " (B = ", B, "), got ", t.sizes());
    const bool per_row = t.dim() == 2 && t.size(0) > 1;
    ex.ids = t.const_data_ptr<int64_t>();
    ex.ids_stride = per_row ? t.size(1) : 0;
    rows = per_row ? B : 1;
  }
  ex.find_runs(rows, n);
  return ex;
}

std::tuple<at::Tensor, at::Tensor> band_forward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, int64_t lo, int64_t hi,
                                                double scale_d, int64_t block, int64_t chunk,
                                                const std::optional<at::Tensor>& kstart,
                                                const std::optional<at::Tensor>& klimit,
                                                const std::optional<at::Tensor>& ids) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "band_forward: 4-D q, k, v");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "band_forward: float32 only");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              "band_forward: CPU tensors only");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
              "band_forward: contiguous q, k, v");
  TORCH_CHECK(lo <= hi && block > 0 && chunk > 0, "band_forward: lo <= hi, block, chunk > 0");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), Lk = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hk && v.size(2) == Lk &&
                  k.size(3) == D && Hk > 0 && H % Hk == 0,
              "band_forward: shapes do not match");
  const Extra ex = extra_of(kstart, klimit, ids, B, Lq, Lk);
  auto out = at::empty({B, H, Lq, Dv}, q.options());
  auto lse = at::empty({B, H, Lq}, q.options());
  if (B == 0 || H == 0 || Lq == 0) return {out, lse};

  const int64_t G = H / Hk;
  const float scale = static_cast<float>(scale_d);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t nblocks = (Lq + block - 1) / block;
  const int64_t nchunks = (nblocks + chunk - 1) / chunk;
  const int64_t width = hi - lo;  // a block of M rows sees at most M + width keys
  const int64_t max_n = std::max<int64_t>(1, std::min<int64_t>(Lk, block + width));
  const int64_t max_panel = std::max<int64_t>(1, std::min<int64_t>(Lk, block * chunk + width));
  const float* qd = q.const_data_ptr<float>();
  const float* kd = k.const_data_ptr<float>();
  const float* vd = v.const_data_ptr<float>();
  float* od = out.data_ptr<float>();
  float* ld = lse.data_ptr<float>();

  // a block whose span is at most SMALL_SPAN keys multiplies with small_gemm, and P·V too
  // where Dv is whole vectors: a score row then takes whole vectors (lds), and the panel has
  // room for the last row's reads past its keys. Past 32 keys oneDNN's GEMM was as fast or
  // faster (a window of 32 at D=64: 1.19x its time with small_gemm up to 64 keys, AVX-512).
  constexpr int64_t V = Vec::size(), SMALL_SPAN = 32;
  const bool small_pv = Dv % V == 0 && Dv / V <= SMALL_VECS;
  at::parallel_for(0, B * H * nchunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(block * (max_n + V)), panel(D * max_panel + SMALL_SPAN),
        row_max(block), row_sum(block);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task % nchunks, bh = task / nchunks, h = bh % H, b = bh / H;
      const int64_t cq0 = c * chunk * block, cq1 = std::min(Lq, cq0 + chunk * block);
      const int64_t ks = ex.first_key(b, Lk), ke = ex.end_key(b, Lk);
      int64_t kc0 = std::clamp<int64_t>(cq0 + lo, ks, ke);
      int64_t kc1 = std::clamp<int64_t>(cq1 - 1 + hi + 1, ks, ke);
      ex.narrow(b, cq0, cq1, kc0, kc1);
      const int64_t kv_head = b * Hk + h / G;
      const float* kbase = kd + kv_head * Lk * D;
      const float* vbase = vd + kv_head * Lk * Dv;
      const int64_t np = kc1 - kc0;  // the panel's keys: Kᵀ[:, kc0:kc1] as [D, np]
      if (np > 0) transpose_panel(kbase + kc0 * D, np, D, D, panel.data(), np);
      for (int64_t q0 = cq0; q0 < cq1; q0 += block) {
        const int64_t q1 = std::min(cq1, q0 + block), m = q1 - q0;
        int64_t k0 = std::clamp<int64_t>(q0 + lo, ks, ke);
        int64_t k1 = std::clamp<int64_t>(q1 - 1 + hi + 1, ks, ke);
        ex.narrow(b, q0, q1, k0, k1);
        const float* qp = qd + ((b * H + h) * Lq + q0) * D;
        float* op = od + ((b * H + h) * Lq + q0) * Dv;
        float* lp = ld + (b * H + h) * Lq + q0;
        if (k1 <= k0) {  // no row of this block sees a key
          std::fill(op, op + m * Dv, 0.f);
          std::fill(lp, lp + m, neg_inf);
          continue;
        }
        const int64_t n = k1 - k0, vecs = (n + V - 1) / V;
        const bool small = vecs * V <= SMALL_SPAN;
        const int64_t lds = small ? vecs * V : n;  // a score row's stride
        // scores [m, n] = q_block [m, D] · Kᵀ[:, k0:k1] [D, n]
        if (small) {
          small_product(vecs, m, D, qp, D, panel.data() + (k0 - kc0), np, scores.data(), lds);
        } else {
          at::native::cpublas::brgemm(m, n, D, D, np, n, false, qp, panel.data() + (k0 - kc0),
                                      scores.data(), false);
        }
        for (int64_t r = 0; r < m; ++r) {
          // row q0 + r sees keys [q0 + r + lo, q0 + r + hi], i.e. columns [a, e)
          int64_t a = std::clamp<int64_t>(q0 + r + lo - k0, 0, n);
          int64_t e = std::clamp<int64_t>(q0 + r + hi + 1 - k0, 0, n);
          ex.narrow_row(b, q0 + r, k0, a, e);
          ex.mask_row(b, scores.data() + r * lds, q0 + r, k0, a, e, neg_inf);
          std::tie(row_max[r], row_sum[r]) = softmax_row(scores.data() + r * lds, n, a, e, scale);
        }
        // out [m, Dv] = p [m, n] · V[k0:k1] [n, Dv], then each row divided by its sum
        if (small && small_pv) {
          small_product(Dv / V, m, n, scores.data(), lds, vbase + k0 * Dv, Dv, op, Dv);
        } else {
          at::native::cpublas::brgemm(m, Dv, n, lds, Dv, Dv, false, scores.data(),
                                      vbase + k0 * Dv, op, false);
        }
        for (int64_t r = 0; r < m; ++r) {
          float* orow = op + r * Dv;
          if (row_sum[r] == 0.f) {
            std::fill(orow, orow + Dv, 0.f);
            lp[r] = neg_inf;
            continue;
          }
          const float inv = 1.f / row_sum[r];
          at::vec::map<float>([inv](Vec x) { return x * Vec(inv); }, orow, orow, Dv);
          lp[r] = row_max[r] + std::log(row_sum[r]);
        }
      }
    }
    at::native::cpublas::brgemm_release(false);
  });
  return {out, lse};
}


// The backward of band_forward, recomputing from the saved lse (FlashAttention's backward):
// per query block, P = exp(s·scale − lse), dP = dO·Vᵀ, dS = P ∘ (dP − D) with
// D = rowsum(dO ∘ out) − dlse; dq = scale·dS·K (each row written once), and dk += scale·dSᵀ·Q,
// dv += Pᵀ·dO straight into the outputs. A task is one (batch, kv head, run of query rows)
// and loops over the query heads that share the kv head (GQA), so tasks of one phase never
// write the same dk/dv rows: runs are at least as long as the band is wide, and even and odd
// runs go in two phases (a run's keys reach only into its neighbours' keys).
// lse arrives as hi + lo float32 parts of the float64 lse (exp((s − hi) − lo) loses nothing to
// the rounding of a large lse).
std::tuple<at::Tensor, at::Tensor, at::Tensor> band_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& dout, const at::Tensor& lse_hi, const at::Tensor& lse_lo,
    const at::Tensor& dlse, int64_t lo, int64_t hi, double scale_d, int64_t block,
    int64_t chunk, const std::optional<at::Tensor>& kstart,
    const std::optional<at::Tensor>& klimit, const std::optional<at::Tensor>& ids) {
  for (const at::Tensor* t : {&q, &k, &v, &out, &dout, &lse_hi, &lse_lo}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                "band_backward: contiguous float32 CPU tensors only");
  }
  TORCH_CHECK(lo <= hi && block > 0 && chunk > 0, "band_backward: lo <= hi, block, chunk > 0");
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), Lk = k.size(2), Dv = v.size(3);
  TORCH_CHECK(Hk > 0 && H % Hk == 0 && out.size(3) == Dv && dout.sizes() == out.sizes(),
              "band_backward: shapes do not match");
  const Extra ex = extra_of(kstart, klimit, ids, B, Lq, Lk);
  const bool has_dlse = dlse.numel() > 0;
  TORCH_CHECK(!has_dlse || (dlse.scalar_type() == at::kFloat && dlse.is_contiguous() &&
                            dlse.numel() == B * H * Lq),
              "band_backward: dlse must be empty or a contiguous float32 [B, H, Lq]");
  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::zeros(k.sizes(), k.options());
  auto dv = at::zeros(v.sizes(), v.options());
  if (B == 0 || H == 0 || Lq == 0 || Lk == 0) {
    dq.zero_();
    return {dq, dk, dv};
  }
  const int64_t G = H / Hk;
  const float scale = static_cast<float>(scale_d);
  const int64_t width = hi - lo;
  // rows per run: a multiple of the block, and no shorter than the band is wide
  int64_t run = chunk * block;
  if (run < width + 1) run = (width + 1 + block - 1) / block * block;
  const int64_t nruns = (Lq + run - 1) / run;
  const int64_t max_n = std::max<int64_t>(1, std::min<int64_t>(Lk, block + width));
  const int64_t max_panel = std::max<int64_t>(1, std::min<int64_t>(Lk, run + width));
  const float* qd = q.const_data_ptr<float>();
  const float* kd = k.const_data_ptr<float>();
  const float* vd = v.const_data_ptr<float>();
  const float* od = out.const_data_ptr<float>();
  const float* dod = dout.const_data_ptr<float>();
  const float* lhd = lse_hi.const_data_ptr<float>();
  const float* lld = lse_lo.const_data_ptr<float>();
  const float* dld = has_dlse ? dlse.const_data_ptr<float>() : nullptr;
  float* dqd = dq.data_ptr<float>();
  float* dkd = dk.data_ptr<float>();
  float* dvd = dv.data_ptr<float>();

  for (int64_t phase = 0; phase < 2; ++phase) {
    const int64_t nr = (nruns - phase + 1) / 2;  // runs phase, phase + 2, ...
    at::parallel_for(0, B * Hk * nr, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> p(block * max_n), ds(block * max_n), t(max_n * block),
          kt(D * max_panel), vt(Dv * max_panel), drow(block);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t c = phase + 2 * (task % nr), bk = task / nr, hk = bk % Hk, b = bk / Hk;
        const int64_t cq0 = c * run, cq1 = std::min(Lq, cq0 + run);
        const int64_t ks = ex.first_key(b, Lk), ke = ex.end_key(b, Lk);
        int64_t kc0 = std::clamp<int64_t>(cq0 + lo, ks, ke);
        int64_t kc1 = std::clamp<int64_t>(cq1 - 1 + hi + 1, ks, ke);
        ex.narrow(b, cq0, cq1, kc0, kc1);
        const int64_t np = kc1 - kc0;
        const float* kbase = kd + (b * Hk + hk) * Lk * D;
        const float* vbase = vd + (b * Hk + hk) * Lk * Dv;
        float* dkbase = dkd + (b * Hk + hk) * Lk * D;
        float* dvbase = dvd + (b * Hk + hk) * Lk * Dv;
        if (np > 0) {
          transpose_panel(kbase + kc0 * D, np, D, D, kt.data(), np);
          transpose_panel(vbase + kc0 * Dv, np, Dv, Dv, vt.data(), np);
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = hk * G + g, bh = b * H + h;
          for (int64_t q0 = cq0; q0 < cq1; q0 += block) {
            const int64_t q1 = std::min(cq1, q0 + block), m = q1 - q0;
            int64_t k0 = std::clamp<int64_t>(q0 + lo, ks, ke);
            int64_t k1 = std::clamp<int64_t>(q1 - 1 + hi + 1, ks, ke);
            ex.narrow(b, q0, q1, k0, k1);
            float* dqp = dqd + (bh * Lq + q0) * D;
            if (k1 <= k0) {
              std::fill(dqp, dqp + m * D, 0.f);
              continue;
            }
            const int64_t n = k1 - k0;
            const float* qp = qd + (bh * Lq + q0) * D;
            const float* dop = dod + (bh * Lq + q0) * Dv;
            const float* op = od + (bh * Lq + q0) * Dv;
            at::native::cpublas::brgemm(m, n, D, D, np, n, false, qp, kt.data() + (k0 - kc0),
                                        p.data(), false);
            at::native::cpublas::brgemm(m, n, Dv, Dv, np, n, false, dop,
                                        vt.data() + (k0 - kc0), ds.data(), false);
            for (int64_t r = 0; r < m; ++r) {
              const int64_t row = bh * Lq + q0 + r;
              int64_t a = std::clamp<int64_t>(q0 + r + lo - k0, 0, n);
              int64_t e = std::clamp<int64_t>(q0 + r + hi + 1 - k0, 0, n);
              ex.narrow_row(b, q0 + r, k0, a, e);
              float* pr = p.data() + r * n;
              float* dr = ds.data() + r * n;
              float dsum = at::vec::map2_reduce_all<float>(
                  [](Vec x, Vec y) { return x * y; }, [](Vec x, Vec y) { return x + y; },
                  dop + r * Dv, op + r * Dv, Dv);
              if (has_dlse) dsum -= dld[row];
              const float lh = lhd[row], ll = lld[row];
              std::fill(pr, pr + a, 0.f);
              std::fill(dr, dr + a, 0.f);
              std::fill(pr + e, pr + n, 0.f);
              std::fill(dr + e, dr + n, 0.f);
              if (std::isnan(lh) || std::isnan(dsum)) {  // a NaN row: NaN gradients (not
                const float nan = std::numeric_limits<float>::quiet_NaN();  // exp_u20's)
                std::fill(pr + a, pr + e, nan);
                std::fill(dr + a, dr + e, nan);
                ex.mask_row(b, pr, q0 + r, k0, a, e, 0.f);  // (other documents' keys stay 0)
                ex.mask_row(b, dr, q0 + r, k0, a, e, 0.f);
                continue;
              }
              const Vec vscale(scale), vlh(lh), vll(ll), vd(dsum);
              int64_t i = a;
              for (; i + Vec::size() <= e; i += Vec::size()) {
                const Vec pv = ((at::vec::fmsub(Vec::loadu(pr + i), vscale, vlh)) - vll).exp_u20();
                pv.store(pr + i);
                ((Vec::loadu(dr + i) - vd) * pv * vscale).store(dr + i);
              }
              if (i < e) {  // the tail: one partial vector (see softmax_row)
                const int64_t c = e - i;
                const Vec pv =
                    ((at::vec::fmsub(Vec::loadu(pr + i, c), vscale, vlh)) - vll).exp_u20();
                pv.store(pr + i, c);
                ((Vec::loadu(dr + i, c) - vd) * pv * vscale).store(dr + i, c);
              }
              ex.mask_row(b, pr, q0 + r, k0, a, e, 0.f);  // keys of other documents: no weight
              ex.mask_row(b, dr, q0 + r, k0, a, e, 0.f);
            }
            // dq = scale·dS·K  (dS already carries the scale)
            at::native::cpublas::brgemm(m, D, n, n, D, D, false, ds.data(), kbase + k0 * D,
                                        dqp, false);
            // dv += Pᵀ·dO, dk += scale·dSᵀ·Q: the transposed blocks go through t [n, m]
            transpose_panel(p.data(), m, n, n, t.data(), m);
            at::native::cpublas::brgemm(n, Dv, m, m, Dv, Dv, true, t.data(), dop,
                                        dvbase + k0 * Dv, false);
            transpose_panel(ds.data(), m, n, n, t.data(), m);
            at::native::cpublas::brgemm(n, D, m, m, D, D, true, t.data(), qp, dkbase + k0 * D,
                                        false);
          }
        }
      }
      at::native::cpublas::brgemm_release(false);
    });
  }
  return {dq, dk, dv};
}

// ------------------------------------------------------------------ the bound auto reads
// The bound on |logits| that qkv's automatic choice reads on every call that needs gradients
// (qkv/backends/base.py, logit_bound): max over (batch, query head) of the largest query
// norm times the largest key norm of its kv head. torch's operators take ~25 us for it on a
// small problem (two norms, three maxima, a product: eight dispatches), as much as a fifth of
// the attention call it guards; this is one pass over q and k in one call.
//
// q [B, Hq, Lq, D] and k [B, Hkv, Lk, D], any strides, float32/float64/float16/bfloat16 (CPU).
// Squares are summed in float32 (double for float64 inputs), so a half-precision norm does not
// overflow. Returns NaN if any element is NaN, inf if any is infinite, 0 for empty inputs.

template <typename T, typename Acc>
Acc row_square(const T* p, int64_t n, int64_t stride) {
  Acc s = 0;
  for (int64_t d = 0; d < n; ++d) {
    const Acc x = static_cast<Acc>(p[d * stride]);
    s += x * x;
  }
  return s;
}

// The largest squared row norm of each [B*H] slice of x [B, H, L, D]; NaN where a row is NaN.
template <typename T, typename Acc>
void slice_maxima(const at::Tensor& x, std::vector<double>& out) {
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  const int64_t sb = x.stride(0), sh = x.stride(1), sl = x.stride(2), sd = x.stride(3);
  const T* base = x.data_ptr<T>();
  out.assign(B * H, 0.0);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, L * D));
  at::parallel_for(0, B * H, grain, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      const T* p = base + (s / H) * sb + (s % H) * sh;
      double m = 0;
      for (int64_t l = 0; l < L; ++l) {
        double r;
        if constexpr (std::is_same_v<T, float>) {
          if (sd == 1) {  // the common layout: a vector loop
            qkv_cpu::Vec acc(0.f);
            int64_t d = 0;
            for (; d + qkv_cpu::Vec::size() <= D; d += qkv_cpu::Vec::size()) {
              const qkv_cpu::Vec v = qkv_cpu::Vec::loadu(p + l * sl + d);
              acc = at::vec::fmadd(v, v, acc);
            }
            float t = at::vec::vec_reduce_all<float>([](qkv_cpu::Vec& a, qkv_cpu::Vec& b) { return a + b; }, acc);
            t += row_square<float, float>(p + l * sl + d, D - d, 1);
            r = t;
          } else {
            r = row_square<T, Acc>(p + l * sl, D, sd);
          }
        } else {
          r = static_cast<double>(row_square<T, Acc>(p + l * sl, D, sd));
        }
        if (std::isnan(r) || std::isnan(m)) {
          m = std::numeric_limits<double>::quiet_NaN();
        } else if (r > m) {
          m = r;
        }
      }
      out[s] = m;
    }
  });
}

void maxima(const at::Tensor& x, std::vector<double>& out) {
  switch (x.scalar_type()) {
    case at::kFloat: slice_maxima<float, float>(x, out); break;
    case at::kDouble: slice_maxima<double, double>(x, out); break;
    case at::kHalf: slice_maxima<at::Half, float>(x, out); break;
    case at::kBFloat16: slice_maxima<at::BFloat16, float>(x, out); break;
    default: TORCH_CHECK(false, "qkv_native.logit_bound: unsupported dtype ", x.scalar_type());
  }
}

double logit_bound(const at::Tensor& q, const at::Tensor& k) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && q.dim() == 4 && k.dim() == 4,
              "qkv_native.logit_bound: q and k must be 4-d CPU tensors");
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = k.size(1);
  TORCH_CHECK(k.size(0) == B && Hkv > 0 && Hq % Hkv == 0 && k.size(3) == q.size(3),
              "qkv_native.logit_bound: q ", q.sizes(), " and k ", k.sizes(), " do not pair");
  if (q.numel() == 0 || k.numel() == 0) return 0.0;
  std::vector<double> qm, km;
  maxima(q, qm);
  maxima(k, km);
  const int64_t G = Hq / Hkv;
  double bound = 0;
  for (int64_t s = 0; s < B * Hq; ++s) {
    const double v = std::sqrt(qm[s]) * std::sqrt(km[(s / Hq) * Hkv + (s % Hq) / G]);
    if (std::isnan(v)) return v;
    bound = std::max(bound, v);
  }
  return bound;
}

}  // namespace

TORCH_LIBRARY(qkv_native, m) {
  m.def(
      "band_forward(Tensor q, Tensor k, Tensor v, int lo, int hi, float scale, int block, "
      "int chunk, Tensor? kstart=None, Tensor? klimit=None, Tensor? ids=None) -> (Tensor, Tensor)");
  m.def(
      "band_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor dout, Tensor lse_hi, "
      "Tensor lse_lo, Tensor dlse, int lo, int hi, float scale, int block, int chunk, "
      "Tensor? kstart=None, Tensor? klimit=None, Tensor? ids=None) -> (Tensor, Tensor, Tensor)");
  m.def("logit_bound(Tensor q, Tensor k) -> float");
}

TORCH_LIBRARY_IMPL(qkv_native, CPU, m) {
  m.impl("band_forward", &band_forward);
  m.impl("band_backward", &band_backward);
  m.impl("logit_bound", &logit_bound);
}
