// When ZeRO-3 may release a module's frozen parameters before backward ends. The engine's hooks
// (python/zeroshard/zero/hooks.py, _NodesRun) report when every autograd node of one forward has
// run; this decides whether that report may release anything. Only inside the engine's own
// backward, whose end releases everything anyway (autograd.grad before it may leave nodes that
// read the weights for it, such as a gradient penalty's); never in a backward that builds a
// graph (create_graph: its nodes read the weights later); and only for forwards that every rank
// tracks. A rank's graph can differ from another's (a data-dependent branch that writes into a
// slice), and a rank that releases a module where another holds it all-gathers it again alone.
// So at the start of each backward the ranks compare which of the forwards since the last one
// they track, and if they differ none of those is released early. A forward run again within
// backward (reentrant checkpointing's recomputation, whose first forward built no graph) is
// compared on its own when it ends: one all-reduce per such forward.
#pragma once
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/comm.h"

namespace zeroshard {

class FrozenRelease {
 public:
  // device: where the comparison's four integers go (the communicator's device).
  FrozenRelease(std::shared_ptr<Comm> comm, c10::Device device);
  // A verdict that never allows a release (a forward within a backward outside the engine's).
  static constexpr int64_t kNever = -1;

  // A forward outside backward of a module holding frozen parameters: `tracked` when its nodes
  // could be found from its outputs. Returns the verdict its report follows, settled when the
  // next backward begins.
  int64_t record(bool tracked);
  // A forward within the engine's backward: compared across ranks now (every rank runs it, as
  // the recomputation repeats a forward every rank ran).
  int64_t agree_now(bool tracked);
  bool in_backward() const { return in_backward_; }
  // Whether a report under `verdict` may release: in the engine's backward, with grad mode off
  // (engine.backward never builds a graph), for forwards every rank tracks.
  bool may_arm(int64_t verdict, bool grad_enabled) const;
  void begin_backward();
  void end_backward() { in_backward_ = false; }

 private:
  bool compare(int64_t count, int64_t digest);
  int64_t new_verdict(bool agreed);

  std::shared_ptr<Comm> comm_;
  c10::Device device_;
  int64_t count_ = 0, digest_ = 0;  // the forwards recorded since the last backward began
  int64_t current_ = 0;             // their verdict
  std::vector<bool> agreed_;        // by verdict (one per backward and per recomputation)
  bool in_backward_ = false;
};

}  // namespace zeroshard
