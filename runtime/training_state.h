// A run's progress as one object: the step counters the engine reports (DeepSpeed's global_steps,
// micro_steps, global_samples, skipped_steps), each parameter group's applied steps (what Adam's
// bias correction counts) and the fp16 loss scaler. ZeroOptimizer owns the one instance; the
// engine reads its counters from it; checkpoints save and restore it whole.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

#include "runtime/loss_scaler.h"

namespace zeroshard {

class TrainingState {
 public:
  TrainingState(const LossScalerOptions& scaler, int64_t num_groups);

  int64_t global_steps() const { return global_steps_; }
  int64_t micro_steps() const { return micro_steps_; }
  int64_t global_samples() const { return global_samples_; }
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t group_steps(int64_t group) const { return group_steps_.at(size_t(group)); }
  LossScaler& scaler() { return scaler_; }
  const LossScaler& scaler() const { return scaler_; }

  // One backward's micro-batch done (the engine's step() call, boundary or not).
  void count_micro_step() { ++micro_steps_; }
  // The optimizer step at an accumulation boundary over `samples` samples: applied or skipped
  // (an fp16 overflow). Returns the group's step number, for its bias correction.
  void count_step(int64_t samples, bool applied);
  int64_t count_group_step(int64_t group) { return ++group_steps_.at(size_t(group)); }

  // {"global_steps", "micro_steps", "global_samples", "skipped_steps", "group_steps": [...],
  //  "loss_scaler": {"scale", "steps_since_overflow", "hysteresis_left"}}.
  nlohmann::json state_dict() const;
  // Every key above is required; a missing or mistyped one, a group count that differs from this
  // run's, or a loss scaler this run's fp16 settings cannot have (another static scale, a dynamic
  // one under fp16.min_loss_scale, more hysteresis than fp16.hysteresis) is a UsageError that
  // names it. Nothing changes unless all of it is valid.
  void load_state_dict(const nlohmann::json& state);

 private:
  int64_t global_steps_ = 0, micro_steps_ = 0, global_samples_ = 0, skipped_steps_ = 0;
  std::vector<int64_t> group_steps_;
  LossScaler scaler_;
};

}  // namespace zeroshard
