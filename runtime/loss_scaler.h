// fp16 loss scaling with DeepSpeed's rules: a static scale, or a dynamic one that halves after
// `hysteresis` overflowing steps (never below min_scale) and doubles after `window` clean steps.
#pragma once
#include <cstdint>

namespace zeroshard {

struct LossScalerOptions {
  bool dynamic = true;
  double static_scale = 1.0;          // used when !dynamic
  double initial_scale = 65536.0;     // 2^initial_scale_power
  int64_t window = 1000;              // loss_scale_window
  int64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_scale = 1.0;
};

class LossScaler {
 public:
  explicit LossScaler(const LossScalerOptions& options);
  double scale() const { return scale_; }
  const LossScalerOptions& options() const { return opt_; }
  // Records one optimizer step's overflow result and adapts the scale. Returns true when the step
  // must be skipped (an overflow: its gradients hold inf or nan).
  bool update(bool overflow);
  int64_t steps_since_overflow() const { return clean_steps_; }
  int64_t hysteresis_left() const { return hysteresis_left_; }
  // True when the last update was an overflow that found the dynamic scale already at min_scale
  // with no hysteresis left (DeepSpeed raises "Current loss scale already at minimum" then).
  bool at_minimum_after_overflow() const { return stuck_at_minimum_; }
  // For checkpoints.
  void restore(double scale, int64_t clean_steps, int64_t hysteresis_left);

 private:
  LossScalerOptions opt_;
  double scale_;
  int64_t clean_steps_ = 0;
  int64_t hysteresis_left_;
  bool stuck_at_minimum_ = false;
};

}  // namespace zeroshard
