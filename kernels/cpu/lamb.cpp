// Lamb's two phases (see cpu_optimizers.h). Scalar code the compiler vectorises (no per-ISA
// variants: Lamb is not on a path where the SIMD tables were measured to matter), split across
// cpu_threads() OpenMP threads; the sums are accumulated in double. The arithmetic follows DeepSpeed's FusedLamb
// kernel: moments from grad * grad_scale, update = m / (sqrt(v) + eps) + weight_decay * w, and
// w -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * trust_ratio * update.
#include <cmath>

#include "kernels/cpu/half_convert.h"
#include "kernels/cpu_isa.h"
#include "kernels/cpu_optimizers.h"

namespace zeroshard::kernels {

namespace {
bool bad(const void* a, int64_t n) { return n < 0 || (n > 0 && a == nullptr); }

inline float update_of(float w, float m, float v, const LambParams& p) {
  const float denom = p.eps_inside_sqrt ? std::sqrt(v + p.eps) : std::sqrt(v) + p.eps;
  return m / denom + p.weight_decay * w;
}
}  // namespace

Status lamb_moments(const float* param, const float* grad, float* m, float* v, int64_t n,
                    const LambParams& p, double* w_sq, double* u_sq) {
  if (bad(param, n) || bad(grad, n) || bad(m, n) || bad(v, n) || !w_sq || !u_sq || p.step < 1)
    return Status::invalid_argument;
  const float b1 = p.beta1, b2 = p.beta2, s = p.grad_scale;
  const int threads = cpu_threads();
  double w = 0.0, u = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : w, u) num_threads(threads) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * s;
    const float mi = b1 * m[i] + (1.0f - b1) * g;
    const float vi = b2 * v[i] + (1.0f - b2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float up = update_of(param[i], mi, vi, p);
    w += double(param[i]) * double(param[i]);
    u += double(up) * double(up);
  }
  *w_sq += w;
  *u_sq += u;
  return Status::ok;
}

float lamb_trust_ratio(double w_sq, double u_sq, const LambParams& p) {
  const float w = float(std::sqrt(w_sq)), u = float(std::sqrt(u_sq));
  if (w == 0.0f || u == 0.0f) return 1.0f;
  float ratio = w / u;
  if (ratio > p.max_coeff) ratio = p.max_coeff;
  if (ratio < p.min_coeff) ratio = p.min_coeff;
  return ratio;
}

Status lamb_apply(float* param, const float* m, const float* v, int64_t n, const LambParams& p,
                  float trust_ratio, HalfOut o) {
  if (bad(param, n) || bad(m, n) || bad(v, n) || p.step < 1) return Status::invalid_argument;
  if (o.data != nullptr && o.kind != Half::bf16 && o.kind != Half::fp16) return Status::invalid_argument;
  float step_size = p.lr;
  if (p.bias_correction) {
    const double bc1 = 1.0 - std::pow(double(p.beta1), double(p.step));
    const double bc2 = 1.0 - std::pow(double(p.beta2), double(p.step));
    step_size = float(double(p.lr) * std::sqrt(bc2) / bc1);
  }
  const float scale = step_size * trust_ratio;
  const int threads = cpu_threads();
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const float w = param[i] - scale * update_of(param[i], m[i], v[i], p);
    param[i] = w;
    if (o.data) o.data[i] = detail::f32_to_half(w, o.kind);
  }
  return Status::ok;
}

}  // namespace zeroshard::kernels
