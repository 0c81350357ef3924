// The run's progress; see training_state.h.
#include "runtime/training_state.h"

#include <string>

#include "runtime/error.h"

namespace zeroshard {
namespace {

const nlohmann::json& field(const nlohmann::json& state, const char* key, const char* where) {
  if (!state.is_object() || !state.contains(key)) {
    throw UsageError(detail::cat("training state: ", where, key, " is missing"));
  }
  return state.at(key);
}

int64_t count(const nlohmann::json& state, const char* key, const char* where = "") {
  const auto& v = field(state, key, where);
  if (!v.is_number_integer() || v.get<int64_t>() < 0) {
    throw UsageError(detail::cat("training state: ", where, key, ": got ", v.dump(),
                                 ", expected a non-negative integer"));
  }
  return v.get<int64_t>();
}

}  // namespace

TrainingState::TrainingState(const LossScalerOptions& scaler, int64_t num_groups)
    : group_steps_(size_t(num_groups), 0), scaler_(scaler) {}

void TrainingState::count_step(int64_t samples, bool applied) {
  ++global_steps_;
  global_samples_ += samples;
  if (!applied) ++skipped_steps_;
}

nlohmann::json TrainingState::state_dict() const {
  return {{"global_steps", global_steps_},
          {"micro_steps", micro_steps_},
          {"global_samples", global_samples_},
          {"skipped_steps", skipped_steps_},
          {"group_steps", group_steps_},
          {"loss_scaler",
           {{"scale", scaler_.scale()},
            {"steps_since_overflow", scaler_.steps_since_overflow()},
            {"hysteresis_left", scaler_.hysteresis_left()}}}};
}

void TrainingState::load_state_dict(const nlohmann::json& state) {
  const int64_t global = count(state, "global_steps"), micro = count(state, "micro_steps");
  const int64_t samples = count(state, "global_samples"), skipped = count(state, "skipped_steps");
  const auto& groups = field(state, "group_steps", "");
  if (!groups.is_array() || groups.size() != group_steps_.size()) {
    throw UsageError(detail::cat("training state: group_steps: got ", groups.dump(), ", expected ",
                                 group_steps_.size(), " counts, one per parameter group of this run"));
  }
  std::vector<int64_t> steps;
  for (const auto& g : groups) {
    if (!g.is_number_integer() || g.get<int64_t>() < 0) {
      throw UsageError(detail::cat("training state: group_steps: got ", groups.dump(),
                                   ", expected non-negative integers"));
    }
    steps.push_back(g.get<int64_t>());
  }
  const auto& scaler = field(state, "loss_scaler", "");
  const auto& scale = field(scaler, "scale", "loss_scaler.");
  if (!scale.is_number() || !(scale.get<double>() > 0.0)) {
    throw UsageError(detail::cat("training state: loss_scaler.scale: got ", scale.dump(),
                                 ", expected a positive number"));
  }
  const int64_t clean = count(scaler, "steps_since_overflow", "loss_scaler.");
  const int64_t hysteresis = count(scaler, "hysteresis_left", "loss_scaler.");
  const LossScalerOptions& o = scaler_.options();
  const double s = scale.get<double>();
  if (!o.dynamic && s != o.static_scale) {
    throw UsageError(detail::cat("training state: loss_scaler.scale: got ", s, ", but this run's ",
                                 "loss scale is static at ", o.static_scale,
                                 " (fp16 off, or fp16.loss_scale set)"));
  }
  if (o.dynamic && (s < o.min_scale || hysteresis > o.hysteresis)) {
    throw UsageError(detail::cat("training state: loss_scaler: got scale ", s, " and hysteresis_left ",
                                 hysteresis, ", expected a scale >= fp16.min_loss_scale (", o.min_scale,
                                 ") and hysteresis_left <= fp16.hysteresis (", o.hysteresis, ")"));
  }
  if (skipped > global) {
    throw UsageError(detail::cat("training state: skipped_steps: got ", skipped,
                                 ", more than global_steps (", global, ")"));
  }
  global_steps_ = global, micro_steps_ = micro, global_samples_ = samples, skipped_steps_ = skipped;
  group_steps_ = std::move(steps);
  scaler_.restore(scale.get<double>(), clean, hysteresis);
}

}  // namespace zeroshard
