// CUDA implementations of kernels/cuda_kernels.h: multi-tensor fused Adam with 16-bit parameter
// write-back, sum of squares, scale/unscale with inf/nan detection, casts, flatten/unflatten.
// The arithmetic mirrors the CPU reference (kernels/cpu/optimizers_scalar.cpp).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "kernels/cuda_kernels.h"

namespace zeroshard::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = 65536;      // elements per block in the multi-tensor launch
constexpr int kMaxTensors = 24;        // keeps the by-value table under the 4 KiB argument limit
constexpr int kMaxBlocks = 320;

// 16-bit values travel as raw bits so that the kernels have one signature per format.
template <int K> __device__ __forceinline__ float to_f32(const void* base, int64_t i);
template <> __device__ __forceinline__ float to_f32<0>(const void* b, int64_t i) {
  return static_cast<const float*>(b)[i];
}
template <> __device__ __forceinline__ float to_f32<1>(const void* b, int64_t i) {
  return __bfloat162float(__ushort_as_bfloat16(static_cast<const unsigned short*>(b)[i]));
}
template <> __device__ __forceinline__ float to_f32<2>(const void* b, int64_t i) {
  return __half2float(__ushort_as_half(static_cast<const unsigned short*>(b)[i]));
}
template <int K> __device__ __forceinline__ void from_f32(void* base, int64_t i, float x);
template <> __device__ __forceinline__ void from_f32<0>(void* b, int64_t i, float x) {
  static_cast<float*>(b)[i] = x;
}
template <> __device__ __forceinline__ void from_f32<1>(void* b, int64_t i, float x) {
  static_cast<unsigned short*>(b)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
}
template <> __device__ __forceinline__ void from_f32<2>(void* b, int64_t i, float x) {
  static_cast<unsigned short*>(b)[i] = __half_as_ushort(__float2half_rn(x));
}

struct AdamConstsDev {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay, step_size, bc2_sqrt,
      decay, grad_scale;
  bool adamw;
};

struct AdamLaunch {
  AdamTensor tensors[kMaxTensors];
  unsigned char tensor_of_block[kMaxBlocks];
  int chunk_of_block[kMaxBlocks];
};

// G: gradient format, O: 16-bit copy format (0 = none); 0 fp32, 1 bf16, 2 fp16.
template <int G, int O>
__global__ void adam_kernel(const AdamLaunch launch, const AdamConstsDev c) {
  const AdamTensor& t = launch.tensors[launch.tensor_of_block[blockIdx.x]];
  const int64_t begin = int64_t(launch.chunk_of_block[blockIdx.x]) * kChunk;
  const int64_t end = begin + kChunk < t.n ? begin + kChunk : t.n;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float g = to_f32<G>(t.grad, i) * c.grad_scale;
    float w = t.param[i];
    if (c.adamw) w *= c.decay;
    else g += c.weight_decay * w;
    const float m = c.beta1 * t.exp_avg[i] + c.one_minus_beta1 * g;
    const float v = c.beta2 * t.exp_avg_sq[i] + c.one_minus_beta2 * g * g;
    const float denom = sqrtf(v) / c.bc2_sqrt + c.eps;
    w = w - c.step_size * (m / denom);
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    t.param[i] = w;
    if constexpr (O != 0) from_f32<O>(t.param16, i, w);
  }
}

int code(Half k) { return k == Half::bf16 ? 1 : k == Half::fp16 ? 2 : 0; }

template <int G>
void launch_adam_o(int o, int blocks, const AdamLaunch& l, const AdamConstsDev& c, cudaStream_t s) {
  if (o == 1) adam_kernel<G, 1><<<blocks, kThreads, 0, s>>>(l, c);
  else if (o == 2) adam_kernel<G, 2><<<blocks, kThreads, 0, s>>>(l, c);
  else adam_kernel<G, 0><<<blocks, kThreads, 0, s>>>(l, c);
}
void launch_adam(int g, int o, int blocks, const AdamLaunch& l, const AdamConstsDev& c,
                 cudaStream_t s) {
  if (g == 1) launch_adam_o<1>(o, blocks, l, c, s);
  else if (g == 2) launch_adam_o<2>(o, blocks, l, c, s);
  else launch_adam_o<0>(o, blocks, l, c, s);
}

// Block-wide sum in double; every thread gets the result's contribution only via thread 0.
__device__ double block_sum(double x) {
  __shared__ double warp_sums[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = x;
  __syncthreads();
  x = threadIdx.x < kThreads / 32 ? warp_sums[threadIdx.x] : 0.0;
  if (threadIdx.x < 32)
    for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
  return x;
}

template <int K>
__global__ void sum_squares_kernel(const void* data, int64_t n, double* out) {
  double s = 0.0;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const double x = to_f32<K>(data, i);
    s += x * x;
  }
  s = block_sum(s);
  if (threadIdx.x == 0) atomicAdd(out, s);
}

template <int K>
__global__ void scale_kernel(void* data, int64_t n, float factor, float* found_inf) {
  bool bad = false;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = to_f32<K>(data, i);
    bad |= !isfinite(x);
    from_f32<K>(data, i, x * factor);
  }
  if (found_inf != nullptr && bad) *found_inf = 1.0f;   // benign race: every writer writes 1
}

template <int S, int D>
__global__ void cast_kernel(const void* src, void* dst, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    from_f32<D>(dst, i, to_f32<S>(src, i));
}

int grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return int(blocks < 4096 ? (blocks < 1 ? 1 : blocks) : 4096);   // grid-stride beyond this
}

}  // namespace

cudaError_t multi_tensor_adam(const AdamTensor* tensors, int count, Half grad_kind,
                              Half param16_kind, const AdamParams& p, cudaStream_t stream) {
  if (count < 0 || (count > 0 && tensors == nullptr) || p.step < 1) return cudaErrorInvalidValue;
  const double bc1 = p.bias_correction ? 1.0 - std::pow(double(p.beta1), double(p.step)) : 1.0;
  const double bc2 = p.bias_correction ? 1.0 - std::pow(double(p.beta2), double(p.step)) : 1.0;
  const AdamConstsDev c{p.beta1, p.beta2, 1.0f - p.beta1, 1.0f - p.beta2, p.eps, p.weight_decay,
                        float(double(p.lr) / bc1), float(std::sqrt(bc2)),
                        1.0f - p.lr * p.weight_decay, p.grad_scale, p.adamw_mode};
  const int g = code(grad_kind), o = code(param16_kind);
  // Pack (tensor, chunk) pairs into launches of at most kMaxTensors tensors / kMaxBlocks blocks.
  AdamLaunch l{};
  int nt = 0, nb = 0;
  auto flush = [&]() -> cudaError_t {
    if (nb > 0) {
      launch_adam(g, o, nb, l, c, stream);
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
    }
    nt = 0;
    nb = 0;
    return cudaSuccess;
  };
  for (int i = 0; i < count; ++i) {
    const AdamTensor& t = tensors[i];
    if (t.n <= 0) continue;
    if (nt == kMaxTensors) if (cudaError_t e = flush(); e != cudaSuccess) return e;
    l.tensors[nt] = t;
    const int64_t chunks = (t.n + kChunk - 1) / kChunk;
    for (int64_t ch = 0; ch < chunks; ++ch) {
      if (nb == kMaxBlocks) {
        if (cudaError_t e = flush(); e != cudaSuccess) return e;
        l.tensors[0] = t;   // the tensor continues in the next launch
      }
      l.tensor_of_block[nb] = static_cast<unsigned char>(nt);
      l.chunk_of_block[nb] = int(ch);
      ++nb;
    }
    ++nt;
  }
  return flush();
}

cudaError_t sum_squares(const void* data, Half kind, int64_t n, double* out, cudaStream_t s) {
  if (n < 0 || out == nullptr || (n > 0 && data == nullptr)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int grid = grid_for(n);
  switch (code(kind)) {
    case 1: sum_squares_kernel<1><<<grid, kThreads, 0, s>>>(data, n, out); break;
    case 2: sum_squares_kernel<2><<<grid, kThreads, 0, s>>>(data, n, out); break;
    default: sum_squares_kernel<0><<<grid, kThreads, 0, s>>>(data, n, out); break;
  }
  return cudaGetLastError();
}

cudaError_t scale(void* data, Half kind, int64_t n, float factor, float* found_inf, cudaStream_t s) {
  if (n < 0 || (n > 0 && data == nullptr)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int grid = grid_for(n);
  switch (code(kind)) {
    case 1: scale_kernel<1><<<grid, kThreads, 0, s>>>(data, n, factor, found_inf); break;
    case 2: scale_kernel<2><<<grid, kThreads, 0, s>>>(data, n, factor, found_inf); break;
    default: scale_kernel<0><<<grid, kThreads, 0, s>>>(data, n, factor, found_inf); break;
  }
  return cudaGetLastError();
}

cudaError_t cast(const void* src, Half sk, void* dst, Half dk, int64_t n, cudaStream_t s) {
  if (n < 0 || (n > 0 && (src == nullptr || dst == nullptr))) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int grid = grid_for(n), a = code(sk), b = code(dk);
#define ZS_CAST(S, D) \
  if (a == S && b == D) cast_kernel<S, D><<<grid, kThreads, 0, s>>>(src, dst, n);
  ZS_CAST(0, 0) ZS_CAST(0, 1) ZS_CAST(0, 2) ZS_CAST(1, 0) ZS_CAST(1, 1) ZS_CAST(1, 2)
  ZS_CAST(2, 0) ZS_CAST(2, 1) ZS_CAST(2, 2)
#undef ZS_CAST
  return cudaGetLastError();
}

// Device-to-device copies run on the copy engines at full bandwidth for the large tensors that
// ZeRO flattens; a gather kernel would only pay off for thousands of tiny tensors.
cudaError_t flatten(const void* const* srcs, const int64_t* numels, int count, size_t elem_bytes,
                    void* dst, cudaStream_t s) {
  auto* out = static_cast<unsigned char*>(dst);
  for (int i = 0; i < count; ++i) {
    const size_t bytes = size_t(numels[i]) * elem_bytes;
    if (bytes == 0) continue;
    if (cudaError_t e = cudaMemcpyAsync(out, srcs[i], bytes, cudaMemcpyDeviceToDevice, s); e != cudaSuccess)
      return e;
    out += bytes;
  }
  return cudaSuccess;
}

cudaError_t unflatten(const void* src, void* const* dsts, const int64_t* numels, int count,
                      size_t elem_bytes, cudaStream_t s) {
  auto* in = static_cast<const unsigned char*>(src);
  for (int i = 0; i < count; ++i) {
    const size_t bytes = size_t(numels[i]) * elem_bytes;
    if (bytes == 0) continue;
    if (cudaError_t e = cudaMemcpyAsync(dsts[i], in, bytes, cudaMemcpyDeviceToDevice, s); e != cudaSuccess)
      return e;
    in += bytes;
  }
  return cudaSuccess;
}

}  // namespace zeroshard::kernels::cuda
