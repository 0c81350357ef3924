// Host staging memory for offload: one pool of flat host buffers, reused by size, pinned when the
// run's device is a CUDA device and pin_memory asks for it (page-locked memory is what lets a
// copy to or from the device run asynchronously). Every byte the pool holds, in use or free, is
// accounted as host_buffers.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <vector>

#include "runtime/memory.h"

namespace zeroshard {

class HostPool {
 public:
  // `device`: the run's compute device; pinning is asked of its accelerator, and a CPU-only run
  // has nothing to pin for (pinned() is then false whatever pin_memory says).
  HostPool(bool pin_memory, c10::Device device, MemoryAccount& memory);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  // A flat host tensor of `numel` elements of `dtype`: a free buffer of the same byte size when
  // the pool has one, else a new one. Its contents are undefined.
  at::Tensor acquire(int64_t numel, at::ScalarType dtype);
  // Gives back a tensor acquire() returned (or a view of one's whole storage); the caller has
  // made sure no copy still reads or writes it.
  void release(const at::Tensor& buffer);
  bool pinned() const { return pinned_; }
  int64_t held_bytes() const { return held_bytes_; }
  // Host tensors that are not pooled (offloaded master weights and optimizer state), pinned
  // like the pool's when pinning is on, zero-filled.
  at::Tensor allocate_zeros(int64_t numel, at::ScalarType dtype) const;

 private:
  at::Tensor allocate(int64_t bytes) const;

  bool pinned_;
  MemoryAccount& memory_;
  std::multimap<int64_t, at::Tensor> free_;  // bytes -> uint8 buffer
  int64_t held_bytes_ = 0;
};

}  // namespace zeroshard
