// A step's NVMe reads and writes; see swap_pipeline.h.
#include "zero/swap_pipeline.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>

#include "runtime/error.h"

namespace zeroshard {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}
}  // namespace

SwapPipeline::SwapPipeline(SwapSpace& space) : space_(space) {}

SwapPipeline::~SwapPipeline() {
  for (auto* queue : {&reads_, &writes_}) {
    for (InFlight& f : *queue) {
      try {
        AioEngine::wait(f.io);
      } catch (const Error&) {
        // why: the buffer is free once the engine is done with it, failed or not; the step that
        // issued it is unwinding with its own error.
      }
      space_.release(f.buffer);
    }
    queue->clear();
  }
}

int64_t SwapPipeline::held() const { return int64_t(reads_.size() + writes_.size()) + taken_; }

void SwapPipeline::wait_oldest_write() {
  InFlight f = std::move(writes_.front());
  writes_.pop_front();
  wait_for(f);
  space_.release(f.buffer);
}

void SwapPipeline::wait_for(InFlight& f) {
  const auto t = Clock::now();
  try {
    AioEngine::wait(f.io);
  } catch (...) {
    space_.release(f.buffer);  // why: the engine is done with it, failed or not
    throw;
  }
  wait_ms_ += ms_since(t);
}

void SwapPipeline::prefetch(SwappedPart& part, int64_t begin) {
  if (!space_.pipeline_read() || !reads_.empty()) return;
  // A buffer for the read ahead: an older write may be waited for, never the one being updated.
  while (held() >= space_.buffer_count() && !writes_.empty()) wait_oldest_write();
  if (held() >= space_.buffer_count()) return;
  InFlight f{&part, begin, space_.acquire(part.max_region_bytes()), {}};
  f.io = part.read(begin, f.buffer);
  reads_.push_back(std::move(f));
}

at::Tensor SwapPipeline::take(SwappedPart& part, int64_t begin, double init) {
  InFlight f;
  if (!reads_.empty() && reads_.front().part == &part && reads_.front().begin == begin) {
    f = std::move(reads_.front());
    reads_.pop_front();
  } else {
    ZS_CHECK(reads_.empty(), "SwapPipeline::take: sub-group ", begin, " is not the one prefetched");
    while (held() >= space_.buffer_count() && !writes_.empty()) wait_oldest_write();
    f = InFlight{&part, begin, space_.acquire(part.max_region_bytes()), {}};
    f.io = part.read(begin, f.buffer);
  }
  wait_for(f);
  ++taken_;
  if (!part.has_state(begin)) {
    // Never written with state (the first step, or the state was dropped): torch.optim's start.
    for (size_t s = 0; s < part.slots(); ++s) part.view(f.buffer, begin, int64_t(s)).fill_(init);
  }
  return f.buffer;
}

void SwapPipeline::put(SwappedPart& part, int64_t begin, const at::Tensor& buffer) {
  --taken_;
  InFlight f{&part, begin, buffer, part.write(begin, buffer, true)};
  writes_.push_back(std::move(f));
  if (!space_.pipeline_write()) wait_oldest_write();
}

void SwapPipeline::finish() {
  while (!writes_.empty()) wait_oldest_write();
  ZS_CHECK(reads_.empty() && taken_ == 0, "SwapPipeline::finish: ", reads_.size(), " reads and ", taken_,
           " sub-groups not written back");
}

}  // namespace zeroshard
