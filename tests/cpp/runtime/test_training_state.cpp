// The run's progress as one object (runtime/training_state.cpp): counting, a state_dict round
// trip that restores the loss scaler's dynamics, and load errors that name the key.
#include <catch2/catch.hpp>

#include "runtime/error.h"
#include "runtime/training_state.h"

using namespace zeroshard;

namespace {
LossScalerOptions dynamic_scaler() {
  LossScalerOptions o;
  o.initial_scale = 1024.0;
  o.window = 3;
  o.hysteresis = 2;
  return o;
}
}  // namespace

TEST_CASE("steps, skipped steps and samples are counted in one place") {
  TrainingState s(dynamic_scaler(), 2);
  for (int i = 0; i < 4; ++i) s.count_micro_step();
  s.count_step(32, true);
  s.count_step(32, false);
  REQUIRE(s.count_group_step(1) == 1);
  REQUIRE(s.global_steps() == 2);
  REQUIRE(s.micro_steps() == 4);
  REQUIRE(s.global_samples() == 64);
  REQUIRE(s.skipped_steps() == 1);
  REQUIRE(s.group_steps(0) == 0);
  REQUIRE(s.group_steps(1) == 1);
}

TEST_CASE("a state_dict round trip continues the loss scaler where it was") {
  TrainingState a(dynamic_scaler(), 1);
  a.scaler().update(true);   // an overflow: hysteresis 2 -> 1, scale kept
  a.scaler().update(false);
  a.scaler().update(false);  // two clean steps of the window of 3
  a.count_step(8, true);
  a.count_group_step(0);
  TrainingState b(dynamic_scaler(), 1);
  b.load_state_dict(a.state_dict());
  REQUIRE(b.state_dict() == a.state_dict());
  // The next clean step completes the window in both: the scale doubles in both.
  a.scaler().update(false);
  b.scaler().update(false);
  REQUIRE(b.scaler().scale() == 2048.0);
  REQUIRE(a.scaler().scale() == b.scaler().scale());
  // Doubling refilled the hysteresis (2): the first overflow spends it, the second halves both.
  a.scaler().update(true);
  b.scaler().update(true);
  REQUIRE(b.scaler().scale() == 2048.0);
  a.scaler().update(true);
  b.scaler().update(true);
  REQUIRE(b.scaler().scale() == 1024.0);
  REQUIRE(a.scaler().scale() == b.scaler().scale());
}

TEST_CASE("a state that does not fit this run is refused with the key, and changes nothing") {
  TrainingState s(dynamic_scaler(), 2);
  s.count_step(4, true);
  const auto before = s.state_dict();
  auto missing = before;
  missing.erase("micro_steps");
  REQUIRE_THROWS_AS(s.load_state_dict(missing), UsageError);
  REQUIRE_THROWS_WITH(s.load_state_dict(missing), "training state: micro_steps is missing");
  auto groups = before;
  groups["group_steps"] = {1, 2, 3};
  REQUIRE_THROWS_WITH(s.load_state_dict(groups), Catch::Contains("group_steps: got [1,2,3], expected 2 counts"));
  auto scale = before;
  scale["loss_scaler"]["scale"] = -1;
  REQUIRE_THROWS_WITH(s.load_state_dict(scale), Catch::Contains("loss_scaler.scale: got -1"));
  auto static_scale = before;
  static_scale["loss_scaler"]["scale"] = 65536.0;
  TrainingState fixed(LossScalerOptions{false, 1.0}, 2);  // fp16 off: the scale stays 1
  REQUIRE_THROWS_WITH(fixed.load_state_dict(static_scale), Catch::Contains("static at 1"));
  auto small = before;
  small["loss_scaler"]["scale"] = 0.5;
  REQUIRE_THROWS_WITH(s.load_state_dict(small), Catch::Contains("fp16.min_loss_scale (1)"));
  auto skipped = before;
  skipped["skipped_steps"] = 5;
  REQUIRE_THROWS_WITH(s.load_state_dict(skipped), Catch::Contains("more than global_steps (1)"));
  auto negative = before;
  negative["global_steps"] = -3;
  REQUIRE_THROWS_WITH(s.load_state_dict(negative), Catch::Contains("global_steps: got -3"));
  REQUIRE(s.state_dict() == before);
}
