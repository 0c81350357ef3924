// The only place where tensors become raw pointers for the kernels. Callers pass flat tensors of
// equal length: fp32 parameters and optimizer state; gradients in fp32, or (Adam, the fused
// offload step) bf16 / fp16; optionally a bf16 / fp16 tensor that receives the updated
// parameters in the same pass. CPU tensors run the SIMD CPU kernels, CUDA tensors the CUDA
// kernels when built with them, anything else ATen math with the same arithmetic.
#pragma once
#include <ATen/core/Tensor.h>

#include "kernels/cpu_optimizers.h"

namespace zeroshard::ops {

// param16: undefined for none, else a contiguous bf16/fp16 tensor of param.numel() elements.
// stats, when not null, receives grad_stats(grad) (on CPU from the same pass as the update).
void adam_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
               const kernels::AdamParams& p, const at::Tensor& param16 = {},
               kernels::GradStats* stats = nullptr);
void sgd_step(at::Tensor param, const at::Tensor& grad, at::Tensor momentum_buffer,
              const kernels::SgdParams& p, const at::Tensor& param16 = {});
void adagrad_step(at::Tensor param, const at::Tensor& grad, at::Tensor sum,
                  const kernels::AdagradParams& p, const at::Tensor& param16 = {});
void lion_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg,
               const kernels::LionParams& p, const at::Tensor& param16 = {});

// Lamb's two phases (kernels/cpu_optimizers.h): lamb_moments updates the moments and adds the
// piece's sums of squares of the parameters and of the update to sums[0] and sums[1] (a float64
// tensor on the parameters' device, so a GPU step does not wait for each tensor); lamb_apply
// steps with the whole tensor's trust ratio (kernels::lamb_trust_ratio).
void lamb_moments(const at::Tensor& param, const at::Tensor& grad, at::Tensor exp_avg,
                  at::Tensor exp_avg_sq, const kernels::LambParams& p, at::Tensor sums);
void lamb_apply(at::Tensor param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                const kernels::LambParams& p, float trust_ratio, const at::Tensor& param16 = {});

// One read of a gradient (fp32, bf16 or fp16): sum of squares in double and whether all finite.
kernels::GradStats grad_stats(const at::Tensor& grad);

// dst = src * scale (scale 1: a copy) for tensors of equal numel; dst contiguous. fp32 CPU tensors
// use the streaming kernel (kernels::scale_copy), anything else ATen, computing in the wider of
// the two dtypes and rounding once into dst's.
void scale_copy(at::Tensor dst, const at::Tensor& src, double scale);

// t *= scale, and dst += src * scale, with the scale at full precision. ATen's Tensor::mul_(Scalar)
// and add_'s alpha round a double to a 16-bit tensor's dtype first (1/3 becomes 0.33398 in bf16,
// a 0.2% bias in a mean over 3 ranks); these keep it a double and compute in fp32 at least.
void scale_(at::Tensor t, double scale);
void add_scaled_(at::Tensor dst, const at::Tensor& src, double scale);

// Name of the CPU ISA the kernels use now ("avx512", "avx2", "scalar").
const char* cpu_isa_name();

}  // namespace zeroshard::ops
