// Asynchronous copies between device and host memory for offload. On a CUDA device they run on
// a stream of their own and completion is an event: the compute stream and the host each wait
// for exactly the copy they need, never for the whole device. On a CPU device the copy is done
// when copy() returns (the same calls, so a CPU-only run goes through every step of the pipeline).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <functional>
#include <memory>
#include <optional>

namespace zeroshard {

// A copy's completion; null when it is complete already.
using CopyFence = std::shared_ptr<c10::Event>;

class CopyStream {
 public:
  explicit CopyStream(c10::Device device);

  // dst <- src (equal numel, both contiguous), after the work queued on the device's current
  // stream so far: the values src holds once that work is done are the ones copied.
  CopyFence copy(at::Tensor dst, const at::Tensor& src);
  // A fence for the work queued on the device's current (compute) stream so far; null on a CPU
  // device, where that work is done already.
  CopyFence mark_compute() const;
  // The host blocks until the copy is done: before the CPU reads a buffer copied down, or a
  // buffer a copy reads or writes is used for something else.
  static void wait_host(const CopyFence& fence);
  // The device's current stream waits for it (the host does not): before compute reads values
  // copied up.
  void wait_device(const CopyFence& fence) const;
  // Runs `issue` with the copy stream as the device's current stream (on a CPU device it just
  // runs it), after the compute stream's work queued so far: the copies it makes and the
  // collectives it starts then overlap the compute queued after them, and may write buffers the
  // caching allocator handed back from the compute stream (earlier kernels may still read them).
  void on_copy_stream(const std::function<void()>& issue) const;
  // A tensor allocated inside on_copy_stream and read by a collective there: its memory is not
  // reused before the compute stream reaches this point (call it after the compute stream has
  // waited for that collective). Nothing on a CPU device.
  void keep_for_compute(const at::Tensor& t) const;

 private:
  c10::Device device_;
  std::optional<c10::Stream> side_;  // CUDA (any accelerator): the copies' stream
};

}  // namespace zeroshard
