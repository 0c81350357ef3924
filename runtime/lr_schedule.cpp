// The formulas of deepspeed/runtime/lr_schedules.py, rewritten as pure functions of the step.
// Where DeepSpeed's numbers are surprising they are kept (the engine must match DeepSpeed runs):
// warmup uses max(2, warmup_num_steps); WarmupCosineLR gives lr 0 before the first step.
#include "runtime/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "runtime/error.h"

namespace zeroshard {

namespace {

constexpr double kPi = 3.14159265358979323846;

double num(const nlohmann::json& p, const char* key) { return p.at(key).get<double>(); }
int64_t integer(const nlohmann::json& p, const char* key) {
  const auto& v = p.at(key);
  return v.is_number_integer() ? v.get<int64_t>() : static_cast<int64_t>(v.get<double>());
}

}  // namespace

LrSchedule::LrSchedule(const SchedulerConfig& config, std::vector<double> base_lrs)
    : type_(config.type), params_(config.params), base_lrs_(std::move(base_lrs)) {
  if (!config.present) throw ConfigError("scheduler: missing; the config has no \"scheduler\" block");
  if (base_lrs_.empty()) throw ConfigError("LrSchedule: base_lrs is empty, expected one lr per parameter group");
  if (type_ == "WarmupLR" || type_ == "WarmupDecayLR") {
    min_lrs_ = per_group("warmup_min_lr", params_.at("warmup_min_lr"));
    const auto& max_lr = params_.at("warmup_max_lr");
    // WarmupLR without warmup_max_lr warms up to the first group's lr, for every group.
    max_lrs_ = max_lr.is_null() ? std::vector<double>(base_lrs_.size(), base_lrs_[0])
                                : per_group("warmup_max_lr", max_lr);
  } else if (type_ == "LRRangeTest") {
    min_lrs_ = per_group("lr_range_test_min_lr", params_.at("lr_range_test_min_lr"));
  }
  if (params_.contains("warmup_num_steps"))
    warmup_steps_ = std::max<int64_t>(2, integer(params_, "warmup_num_steps"));
  if (params_.contains("warmup_type")) log_warmup_ = params_.at("warmup_type") == "log";
  last_batch_iteration_ = params_.value("last_batch_iteration", int64_t{-1});
  last_lrs_ = lrs_at(last_batch_iteration_);
}

std::vector<double> LrSchedule::per_group(const std::string& key, const nlohmann::json& value) const {
  if (!value.is_array()) return std::vector<double>(base_lrs_.size(), value.get<double>());
  if (value.size() != base_lrs_.size()) {
    throw ConfigError("scheduler.params." + key + ": got " + std::to_string(value.size()) +
                      " values, expected " + std::to_string(base_lrs_.size()) + " (one per parameter group)");
  }
  return value.get<std::vector<double>>();
}

double LrSchedule::warmup_gamma(int64_t step) const {
  if (step < warmup_steps_) {
    return log_warmup_ ? std::log(static_cast<double>(step + 1)) / std::log(static_cast<double>(warmup_steps_))
                       : static_cast<double>(step) / static_cast<double>(warmup_steps_);
  }
  if (type_ == "WarmupLR") return 1.0;
  // WarmupDecayLR: linear decay to 0 at total_num_steps.
  const double total = static_cast<double>(integer(params_, "total_num_steps"));
  return std::max(0.0, (total - static_cast<double>(step)) /
                           std::max(1.0, total - static_cast<double>(warmup_steps_)));
}

double LrSchedule::cosine_ratio(int64_t step) const {
  if (step < 0) return 0.0;
  if (step < warmup_steps_) {
    const double min_ratio = num(params_, "warmup_min_ratio");
    double r = log_warmup_ ? std::log(static_cast<double>(step + 1)) / std::log(static_cast<double>(warmup_steps_))
                           : static_cast<double>(step) / static_cast<double>(warmup_steps_);
    return min_ratio + r * (1.0 - min_ratio);
  }
  const double cos_min = num(params_, "cos_min_ratio");
  const double total = static_cast<double>(integer(params_, "total_num_steps"));
  const double done = static_cast<double>(step - warmup_steps_ + 1);
  // Past the end the ratio stays at cos_min_ratio (current DeepSpeed clamps; older ones wrapped).
  const double progress = std::min(1.0, done / std::max(1.0, total - static_cast<double>(warmup_steps_)));
  return std::max(0.0, cos_min + (1.0 - cos_min) * (1.0 + std::cos(kPi * progress)) / 2.0);
}

double LrSchedule::one_cycle_scale(int64_t step) const {
  const double first = num(params_, "cycle_first_step_size");
  const double second = num(params_, "cycle_second_step_size");
  const double total = first + second;
  const double up_fraction = first / total;
  const double it = static_cast<double>(step + 1);
  const double cycle = std::floor(1.0 + it / total);
  const double x = 1.0 + it / total - cycle;
  double scale;
  int64_t stairs;
  if (x <= up_fraction) {
    scale = x / up_fraction;
    stairs = integer(params_, "cycle_first_stair_count");
  } else {
    scale = (x - 1.0) / (up_fraction - 1.0);
    stairs = integer(params_, "cycle_second_stair_count");
  }
  if (stairs > 0) {
    // Stairs hold the value flat across each 1/stairs of a half cycle; counted from the integer
    // position in the cycle so a boundary is not lost to rounding of `scale`.
    const double pos_in_cycle = std::fmod(it, total);
    const double pos = pos_in_cycle <= first ? pos_in_cycle * stairs / first
                                             : (total - pos_in_cycle) * stairs / second;
    scale = std::floor(pos) / static_cast<double>(stairs);
  }
  return scale;
}

double LrSchedule::lr_at(int64_t step, size_t group) const {
  if (group >= base_lrs_.size()) {
    throw Error("LrSchedule::lr_at: group " + std::to_string(group) + " out of range (" +
                std::to_string(base_lrs_.size()) + " groups)");
  }
  if (type_ == "WarmupLR" || type_ == "WarmupDecayLR") {
    if (step < 0) return min_lrs_[group];
    return min_lrs_[group] + (max_lrs_[group] - min_lrs_[group]) * warmup_gamma(step);
  }
  if (type_ == "WarmupCosineLR") return base_lrs_[group] * cosine_ratio(step);
  if (type_ == "OneCycle") {
    const double min_lr = num(params_, "cycle_min_lr"), max_lr = num(params_, "cycle_max_lr");
    const int64_t cycle_steps = integer(params_, "cycle_first_step_size") + integer(params_, "cycle_second_step_size");
    if (step < cycle_steps) return min_lr + (max_lr - min_lr) * one_cycle_scale(step);
    // After the cycle: hold cycle_min_lr, or decay it when both decay knobs are set.
    const double rate = num(params_, "decay_lr_rate");
    const int64_t decay_size = integer(params_, "decay_step_size");
    if (decay_size == 0 || rate == 0.0) return min_lr;
    const double interval = static_cast<double>(step - cycle_steps + 1) / static_cast<double>(decay_size);
    return min_lr / (1.0 + rate * interval);
  }
  // LRRangeTest
  const double size = num(params_, "lr_range_test_step_size");
  double interval = static_cast<double>(step + 1) / size;
  if (params_.at("lr_range_test_staircase").get<bool>()) interval = std::floor(interval);
  return min_lrs_[group] * (1.0 + num(params_, "lr_range_test_step_rate") * interval);
}

std::vector<double> LrSchedule::lrs_at(int64_t step) const {
  std::vector<double> lrs(base_lrs_.size());
  for (size_t g = 0; g < lrs.size(); ++g) lrs[g] = lr_at(step, g);
  return lrs;
}

std::optional<double> LrSchedule::momentum_at(int64_t step) const {
  if (type_ != "OneCycle" || !params_.at("cycle_momentum").get<bool>()) return std::nullopt;
  const double min_mom = num(params_, "cycle_min_mom"), max_mom = num(params_, "cycle_max_mom");
  const int64_t cycle_steps = integer(params_, "cycle_first_step_size") + integer(params_, "cycle_second_step_size");
  // Momentum moves opposite to the lr: high when the lr is low.
  if (step < cycle_steps) return max_mom - (max_mom - min_mom) * one_cycle_scale(step);
  const double rate = num(params_, "decay_mom_rate");
  const int64_t decay_size = integer(params_, "decay_step_size");
  if (decay_size == 0 || rate == 0.0) return max_mom;
  const double interval = static_cast<double>(step - cycle_steps + 1) / static_cast<double>(decay_size);
  return max_mom * (1.0 + rate * interval);
}

std::vector<double> LrSchedule::step() {
  ++last_batch_iteration_;
  last_lrs_ = lrs_at(last_batch_iteration_);
  return last_lrs_;
}

void LrSchedule::set_last_batch_iteration(int64_t step) {
  if (step < -1) throw Error("LrSchedule: last_batch_iteration " + std::to_string(step) + " is below -1");
  last_batch_iteration_ = step;
  last_lrs_ = lrs_at(step);
}

nlohmann::json LrSchedule::state_dict() const {
  return {{"last_batch_iteration", last_batch_iteration_}};
}

void LrSchedule::load_state_dict(const nlohmann::json& state) {
  if (!state.is_object() || !state.contains("last_batch_iteration") || !state["last_batch_iteration"].is_number_integer())
    throw UsageError("LrSchedule::load_state_dict: expected {\"last_batch_iteration\": <int>}, got " + state.dump());
  // DeepSpeed restores only the counter; recomputing last_lrs keeps get_last_lr() consistent with it.
  set_last_batch_iteration(state["last_batch_iteration"].get<int64_t>());
}

}  // namespace zeroshard
