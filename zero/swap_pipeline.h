// The optimizer steps' NVMe traffic: each NVMe sub-group is read into a staging buffer, updated
// there by the host kernel, and written back. With offload_optimizer.pipeline_read the next
// sub-group's read runs while the current one updates; the write of an updated one is never
// waited for in the step (pipeline_write) or waited for at once (without it, as DeepSpeed's
// default). A written buffer is kept while staging buffers are free (at most buffer_count in all):
// it still holds the sub-group, so the next step, which goes through the sub-groups in the
// opposite order, updates the ones written last without reading them, and their writes run on
// behind the next forward and backward. The one object that holds buffers across steps.
#pragma once
#include <ATen/core/Tensor.h>

#include <deque>

#include "zero/swap_space.h"

namespace zeroshard {

class SwapPipeline {
 public:
  explicit SwapPipeline(SwapSpace& space);
  // Waits for the writes of the buffers it holds (their errors are not reported: the run is
  // ending) and gives the buffers back. The parts it staged must still exist.
  ~SwapPipeline();
  SwapPipeline(const SwapPipeline&) = delete;
  SwapPipeline& operator=(const SwapPipeline&) = delete;

  // A step starts: the wait time counts from zero. (Buffers kept from the last step stay.)
  void begin_step();
  // The sub-group of `part` that starts at `begin` will be taken next: its read starts now when
  // pipeline_read allows, it is not held already, and a buffer is free (else take() reads it).
  void prefetch(SwappedPart& part, int64_t begin);
  // The sub-group's staging buffer, holding its master and state (a state never written holds
  // its initial value `init`): kept from the last step, prefetched, or read now.
  at::Tensor take(SwappedPart& part, int64_t begin, double init);
  // Writes the updated sub-group back from `buffer` (take()'s) and keeps the buffer while the
  // count allows.
  void put(SwappedPart& part, int64_t begin, const at::Tensor& buffer);
  // The step's end: every buffer is back (checked).
  void end_step();
  // The step failed part-way: reads in flight are waited for (their errors dropped) and their
  // buffers and those take() handed out are given back; buffers kept from put() stay.
  void abandon();
  // Milliseconds this step spent waiting for reads and writes.
  double wait_ms() const { return wait_ms_; }

 private:
  struct Held {
    SwappedPart* part = nullptr;
    int64_t begin = 0;
    at::Tensor buffer;
    AioEngine::Handle read;  // prefetched: the read in flight
    int64_t generation = 0;  // kept: the part's generation when it was written
  };
  int64_t held() const;
  // Frees a buffer by giving back the oldest kept one (its write waited for); false if none.
  bool evict_one();
  void wait(const AioEngine::Handle& h);
  void settle(SwappedPart& part, int64_t begin);

  SwapSpace& space_;
  std::deque<Held> reads_;  // at most one: the prefetched sub-group
  std::deque<Held> kept_;   // written back, oldest first
  std::deque<at::Tensor> taken_;  // buffers take() handed out and put() has not had back
  double wait_ms_ = 0.0;
};

}  // namespace zeroshard
