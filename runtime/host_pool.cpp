// The host staging pool; see host_pool.h.
#include "runtime/host_pool.h"

#include <ATen/ATen.h>

#include "runtime/error.h"

namespace zeroshard {

HostPool::HostPool(bool pin_memory, c10::Device device, MemoryAccount& memory)
    : pinned_(pin_memory && device.is_cuda()), memory_(memory) {}

HostPool::~HostPool() { memory_.release(MemoryCategory::host_buffers, held_bytes_); }

at::Tensor HostPool::allocate(int64_t bytes) const {
  return at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(pinned_));
}

at::Tensor HostPool::acquire(int64_t numel, at::ScalarType dtype) {
  const int64_t bytes = numel * int64_t(c10::elementSize(dtype));
  at::Tensor raw;
  const auto it = free_.find(bytes);
  if (it != free_.end()) {
    raw = std::move(it->second);
    free_.erase(it);
  } else {
    raw = allocate(bytes);
    held_bytes_ += bytes;
    memory_.add(MemoryCategory::host_buffers, bytes);
  }
  return raw.view(dtype);
}

void HostPool::release(const at::Tensor& buffer) {
  ZS_CHECK(buffer.defined() && buffer.is_cpu() && buffer.is_contiguous(),
           "HostPool::release: not a pool buffer");
  const int64_t bytes = buffer.numel() * int64_t(buffer.element_size());
  free_.emplace(bytes, buffer.view(at::kByte));
}

at::Tensor HostPool::allocate_zeros(int64_t numel, at::ScalarType dtype) const {
  return at::zeros({numel}, at::TensorOptions().dtype(dtype).pinned_memory(pinned_));
}

}  // namespace zeroshard
