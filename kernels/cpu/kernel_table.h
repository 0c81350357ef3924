// Internal seam between the dispatcher (dispatch.cpp: argument checks, OpenMP split) and the
// per-ISA kernels (optimizers_{scalar,avx2,avx512}.cpp), which each fill one table of functions
// that work on a single contiguous chunk on the calling thread.
#pragma once
#include <cstdint>

#include "kernels/cpu_optimizers.h"

namespace zeroshard::kernels::detail {

// A gradient in fp32 (kind == Half::none) or a 16-bit format.
struct GradRef {
  const void* data = nullptr;
  Half kind = Half::none;
};

// Per-step scalars, computed once by the dispatcher so every ISA sees identical values.
struct AdamConsts {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  float step_size;      // lr / (1 - beta1^step)
  float bc2_sqrt;       // sqrt(1 - beta2^step)
  float decay;          // 1 - lr * weight_decay (AdamW)
  float grad_scale;
  bool adamw;
  bool sum_sq;          // also accumulate the sum of squares of the gradient as read
};
struct SgdConsts {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov, first_step, has_momentum;
};
struct AdagradConsts {
  float clr, eps, weight_decay;   // clr = lr / (1 + (step - 1) * lr_decay)
};
struct LionConsts {
  float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay;
};

struct KernelTable {
  // Returns the gradient's sum of squares (before grad_scale) when c.sum_sq, else 0.
  double (*adam)(float* p, GradRef g, float* m, float* v, int64_t n, const AdamConsts& c, HalfOut o);
  void (*sgd)(float* p, const float* g, float* buf, int64_t n, const SgdConsts& c, HalfOut o);
  void (*adagrad)(float* p, const float* g, float* sum, int64_t n, const AdagradConsts& c,
                  HalfOut o);
  void (*lion)(float* p, const float* g, float* m, int64_t n, const LionConsts& c, HalfOut o);
  double (*sum_sq)(GradRef g, int64_t n);
  void (*cast_to_half)(const float* src, uint16_t* dst, Half kind, int64_t n);
  void (*cast_from_half)(const uint16_t* src, Half kind, float* dst, int64_t n);
  // dst = src * scale; stream: non-temporal stores where the ISA has them.
  void (*scale_copy)(const float* src, float* dst, int64_t n, float scale, bool stream);
};

// The scalar table is the reference the SIMD tables are tested against. The SIMD getters return
// null when that ISA was not compiled in (non-x86 builds).
const KernelTable& scalar_table();
const KernelTable* avx2_table();
const KernelTable* avx512_table();

}  // namespace zeroshard::kernels::detail
