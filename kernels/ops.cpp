// Tensor -> pointer seam for the optimizer kernels; see ops.h. Checks say what is allowed.
#include "kernels/ops.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cpu_isa.h"
#ifdef ZEROSHARD_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda_kernels.h"
#endif

namespace zeroshard::ops {

namespace {

std::string describe(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return std::string(c10::toString(t.scalar_type())) + (t.is_contiguous() ? "" : " non-contiguous") +
         " tensor of " + std::to_string(t.numel()) + " elements on " + t.device().str();
}

void check(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
           bool allow_half = false) {
  const auto st = t.defined() ? t.scalar_type() : at::kFloat;
  const bool dtype_ok = st == at::kFloat || (allow_half && (st == at::kBFloat16 || st == at::kHalf));
  if (!t.defined() || !dtype_ok || !t.is_contiguous() || t.numel() != ref.numel() ||
      t.device() != ref.device()) {
    throw std::invalid_argument(std::string(op) + ": " + name + " must be a contiguous " +
                                (allow_half ? "float32, bfloat16 or float16" : "float32") +
                                " tensor with " + std::to_string(ref.numel()) + " elements on " +
                                ref.device().str() + "; got " + describe(t));
  }
}

kernels::Half half_kind(const at::Tensor& t) {
  if (t.scalar_type() == at::kBFloat16) return kernels::Half::bf16;
  if (t.scalar_type() == at::kHalf) return kernels::Half::fp16;
  return kernels::Half::none;
}

// The optional 16-bit parameter copy.
kernels::HalfOut half_out(const at::Tensor& p16, const at::Tensor& ref, const char* op) {
  if (!p16.defined()) return {};
  const auto k = half_kind(p16);
  if (k == kernels::Half::none || !p16.is_contiguous() || p16.numel() != ref.numel() ||
      p16.device() != ref.device())
    throw std::invalid_argument(std::string(op) + ": param16 must be a contiguous bfloat16 or float16 tensor with " +
                                std::to_string(ref.numel()) + " elements on " + ref.device().str() +
                                "; got " + describe(p16));
  return {reinterpret_cast<uint16_t*>(p16.data_ptr()), k};
}

void ok(kernels::Status s, const char* op) {
  if (s != kernels::Status::ok)
    throw std::runtime_error(std::string(op) + ": " + kernels::status_message(s));
}

// ATen fallback for devices without kernels: same arithmetic, several passes.
void write_half(const at::Tensor& param, const at::Tensor& p16) {
  if (p16.defined()) p16.copy_(param);
}

#ifdef ZEROSHARD_WITH_CUDA
// The CUDA launcher: kernels run on the caller's current stream, so they order after the
// backward pass that produced the gradients without any extra synchronisation.
void cuda_ok(cudaError_t e, const char* op) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(op) + ": " + cudaGetErrorString(e));
}

void cuda_adam_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& m, at::Tensor& v,
                    const kernels::AdamParams& p, const at::Tensor& param16) {
  const c10::cuda::CUDAGuard guard(param.device());
  kernels::cuda::AdamTensor t;
  t.param = param.data_ptr<float>();
  t.grad = grad.data_ptr();
  t.exp_avg = m.data_ptr<float>();
  t.exp_avg_sq = v.data_ptr<float>();
  t.param16 = param16.defined() ? param16.data_ptr() : nullptr;
  t.n = param.numel();
  cuda_ok(kernels::cuda::multi_tensor_adam(&t, 1, half_kind(grad),
                                           param16.defined() ? half_kind(param16) : kernels::Half::none,
                                           p, c10::cuda::getCurrentCUDAStream().stream()),
          "adam_step (CUDA)");
}

kernels::GradStats cuda_grad_stats(const at::Tensor& grad) {
  const c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor acc = at::zeros({1}, grad.options().dtype(at::kDouble));
  cuda_ok(kernels::cuda::sum_squares(grad.data_ptr(), half_kind(grad), grad.numel(),
                                     acc.data_ptr<double>(), c10::cuda::getCurrentCUDAStream().stream()),
          "grad_stats (CUDA)");
  kernels::GradStats st;
  st.sum_sq = acc.item<double>();   // the caller asked for a host value: this syncs once
  st.finite = std::isfinite(st.sum_sq);
  return st;
}
#endif

}  // namespace

void adam_step(at::Tensor param, const at::Tensor& grad, at::Tensor m, at::Tensor v,
               const kernels::AdamParams& p, const at::Tensor& param16, kernels::GradStats* stats) {
  check(param, param, "adam_step", "param");
  check(grad, param, "adam_step", "grad", /*allow_half=*/true);
  check(m, param, "adam_step", "exp_avg");
  check(v, param, "adam_step", "exp_avg_sq");
  const kernels::HalfOut out = half_out(param16, param, "adam_step");
  if (param.is_cpu()) {
    const auto gk = half_kind(grad);
    if (gk == kernels::Half::none)
      ok(kernels::adam_step(param.data_ptr<float>(), grad.data_ptr<float>(), m.data_ptr<float>(),
                            v.data_ptr<float>(), param.numel(), p, out, stats), "adam_step");
    else
      ok(kernels::adam_step(param.data_ptr<float>(), reinterpret_cast<const uint16_t*>(grad.data_ptr()),
                            gk, m.data_ptr<float>(), v.data_ptr<float>(), param.numel(), p, out, stats),
         "adam_step");
    return;
  }
  // Other devices read the gradient once more for the statistics (before the update; it is
  // read only, so the order does not matter).
  if (stats != nullptr) *stats = grad_stats(grad);
#ifdef ZEROSHARD_WITH_CUDA
  if (param.is_cuda()) {
    cuda_adam_step(param, grad, m, v, p, param16);
    return;
  }
#endif
  const double bc1 = p.bias_correction ? 1.0 - std::pow(double(p.beta1), double(p.step)) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(double(p.beta2), double(p.step)) : 1.0;
  at::Tensor g = grad.to(at::kFloat);
  if (p.grad_scale != 1.0f) g = g.mul(p.grad_scale);
  if (p.weight_decay != 0.0f) {
    if (p.adamw_mode) param.mul_(1.0 - double(p.lr) * p.weight_decay);
    else g = g.add(param, p.weight_decay);
  }
  m.mul_(p.beta1).add_(g, 1.0 - p.beta1);
  v.mul_(p.beta2).addcmul_(g, g, 1.0 - p.beta2);
  param.addcdiv_(m, v.sqrt().div_(std::sqrt(bc2)).add_(p.eps), -double(p.lr) / bc1);
  write_half(param, param16);
}

void sgd_step(at::Tensor param, const at::Tensor& grad, at::Tensor buf, const kernels::SgdParams& p,
              const at::Tensor& param16) {
  check(param, param, "sgd_step", "param");
  check(grad, param, "sgd_step", "grad");
  if (p.momentum != 0.0f) check(buf, param, "sgd_step", "momentum_buffer");
  const kernels::HalfOut out = half_out(param16, param, "sgd_step");
  if (param.is_cpu()) {
    ok(kernels::sgd_step(param.data_ptr<float>(), grad.data_ptr<float>(),
                         p.momentum != 0.0f ? buf.data_ptr<float>() : nullptr, param.numel(), p, out),
       "sgd_step");
    return;
  }
  at::Tensor g = grad.add(param, p.weight_decay);
  if (p.momentum != 0.0f) {
    if (p.first_step) buf.copy_(g);
    else buf.mul_(p.momentum).add_(g, 1.0 - p.dampening);
    g = p.nesterov ? g.add(buf, p.momentum) : buf;
  }
  param.add_(g, -double(p.lr));
  write_half(param, param16);
}

void adagrad_step(at::Tensor param, const at::Tensor& grad, at::Tensor sum,
                  const kernels::AdagradParams& p, const at::Tensor& param16) {
  check(param, param, "adagrad_step", "param");
  check(grad, param, "adagrad_step", "grad");
  check(sum, param, "adagrad_step", "sum");
  const kernels::HalfOut out = half_out(param16, param, "adagrad_step");
  if (param.is_cpu()) {
    ok(kernels::adagrad_step(param.data_ptr<float>(), grad.data_ptr<float>(), sum.data_ptr<float>(),
                             param.numel(), p, out), "adagrad_step");
    return;
  }
  const double clr = p.lr / (1.0 + double(p.step - 1) * p.lr_decay);
  at::Tensor g = grad.add(param, p.weight_decay);
  sum.addcmul_(g, g, 1.0);
  param.addcdiv_(g, sum.sqrt().add_(p.eps), -clr);
  write_half(param, param16);
}

void lion_step(at::Tensor param, const at::Tensor& grad, at::Tensor m, const kernels::LionParams& p,
               const at::Tensor& param16) {
  check(param, param, "lion_step", "param");
  check(grad, param, "lion_step", "grad");
  check(m, param, "lion_step", "exp_avg");
  const kernels::HalfOut out = half_out(param16, param, "lion_step");
  if (param.is_cpu()) {
    ok(kernels::lion_step(param.data_ptr<float>(), grad.data_ptr<float>(), m.data_ptr<float>(),
                          param.numel(), p, out), "lion_step");
    return;
  }
  at::Tensor c = m.mul(p.beta1).add_(grad, 1.0 - p.beta1);
  param.mul_(1.0 - double(p.lr) * p.weight_decay).add_(c.sign_(), -double(p.lr));
  m.mul_(p.beta2).add_(grad, 1.0 - p.beta2);
  write_half(param, param16);
}

namespace {
// Lamb's update direction in ATen math (tensors other than CPU ones), as the CPU kernel computes it.
at::Tensor lamb_update(const at::Tensor& param, const at::Tensor& m, const at::Tensor& v,
                       const kernels::LambParams& p) {
  const at::Tensor denom = p.eps_inside_sqrt ? v.add(p.eps).sqrt_() : v.sqrt().add_(p.eps);
  return m.div(denom).add_(param, p.weight_decay);
}
}  // namespace

void lamb_moments(const at::Tensor& param, const at::Tensor& grad, at::Tensor m, at::Tensor v,
                  const kernels::LambParams& p, at::Tensor sums) {
  check(param, param, "lamb_moments", "param");
  check(grad, param, "lamb_moments", "grad");
  check(m, param, "lamb_moments", "exp_avg");
  check(v, param, "lamb_moments", "exp_avg_sq");
  if (sums.scalar_type() != at::kDouble || sums.numel() != 2 || !sums.is_contiguous() ||
      sums.device() != param.device()) {
    throw std::invalid_argument("lamb_moments: sums must be 2 contiguous float64 elements on " +
                                param.device().str() + "; got " + describe(sums));
  }
  if (param.is_cpu()) {
    double* s = sums.data_ptr<double>();
    ok(kernels::lamb_moments(param.data_ptr<float>(), grad.data_ptr<float>(), m.data_ptr<float>(),
                             v.data_ptr<float>(), param.numel(), p, &s[0], &s[1]), "lamb_moments");
    return;
  }
  const at::Tensor g = grad.mul(p.grad_scale);
  m.mul_(p.beta1).add_(g, 1.0 - p.beta1);
  v.mul_(p.beta2).addcmul_(g, g, 1.0 - p.beta2);
  sums.narrow(0, 0, 1).add_(param.to(at::kDouble).square().sum());
  sums.narrow(0, 1, 1).add_(lamb_update(param, m, v, p).to(at::kDouble).square().sum());
}

void lamb_apply(at::Tensor param, const at::Tensor& m, const at::Tensor& v,
                const kernels::LambParams& p, float trust_ratio, const at::Tensor& param16) {
  check(param, param, "lamb_apply", "param");
  check(m, param, "lamb_apply", "exp_avg");
  check(v, param, "lamb_apply", "exp_avg_sq");
  const kernels::HalfOut out = half_out(param16, param, "lamb_apply");
  if (param.is_cpu()) {
    ok(kernels::lamb_apply(param.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                           param.numel(), p, trust_ratio, out), "lamb_apply");
    return;
  }
  double step_size = p.lr;
  if (p.bias_correction) {
    step_size = p.lr * std::sqrt(1.0 - std::pow(double(p.beta2), double(p.step))) /
                (1.0 - std::pow(double(p.beta1), double(p.step)));
  }
  param.sub_(lamb_update(param, m, v, p), float(step_size) * trust_ratio);
  write_half(param, param16);
}

kernels::GradStats grad_stats(const at::Tensor& grad) {
  check(grad, grad, "grad_stats", "grad", /*allow_half=*/true);
  kernels::GradStats st;
  if (grad.is_cpu()) {
    const auto k = half_kind(grad);
    if (k == kernels::Half::none) ok(kernels::grad_stats(grad.data_ptr<float>(), grad.numel(), &st), "grad_stats");
    else ok(kernels::grad_stats(reinterpret_cast<const uint16_t*>(grad.data_ptr()), k, grad.numel(), &st), "grad_stats");
    return st;
  }
#ifdef ZEROSHARD_WITH_CUDA
  if (grad.is_cuda()) return cuda_grad_stats(grad);
#endif
  st.sum_sq = grad.to(at::kDouble).square().sum().item<double>();
  st.finite = std::isfinite(st.sum_sq);
  return st;
}

void scale_copy(at::Tensor dst, const at::Tensor& src, double scale) {
  if (dst.numel() != src.numel() || !dst.is_contiguous()) {
    throw std::invalid_argument("scale_copy: dst must be a contiguous tensor with " +
                                std::to_string(src.numel()) + " elements; got " + describe(dst));
  }
  const at::Tensor flat = src.reshape(-1);
  if (dst.is_cpu() && flat.is_cpu() && dst.scalar_type() == at::kFloat &&
      flat.scalar_type() == at::kFloat && flat.is_contiguous()) {
    ok(kernels::scale_copy(flat.data_ptr<float>(), dst.data_ptr<float>(), dst.numel(), float(scale)),
       "scale_copy");
    return;
  }
  at::Tensor out = dst.view(-1);
  if (scale == 1.0) {
    out.copy_(flat);
  } else if (out.scalar_type() == flat.scalar_type()) {
    at::mul_out(out, flat, scale);
  } else if (out.element_size() > flat.element_size()) {
    out.copy_(flat);  // widened first, so the product is rounded once, in dst's type
    scale_(out, scale);
  } else {
    out.copy_(flat * scale);  // the product in the wider source type, rounded once into dst's
  }
}

void scale_(at::Tensor t, double scale) {
  if (scale == 1.0) return;
  // mul.Scalar_out keeps the scalar a double operand; the in-place mul_.Scalar casts it first.
  at::mul_out(t, t, scale);
}

void add_scaled_(at::Tensor dst, const at::Tensor& src, double scale) {
  if (dst.element_size() >= 4) {  // fp32 / fp64: add_ applies alpha in dst's own precision
    dst.add_(src, scale);
    return;
  }
  // In fp32, a slice at a time so the temporaries stay small, rounded once into dst's dtype.
  constexpr int64_t kSliceNumel = int64_t(1) << 20;
  at::Tensor d = dst.view(-1);
  const at::Tensor s = src.reshape(-1);
  for (int64_t at = 0; at < d.numel(); at += kSliceNumel) {
    const int64_t n = std::min(kSliceNumel, d.numel() - at);
    at::Tensor part = d.narrow(0, at, n);
    // copy=true: an fp32 source would otherwise come back as itself and be scaled in place.
    part.copy_(s.narrow(0, at, n).to(at::kFloat, false, true).mul_(scale).add_(part));
  }
}

const char* cpu_isa_name() { return kernels::isa_name(kernels::cpu_isa()); }

}  // namespace zeroshard::ops
