// The optimizer steps' NVMe reads and writes; see swap_pipeline.h.
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
  for (auto* queue : {&reads_, &kept_}) {
    for (Held& h : *queue) {
      try {
        // why: the engine reads or writes the buffer until then
        if (h.read) AioEngine::wait(h.read);
        h.part->settle(h.begin);
      } catch (const Error&) {
        // The run is ending; a failed write's state is gone with it.
      }
      space_.release(h.buffer);
    }
    queue->clear();
  }
}

void SwapPipeline::begin_step() { wait_ms_ = 0.0; }

int64_t SwapPipeline::held() const { return int64_t(reads_.size() + kept_.size()) + taken_; }

void SwapPipeline::wait(const AioEngine::Handle& h) {
  const auto t = Clock::now();
  AioEngine::wait(h);
  wait_ms_ += ms_since(t);
}

void SwapPipeline::settle(SwappedPart& part, int64_t begin) {
  const auto t = Clock::now();
  part.settle(begin);
  wait_ms_ += ms_since(t);
}

bool SwapPipeline::evict_one() {
  if (kept_.empty()) return false;
  Held h = std::move(kept_.front());
  kept_.pop_front();
  try {
    settle(*h.part, h.begin);
  } catch (...) {
    space_.release(h.buffer);
    throw;
  }
  space_.release(h.buffer);
  return true;
}

void SwapPipeline::prefetch(SwappedPart& part, int64_t begin) {
  if (!space_.pipeline_read() || !reads_.empty()) return;
  for (const Held& h : kept_) {
    if (h.part == &part && h.begin == begin) return;  // take() finds it kept
  }
  // A buffer for the read ahead, never the one being updated.
  while (held() >= space_.buffer_count() && evict_one()) {
  }
  if (held() >= space_.buffer_count()) return;
  Held h{&part, begin, space_.acquire(part.max_region_bytes()), {}, 0};
  h.read = part.read(begin, h.buffer);
  reads_.push_back(std::move(h));
}

at::Tensor SwapPipeline::take(SwappedPart& part, int64_t begin, double init) {
  const auto kept = std::find_if(kept_.begin(), kept_.end(),
                                 [&](const Held& h) { return h.part == &part && h.begin == begin; });
  if (kept != kept_.end()) {
    Held h = std::move(*kept);
    kept_.erase(kept);
    if (h.generation == part.generation(begin)) {
      // Its write reads this buffer, which the update is about to change.
      try {
        settle(part, begin);
      } catch (...) {
        space_.release(h.buffer);
        throw;
      }
      ++taken_;
      return h.buffer;
    }
    // Written since outside the step (a load, safe_set): the file holds the truth.
    try {
      settle(part, begin);
    } catch (...) {
      space_.release(h.buffer);
      throw;
    }
    space_.release(h.buffer);
  }
  Held h;
  if (!reads_.empty() && reads_.front().part == &part && reads_.front().begin == begin) {
    h = std::move(reads_.front());
    reads_.pop_front();
  } else {
    ZS_CHECK(reads_.empty(), "SwapPipeline::take: sub-group ", begin, " is not the one prefetched");
    while (held() >= space_.buffer_count() && evict_one()) {
    }
    h = Held{&part, begin, space_.acquire(part.max_region_bytes()), {}, 0};
    h.read = part.read(begin, h.buffer);
  }
  try {
    wait(h.read);
    part.check(begin, h.buffer);
  } catch (...) {
    space_.release(h.buffer);  // why: the engine is done with it, failed or not
    throw;
  }
  ++taken_;
  if (!part.has_state(begin)) {
    // Never written with state (the first step, or the state was dropped): torch.optim's start.
    for (size_t s = 0; s < part.slots(); ++s) part.view(h.buffer, begin, int64_t(s)).fill_(init);
  }
  return h.buffer;
}

void SwapPipeline::put(SwappedPart& part, int64_t begin, const at::Tensor& buffer) {
  --taken_;
  Held h{&part, begin, buffer, {}, 0};
  try {
    part.write(begin, buffer, true);
  } catch (...) {
    space_.release(buffer);
    throw;
  }
  h.generation = part.generation(begin);
  kept_.push_back(std::move(h));
  if (!space_.pipeline_write()) settle(part, begin);
  while (held() > space_.buffer_count() && evict_one()) {
  }
}

void SwapPipeline::end_step() {
  ZS_CHECK(reads_.empty() && taken_ == 0, "SwapPipeline::end_step: ", reads_.size(), " reads and ", taken_,
           " sub-groups not written back");
}

}  // namespace zeroshard
