// The optimizer steps' NVMe reads and writes; see swap_pipeline.h.
#include "zero/swap_pipeline.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>

#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/trace.h"

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
      } catch (const Error& e) {
        // The run is ending: its state on disk goes with it, so this is worth a line, not a throw.
        warn(detail::cat("NVMe: at shutdown: ", e.what()));
      }
      space_.release(h.buffer);
    }
    queue->clear();
  }
}

void SwapPipeline::begin_step() { wait_ms_ = 0.0; }

int64_t SwapPipeline::held() const { return int64_t(reads_.size() + kept_.size() + taken_.size()); }

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
  Held h{&part, begin, space_.acquire(), {}, 0};
  h.read = part.read(begin, h.buffer);
  reads_.push_back(std::move(h));
}

at::Tensor SwapPipeline::take(SwappedPart& part, int64_t begin, double init) {
  // On the trace, from the ask to a buffer holding the sub-group (kept, prefetched or read now).
  trace::Scope traced("swap", [&] { return detail::cat("swap in optimizer sub-group at ", begin); });
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
      taken_.push_back(h.buffer);
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
    h = Held{&part, begin, space_.acquire(), {}, 0};
    h.read = part.read(begin, h.buffer);
  }
  try {
    wait(h.read);
    part.check(begin, h.buffer);
  } catch (...) {
    space_.release(h.buffer);  // why: the engine is done with it, failed or not
    throw;
  }
  taken_.push_back(h.buffer);
  if (!part.has_state(begin)) {
    // Never written with state (the first step, or the state was dropped): torch.optim's start.
    for (size_t s = 0; s < part.slots(); ++s) part.view(h.buffer, begin, int64_t(s)).fill_(init);
  }
  return h.buffer;
}

void SwapPipeline::put(SwappedPart& part, int64_t begin, const at::Tensor& buffer) {
  trace::Scope traced("swap", [&] { return detail::cat("swap out optimizer sub-group at ", begin); });
  const auto it = std::find_if(taken_.begin(), taken_.end(),
                               [&](const at::Tensor& t) { return t.data_ptr() == buffer.data_ptr(); });
  ZS_CHECK(it != taken_.end(), "SwapPipeline::put: not a buffer take() handed out");
  taken_.erase(it);
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
  ZS_CHECK(reads_.empty() && taken_.empty(), "SwapPipeline::end_step: ", reads_.size(), " reads and ",
           taken_.size(), " sub-groups not written back");
}

void SwapPipeline::abandon() {
  for (Held& h : reads_) {
    try {
      AioEngine::wait(h.read);
    } catch (const Error& e) {
      warn(detail::cat("NVMe: a read ahead of the failed step also failed: ", e.what()));
    }
    space_.release(h.buffer);
  }
  reads_.clear();
  for (const at::Tensor& t : taken_) space_.release(t);
  taken_.clear();
}

}  // namespace zeroshard
