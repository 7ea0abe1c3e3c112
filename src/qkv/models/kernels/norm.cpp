// RMSNorm for the decoder's rows: y = x * (1 / sqrt(mean(x^2) + eps)) * weight, in float32.
//
// Decoding SmolLM2-135M calls it 61 times a token on one 576-wide row; torch's F.rms_norm is
// ~8 operators there (~10 us a call on one thread), ~0.6 ms of a ~16 ms token. One pass here.
// The products are rounded as torch's are (x * rstd, then * weight); the sum of squares is
// taken in another order (vectors of lanes), so results agree with F.rms_norm to float32
// rounding, not bit for bit.

#include "qkv_cpu.h"

#include <algorithm>
#include <cmath>

namespace {

using qkv_cpu::Vec;

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

TORCH_LIBRARY_FRAGMENT(qkv_quant, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(qkv_quant, CPU, m) { m.impl("rms_norm", &rms_norm); }
