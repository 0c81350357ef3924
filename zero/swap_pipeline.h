// One optimizer step's NVMe traffic: each NVMe sub-group is read into a staging buffer, updated
// there by the host kernel, and written back. With offload_optimizer.pipeline_read the next
// sub-group's read runs while the current one updates; with pipeline_write its write runs while
// the following ones update; at most buffer_count staging buffers are held at once (the oldest
// write is waited for when another is needed). Without them each read and write is waited for
// where it is issued, as DeepSpeed's defaults do.
#pragma once
#include <ATen/core/Tensor.h>

#include <deque>
#include <vector>

#include "zero/swap_space.h"

namespace zeroshard {

class SwapPipeline {
 public:
  explicit SwapPipeline(SwapSpace& space);
  // Waits for every read and write still in flight (errors then are not reported: the step
  // that owns them is already failing) and gives their buffers back.
  ~SwapPipeline();
  SwapPipeline(const SwapPipeline&) = delete;
  SwapPipeline& operator=(const SwapPipeline&) = delete;

  // The sub-group of `part` that starts at `begin` will be taken next: its read starts now when
  // pipeline_read allows and a buffer is free (else take() reads it).
  void prefetch(SwappedPart& part, int64_t begin);
  // The sub-group's staging buffer, read (master, and state where it was written before; the
  // state views of one that has none hold its initial value `init`).
  at::Tensor take(SwappedPart& part, int64_t begin, double init);
  // Writes the updated sub-group back from `buffer` (take()'s), which goes back to the space once
  // written.
  void put(SwappedPart& part, int64_t begin, const at::Tensor& buffer);
  // Waits for every write (the step's end): an IoError of any is raised here.
  void finish();
  // Milliseconds this step spent waiting for reads and writes.
  double wait_ms() const { return wait_ms_; }

 private:
  struct InFlight {
    SwappedPart* part = nullptr;
    int64_t begin = 0;
    at::Tensor buffer;
    AioEngine::Handle io;
  };
  int64_t held() const;
  void wait_oldest_write();
  // Waits for f's request; on its error gives f's buffer back before raising.
  void wait_for(InFlight& f);

  SwapSpace& space_;
  int64_t buffer_bytes_ = 0;
  std::deque<InFlight> reads_;   // at most one: the prefetched sub-group
  std::deque<InFlight> writes_;
  int64_t taken_ = 0;            // buffers take() handed out and put() has not had back
  double wait_ms_ = 0.0;
};

}  // namespace zeroshard
