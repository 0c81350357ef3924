// Dynamic loss scaling rules (runtime/loss_scaler.cpp), step by step.
#include <catch2/catch.hpp>

#include "runtime/loss_scaler.h"

using namespace zeroshard;

TEST_CASE("static scale never changes; overflow still skips") {
  LossScalerOptions o;
  o.dynamic = false;
  o.static_scale = 128.0;
  LossScaler s(o);
  CHECK(s.scale() == 128.0);
  CHECK(s.update(true));
  CHECK_FALSE(s.update(false));
  CHECK(s.scale() == 128.0);
}

TEST_CASE("hysteresis delays the halving; the window doubles; min_scale bounds") {
  LossScalerOptions o;
  o.initial_scale = 1024.0;
  o.hysteresis = 2;
  o.window = 3;
  o.min_scale = 256.0;
  LossScaler s(o);
  CHECK(s.update(true));           // first overflow uses up one hysteresis
  CHECK(s.scale() == 1024.0);
  CHECK(s.update(true));           // second overflow halves
  CHECK(s.scale() == 512.0);
  CHECK(s.update(true));           // hysteresis is not refilled until a window completes
  CHECK(s.scale() == 256.0);
  CHECK_FALSE(s.at_minimum_after_overflow());
  CHECK(s.update(true));
  CHECK(s.scale() == 256.0);       // min_scale
  CHECK(s.at_minimum_after_overflow());  // the engine raises here, as DeepSpeed does
  CHECK_FALSE(s.update(false));
  CHECK_FALSE(s.at_minimum_after_overflow());
  CHECK_FALSE(s.update(false));
  CHECK(s.scale() == 256.0);
  CHECK_FALSE(s.update(false));    // third clean step completes the window
  CHECK(s.scale() == 512.0);
  CHECK(s.hysteresis_left() == 2);
}

TEST_CASE("consecutive_hysteresis refills on every clean step") {
  LossScalerOptions o;
  o.initial_scale = 64.0;
  o.hysteresis = 2;
  o.window = 1000;
  o.consecutive_hysteresis = true;
  LossScaler s(o);
  CHECK(s.update(true));
  CHECK(s.scale() == 64.0);
  CHECK_FALSE(s.update(false));    // refilled
  CHECK(s.update(true));
  CHECK(s.scale() == 64.0);        // still absorbed by the refilled hysteresis
  CHECK(s.update(true));
  CHECK(s.scale() == 32.0);
}
