// Scalar reference implementations of the CPU optimizers: one element at a time, following
// torch.optim's arithmetic. They are the portable fallback and the reference that every SIMD
// path (optimizers_avx2.cpp, optimizers_avx512.cpp) is tested against.
#include <cmath>

#include "kernels/cpu/half_convert.h"
#include "kernels/cpu/kernel_table.h"

namespace zeroshard::kernels::detail {
namespace {

float load_grad(GradRef g, int64_t i) {
  if (g.kind == Half::none) return static_cast<const float*>(g.data)[i];
  return half_to_f32(static_cast<const uint16_t*>(g.data)[i], g.kind);
}
void store_half(HalfOut o, int64_t i, float x) {
  if (o.data != nullptr) o.data[i] = f32_to_half(x, o.kind);
}

double adam(float* param, GradRef grad, float* m, float* v, int64_t n, const AdamConsts& c,
            HalfOut o) {
  double sum_sq = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float raw = load_grad(grad, i);
    if (c.sum_sq) sum_sq += double(raw) * raw;
    float g = raw * c.grad_scale;
    float w = param[i];
    if (c.adamw) w *= c.decay;
    else g += c.weight_decay * w;
    m[i] = c.beta1 * m[i] + c.one_minus_beta1 * g;
    v[i] = c.beta2 * v[i] + c.one_minus_beta2 * g * g;
    const float denom = std::sqrt(v[i]) / c.bc2_sqrt + c.eps;
    param[i] = w - c.step_size * (m[i] / denom);
    store_half(o, i, param[i]);
  }
  return sum_sq;
}

void sgd(float* param, const float* grad, float* buf, int64_t n, const SgdConsts& c, HalfOut o) {
  for (int64_t i = 0; i < n; ++i) {
    float g = grad[i] + c.weight_decay * param[i];
    if (c.has_momentum) {
      buf[i] = c.first_step ? g : c.momentum * buf[i] + c.one_minus_dampening * g;
      g = c.nesterov ? g + c.momentum * buf[i] : buf[i];
    }
    param[i] -= c.lr * g;
    store_half(o, i, param[i]);
  }
}

void adagrad(float* param, const float* grad, float* sum, int64_t n, const AdagradConsts& c,
             HalfOut o) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] + c.weight_decay * param[i];
    sum[i] += g * g;
    param[i] -= c.clr * g / (std::sqrt(sum[i]) + c.eps);
    store_half(o, i, param[i]);
  }
}

void lion(float* param, const float* grad, float* m, int64_t n, const LionConsts& c, HalfOut o) {
  for (int64_t i = 0; i < n; ++i) {
    const float u = c.beta1 * m[i] + c.one_minus_beta1 * grad[i];
    const float sign = float((u > 0.0f) - (u < 0.0f));
    param[i] = param[i] * c.decay - c.lr * sign;
    m[i] = c.beta2 * m[i] + c.one_minus_beta2 * grad[i];
    store_half(o, i, param[i]);
  }
}

double sum_sq(GradRef grad, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = load_grad(grad, i);
    s += g * g;
  }
  return s;
}

void cast_to_half(const float* src, uint16_t* dst, Half kind, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_half(src[i], kind);
}
void cast_from_half(const uint16_t* src, Half kind, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = half_to_f32(src[i], kind);
}

void scale_copy(const float* src, float* dst, int64_t n, float scale, bool /*stream*/) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
}

}  // namespace

const KernelTable& scalar_table() {
  static const KernelTable table{adam, sgd, adagrad, lion, sum_sq, cast_to_half, cast_from_half,
                                 scale_copy};
  return table;
}

}  // namespace zeroshard::kernels::detail
