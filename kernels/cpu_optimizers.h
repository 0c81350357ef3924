// CPU optimizer kernels over flat fp32 shards: raw pointers and sizes, no Torch. Each update
// follows torch.optim's arithmetic for the same optimizer so parity tests can compare directly.
// Every entry point picks the best SIMD path for this CPU at run time (see cpu_isa.h) and splits
// the work across OpenMP threads.
#pragma once
#include <cstdint>

namespace zeroshard::kernels {

enum class Status : int { ok = 0, invalid_argument = 1, unsupported = 2 };

// 16-bit float formats; values travel as raw uint16_t bits. Conversions round to nearest even.
enum class Half : int { none = 0, bf16 = 1, fp16 = 2 };

// Optional 16-bit copy of the updated parameters, written in the same pass as the fp32 update.
struct HalfOut {
  uint16_t* data = nullptr;     // n elements, or null for no copy
  Half kind = Half::none;
};

struct AdamParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adamw_mode = true;       // decoupled weight decay (AdamW) vs L2 added to the gradient (Adam)
  bool bias_correction = true;
  int64_t step = 1;             // 1-based count of applied steps, this one included
  // Multiplies every gradient element before use: 1/loss_scale times the clipping coefficient,
  // so unscaling and clipping cost no extra pass.
  float grad_scale = 1.0f;
};

struct SgdParams {
  float lr = 1e-3f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  bool first_step = true;       // torch seeds the momentum buffer with the gradient itself
};

struct AdagradParams {
  float lr = 1e-2f;
  float lr_decay = 0.0f;
  float eps = 1e-10f;
  float weight_decay = 0.0f;
  int64_t step = 1;
};

struct LionParams {
  float lr = 1e-4f;
  float beta1 = 0.9f;
  float beta2 = 0.99f;
  float weight_decay = 0.0f;
};

// DeepSpeed's FusedLamb: Adam's moments, then a per-tensor trust ratio ||w|| / ||update||
// (clamped to [min_coeff, max_coeff]; 1 when either norm is 0) scales the step. The norms are of
// the whole tensor, so a sharded tensor's pieces are summed across ranks between the two phases.
struct LambParams {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool bias_correction = true;
  bool eps_inside_sqrt = false;  // sqrt(v + eps) instead of sqrt(v) + eps
  float max_coeff = 10.0f;
  float min_coeff = 0.01f;
  int64_t step = 1;
  float grad_scale = 1.0f;       // as AdamParams::grad_scale
};

struct GradStats;

// grad is read only; param and the state arrays are updated in place. n may be 0.
// stats, when not null, receives grad_stats() of the gradient as read (before p.grad_scale),
// computed in the same pass: a norm that is only reported costs no second read of the gradient.
Status adam_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                 const AdamParams& p, HalfOut param16 = {}, GradStats* stats = nullptr);
// The fused offload step: 16-bit gradients (grad_kind bf16 or fp16) are widened, scaled by
// p.grad_scale, and applied in one pass that also writes the 16-bit parameter copy.
Status adam_step(float* param, const uint16_t* grad, Half grad_kind, float* exp_avg,
                 float* exp_avg_sq, int64_t n, const AdamParams& p, HalfOut param16 = {},
                 GradStats* stats = nullptr);
// momentum_buffer may be null when momentum == 0.
Status sgd_step(float* param, const float* grad, float* momentum_buffer, int64_t n,
                const SgdParams& p, HalfOut param16 = {});
Status adagrad_step(float* param, const float* grad, float* sum, int64_t n, const AdagradParams& p,
                    HalfOut param16 = {});
Status lion_step(float* param, const float* grad, float* exp_avg, int64_t n, const LionParams& p,
                 HalfOut param16 = {});

// Lamb's first phase: updates the moments from the gradient and adds this piece's sum of
// squares of the parameters (before the update) to *w_sq and of the update direction to *u_sq.
Status lamb_moments(const float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                    int64_t n, const LambParams& p, double* w_sq, double* u_sq);
// The trust ratio of a whole tensor from its global sums of squares.
float lamb_trust_ratio(double w_sq, double u_sq, const LambParams& p);
// Lamb's second phase: param -= step_size * trust_ratio * update, with the moments as left by
// lamb_moments.
Status lamb_apply(float* param, const float* exp_avg, const float* exp_avg_sq, int64_t n,
                  const LambParams& p, float trust_ratio, HalfOut param16 = {});

// One read of the gradients: the sum of squares (accumulated in double) for the global norm, and
// whether every element is finite (for the loss scaler). Squares of finite fp32 values cannot
// overflow a double sum, so finite == std::isfinite(sum_sq).
struct GradStats {
  double sum_sq = 0.0;
  bool finite = true;
};
Status grad_stats(const float* grad, int64_t n, GradStats* out);
Status grad_stats(const uint16_t* grad, Half kind, int64_t n, GradStats* out);

// Casts between fp32 and a 16-bit format (round to nearest even; NaN stays NaN).
Status cast_to_half(const float* src, uint16_t* dst, Half kind, int64_t n);
Status cast_from_half(const uint16_t* src, Half kind, float* dst, int64_t n);
// dst = src * scale, fp32, in one pass (scale 1 is a plain copy). From 1 MiB on, dst is written
// with non-temporal stores, so its lines are not read first: a gradient copied into a flat buffer
// costs one read and one write. src and dst must not overlap unless they are the same array.
Status scale_copy(const float* src, float* dst, int64_t n, float scale);
uint16_t float_to_half_bits(float x, Half kind);
float half_bits_to_float(uint16_t h, Half kind);

const char* status_message(Status s);

}  // namespace zeroshard::kernels
