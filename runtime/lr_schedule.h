// DeepSpeed's five learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
// LRRangeTest) as one class over a validated SchedulerConfig. lr_at() is a pure function of the
// step, so the engine, checkpoints and tests agree on every value; step()/get_lr() mirror the
// Python schedulers' stateful API (last_batch_iteration counts optimizer steps, -1 = not started).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/config/config.h"

namespace zeroshard {

class LrSchedule {
 public:
  // `base_lrs` are the parameter groups' learning rates (one per group): WarmupLR without
  // warmup_max_lr warms up to base_lrs[0], and WarmupCosineLR scales each group's base lr, as
  // DeepSpeed does with the optimizer's param_groups. Throws ConfigError when the config has no
  // scheduler, when base_lrs is empty, or when a per-group list has the wrong length.
  LrSchedule(const SchedulerConfig& config, std::vector<double> base_lrs);

  // The lr of one group after `step` optimizer steps have been scheduled (DeepSpeed's
  // last_batch_iteration == step). Pure: no state is read but the config.
  double lr_at(int64_t step, size_t group = 0) const;
  std::vector<double> lrs_at(int64_t step) const;
  // OneCycle with cycle_momentum: the beta1/momentum DeepSpeed would set; nullopt otherwise.
  // Reported only: zeroshard does not apply it to the optimizer.
  std::optional<double> momentum_at(int64_t step) const;

  // Advances last_batch_iteration by one and returns the new lrs (what DeepSpeed writes into the
  // optimizer's param groups).
  std::vector<double> step();
  std::vector<double> get_lr() const { return lrs_at(last_batch_iteration_); }
  const std::vector<double>& get_last_lr() const { return last_lrs_; }
  int64_t last_batch_iteration() const { return last_batch_iteration_; }
  void set_last_batch_iteration(int64_t step);

  // {"last_batch_iteration": n}, DeepSpeed's scheduler state_dict.
  nlohmann::json state_dict() const;
  void load_state_dict(const nlohmann::json& state);

  const std::string& type() const { return type_; }
  size_t num_groups() const { return base_lrs_.size(); }

 private:
  double warmup_gamma(int64_t step) const;     // WarmupLR / WarmupDecayLR factor in [0, 1]
  double cosine_ratio(int64_t step) const;      // WarmupCosineLR factor on the base lr
  double one_cycle_scale(int64_t step) const;   // OneCycle position in the cycle, 0..1
  std::vector<double> per_group(const std::string& key, const nlohmann::json& value) const;

  std::string type_;
  nlohmann::json params_;
  std::vector<double> base_lrs_;
  std::vector<double> min_lrs_, max_lrs_;  // WarmupLR/WarmupDecayLR; LRRangeTest uses min_lrs_
  int64_t warmup_steps_ = 2;               // max(2, warmup_num_steps), as DeepSpeed clamps it
  bool log_warmup_ = true;
  int64_t last_batch_iteration_ = -1;
  std::vector<double> last_lrs_;
};

}  // namespace zeroshard
