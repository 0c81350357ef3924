// Fetch-order trace for ZeRO-3 prefetching; see fetch_trace.h.
#include "zero/fetch_trace.h"

namespace zeroshard {

bool FetchTrace::on_fetch(int64_t module_id) {
  if (mode_ == Mode::record) {
    trace_.push_back(module_id);
    return true;
  }
  if (broken_) return true;
  if (pos_ < trace_.size() && trace_[pos_] == module_id) {
    ++pos_;
    return true;
  }
  invalidate();
  return false;
}

bool FetchTrace::end_iteration() {
  if (discard_) {
    mode_ = Mode::record;
    trace_.clear();
    pos_ = 0;
    broken_ = discard_ = false;
    return true;
  }
  bool ok = !broken_;
  if (mode_ == Mode::follow && !broken_ && pos_ != trace_.size()) {
    invalidate();
    ok = false;
  }
  if (broken_) {
    // Record the new order on the next iteration.
    mode_ = Mode::record;
    trace_.clear();
  } else if (mode_ == Mode::record) {
    mode_ = Mode::follow;
  }
  pos_ = 0;
  broken_ = false;
  return ok;
}

void FetchTrace::abandon_iteration() {
  discard_ = false;
  if (mode_ == Mode::record || broken_) {
    mode_ = Mode::record;
    trace_.clear();
  }
  pos_ = 0;
  broken_ = false;
}

void FetchTrace::restart_recording(bool mid_iteration) {
  mode_ = Mode::record;
  trace_.clear();
  pos_ = 0;
  broken_ = false;
  discard_ = mid_iteration;
}

void FetchTrace::invalidate() {
  broken_ = true;
  ++invalidations_;
}

}  // namespace zeroshard
