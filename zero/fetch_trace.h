// The order in which ZeRO-3 modules fetch their parameters during one iteration (forward and
// backward). Recorded on the first iteration, then followed: each fetch is checked against it,
// and a different order invalidates it (with a warning) so it is recorded again instead of
// prefetching the wrong parameters. Pure bookkeeping; tested in tests/cpp/zero/test_fetch_trace.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace zeroshard {

class FetchTrace {
 public:
  enum class Mode { record, follow };
  Mode mode() const { return mode_; }
  // Returns false when following and `module_id` is not the module the trace expected here; the
  // trace is then invalid and records again from the next iteration.
  bool on_fetch(int64_t module_id);
  // End of an iteration. Returns false when a followed iteration ended early (order changed).
  bool end_iteration();
  // An iteration that did not finish (its backward raised) says nothing about the order: a partial
  // recording is dropped and recorded again whole; a trace being followed is kept and followed
  // from its start next iteration.
  void abandon_iteration();
  // A module joined the order (a parameter read outside its owner's forward registered the
  // reader): what was recorded lacks it, so the order is recorded again, without a warning, from
  // the next iteration on (mid_iteration: this one is under way and its recording is dropped).
  void restart_recording(bool mid_iteration);
  // Modules expected after the current position, nearest first (empty while recording).
  const std::vector<int64_t>& modules() const { return trace_; }
  size_t position() const { return pos_; }
  int64_t invalidations() const { return invalidations_; }

 private:
  void invalidate();
  Mode mode_ = Mode::record;
  std::vector<int64_t> trace_;
  size_t pos_ = 0;
  bool broken_ = false;  // order changed during this iteration
  bool discard_ = false;  // this iteration's recording lacks a module: record the next one
  int64_t invalidations_ = 0;
};

}  // namespace zeroshard
