// CUDA kernels for the optimizer step and mixed-precision plumbing: raw device pointers, sizes
// and a stream; no Torch. Each returns the launch's cudaError_t. Formats: Half::none means fp32,
// bf16 / fp16 are 16-bit. CPU references: kernels/cpu_optimizers.h (same arithmetic).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu_optimizers.h"

namespace zeroshard::kernels::cuda {

// One tensor of a multi-tensor Adam launch; all pointers are device pointers.
struct AdamTensor {
  float* param = nullptr;
  const void* grad = nullptr;      // format grad_kind
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* param16 = nullptr;         // format param16_kind; null for no copy
  int64_t n = 0;
};

// Fused Adam/AdamW over many tensors in few launches (the tensor table travels in the kernel
// arguments, so no host-to-device copy is needed). p.grad_scale folds in unscale and clipping.
cudaError_t multi_tensor_adam(const AdamTensor* tensors, int count, Half grad_kind,
                              Half param16_kind, const AdamParams& p, cudaStream_t stream);

// Adds the sum of squares of data to *sum_sq_device (double, device memory; zero it first).
// inf/nan anywhere makes the sum non-finite, which is the loss scaler's overflow signal.
cudaError_t sum_squares(const void* data, Half kind, int64_t n, double* sum_sq_device,
                        cudaStream_t stream);

// data *= factor in place (unscale with 1/loss_scale, or clip). If found_inf_device is not null,
// it is set to 1.0f when any element is inf/nan (never reset to 0 here).
cudaError_t scale(void* data, Half kind, int64_t n, float factor, float* found_inf_device,
                  cudaStream_t stream);

// dst = src converted (round to nearest even), any pair of fp32 / bf16 / fp16.
cudaError_t cast(const void* src, Half src_kind, void* dst, Half dst_kind, int64_t n,
                 cudaStream_t stream);

// Gather count device buffers (numels[i] elements of elem_bytes each; host arrays of device
// pointers) back to back into dst, and the inverse.
cudaError_t flatten(const void* const* srcs, const int64_t* numels, int count, size_t elem_bytes,
                    void* dst, cudaStream_t stream);
cudaError_t unflatten(const void* src, void* const* dsts, const int64_t* numels, int count,
                      size_t elem_bytes, cudaStream_t stream);

}  // namespace zeroshard::kernels::cuda
