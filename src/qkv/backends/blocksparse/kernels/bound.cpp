// The bound on |logits| that qkv's automatic choice reads on every call that needs gradients
// (qkv/backends/base.py, logit_bound): max over (batch, query head) of the largest query
// norm times the largest key norm of its kv head. torch's operators take ~25 us for it on a
// small problem (two norms, three maxima, a product: eight dispatches), as much as a fifth of
// the attention call it guards; this is one pass over q and k in one call.
//
// q [B, Hq, Lq, D] and k [B, Hkv, Lk, D], any strides, float32/float64/float16/bfloat16 (CPU).
// Squares are summed in float32 (double for float64 inputs), so a half-precision norm does not
// overflow. Returns NaN if any element is NaN, inf if any is infinite, 0 for empty inputs.

#include "qkv_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

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

TORCH_LIBRARY_FRAGMENT(qkv_native, m) { m.def("logit_bound(Tensor q, Tensor k) -> float"); }

TORCH_LIBRARY_IMPL(qkv_native, CPU, m) { m.impl("logit_bound", &logit_bound); }
