// Dynamic loss scaling; the rules follow DeepSpeed's DynamicLossScaler so fp16 runs behave alike.
#include "runtime/loss_scaler.h"

#include <algorithm>

namespace zeroshard {

LossScaler::LossScaler(const LossScalerOptions& options)
    : opt_(options),
      scale_(options.dynamic ? options.initial_scale : options.static_scale),
      hysteresis_left_(options.hysteresis) {}

bool LossScaler::update(bool overflow) {
  stuck_at_minimum_ = false;
  if (!opt_.dynamic) return overflow;
  if (overflow) {
    // Hysteresis: tolerate a few overflows before shrinking, so one spike does not halve the scale.
    if (opt_.hysteresis == 1 || hysteresis_left_ <= 1) {
      stuck_at_minimum_ = scale_ <= opt_.min_scale;
      scale_ = std::max(scale_ / 2.0, opt_.min_scale);
    } else {
      --hysteresis_left_;
    }
    clean_steps_ = 0;
    return true;
  }
  if (opt_.consecutive_hysteresis) hysteresis_left_ = opt_.hysteresis;
  ++clean_steps_;
  if (clean_steps_ % opt_.window == 0) {
    scale_ *= 2.0;
    if (!opt_.consecutive_hysteresis) hysteresis_left_ = opt_.hysteresis;
  }
  return false;
}

void LossScaler::restore(double scale, int64_t clean_steps, int64_t hysteresis_left) {
  scale_ = scale;
  clean_steps_ = clean_steps;
  hysteresis_left_ = hysteresis_left;
}

}  // namespace zeroshard
