// runtime/lr_schedule: each DeepSpeed schedule at several steps against the closed form written out
// here independently, plus the stateful API (step, get_last_lr, state round trip) and per-group lrs.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/error.h"
#include "runtime/lr_schedule.h"

using zeroshard::LrSchedule;
using zeroshard::parse_config;

namespace {

LrSchedule make(const std::string& scheduler_json, std::vector<double> base_lrs = {0.1}) {
  auto c = parse_config("{\"train_micro_batch_size_per_gpu\": 1, \"scheduler\": " + scheduler_json + "}", "t.json");
  return LrSchedule(c.scheduler, std::move(base_lrs));
}

const double kPi = std::acos(-1.0);

}  // namespace

TEST_CASE("WarmupLR: log and linear warmup, then flat") {
  auto log_s = make(R"({"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 100}})");
  for (int64_t s : {0, 1, 9, 50, 99}) {
    INFO(s);
    CHECK(log_s.lr_at(s) == Approx(0.01 + 0.09 * std::log(s + 1.0) / std::log(100.0)));
  }
  CHECK(log_s.lr_at(100) == Approx(0.1));
  CHECK(log_s.lr_at(100000) == Approx(0.1));
  CHECK(log_s.lr_at(-1) == Approx(0.01));  // before the first step

  auto lin = make(R"({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}})");
  for (int64_t s : {0, 3, 9}) CHECK(lin.lr_at(s) == Approx(0.1 * s / 10.0));
  CHECK(lin.lr_at(10) == Approx(0.1));

  // warmup_num_steps 1 is clamped to 2, as DeepSpeed does.
  auto one = make(R"({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 1, "warmup_type": "linear"}})");
  CHECK(one.lr_at(1) == Approx(0.05));

  // No warmup_max_lr: warm up to the optimizer's (first group's) lr.
  auto to_base = make(R"({"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "linear"}})", {6e-4, 1e-3});
  CHECK(to_base.lr_at(5, 0) == Approx(3e-4));
  CHECK(to_base.lr_at(5, 1) == Approx(3e-4));
  CHECK(to_base.lr_at(20, 1) == Approx(6e-4));
}

TEST_CASE("WarmupDecayLR: warmup then linear decay to 0 at total_num_steps") {
  auto s = make(R"({"type": "WarmupDecayLR", "params": {"total_num_steps": 110, "warmup_num_steps": 10, "warmup_type": "linear"}})");
  const double max_lr = 0.001;  // WarmupDecayLR's own default, not the optimizer's lr
  CHECK(s.lr_at(5) == Approx(max_lr * 0.5));
  for (int64_t k : {10, 35, 60, 109, 110}) {
    INFO(k);
    CHECK(s.lr_at(k) == Approx(max_lr * (110.0 - k) / 100.0).margin(1e-15));
  }
  CHECK(s.lr_at(500) == 0.0);
}

TEST_CASE("WarmupCosineLR: ratio warmup then cosine to cos_min_ratio, per group") {
  auto s = make(R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 1010, "warmup_num_steps": 10,
                    "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_type": "linear"}})",
                {1.0, 0.5});
  CHECK(s.lr_at(-1, 0) == 0.0);  // DeepSpeed sets lr 0 before the first step
  CHECK(s.lr_at(0, 0) == Approx(0.1));
  CHECK(s.lr_at(4, 1) == Approx(0.5 * (0.1 + 0.4 * 0.9)));
  for (int64_t k : {10, 100, 509, 900, 1009}) {
    INFO(k);
    const double progress = (k - 10 + 1) / 1000.0;
    const double ratio = 0.01 + 0.99 * (1 + std::cos(kPi * progress)) / 2;
    CHECK(s.lr_at(k, 0) == Approx(ratio));
    CHECK(s.lr_at(k, 1) == Approx(0.5 * ratio));
  }
  CHECK(s.lr_at(5000, 0) == Approx(0.01));  // clamped past the end
  auto log_s = make(R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 8}})", {2.0});
  CHECK(log_s.lr_at(3) == Approx(2.0 * std::log(4.0) / std::log(8.0)));
}

TEST_CASE("OneCycle: triangle, staircase, post-cycle decay, momentum reported") {
  auto s = make(R"({"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.11,
                    "cycle_first_step_size": 10, "cycle_second_step_size": 30,
                    "decay_step_size": 5, "decay_lr_rate": 0.5, "cycle_momentum": true}})");
  // Up over 10 iterations, down over 30, indexed by iteration = step + 1.
  CHECK(s.lr_at(-1) == Approx(0.01));
  CHECK(s.lr_at(4) == Approx(0.01 + 0.1 * 5 / 10.0));
  CHECK(s.lr_at(9) == Approx(0.11));
  CHECK(s.lr_at(24) == Approx(0.01 + 0.1 * (40 - 25) / 30.0));
  CHECK(s.lr_at(38) == Approx(0.01 + 0.1 * 1 / 30.0));
  // After 40 steps: cycle_min_lr / (1 + rate * (step - 40 + 1) / decay_step_size).
  for (int64_t k : {40, 44, 60}) CHECK(s.lr_at(k) == Approx(0.01 / (1 + 0.5 * (k - 39) / 5.0)));
  CHECK(s.momentum_at(4).value() == Approx(0.9 - 0.1 * 0.5));
  CHECK(s.momentum_at(100).value() == Approx(0.9));  // decay_mom_rate 0: holds max

  auto stairs = make(R"({"type": "OneCycle", "params": {"cycle_min_lr": 0.0, "cycle_max_lr": 1.0,
                         "cycle_first_step_size": 10, "cycle_first_stair_count": 2, "cycle_momentum": false}})");
  CHECK(stairs.lr_at(3) == Approx(0.0));   // iteration 4 of 10: first stair
  CHECK(stairs.lr_at(4) == Approx(0.5));   // iteration 5: second stair
  CHECK(stairs.lr_at(9) == Approx(1.0));   // the peak is reached exactly
  CHECK(stairs.lr_at(13) == Approx(0.5));  // on the way down (second half mirrors the first)
  CHECK(stairs.lr_at(25) == Approx(0.0));  // no decay configured: holds cycle_min_lr
  CHECK(!stairs.momentum_at(3).has_value());
}

TEST_CASE("LRRangeTest: continuous and staircase") {
  auto s = make(R"({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 10,
                    "lr_range_test_step_rate": 2.0}})");
  for (int64_t k : {-1, 0, 4, 99}) CHECK(s.lr_at(k) == Approx(0.001 * (1 + 2.0 * (k + 1) / 10.0)));
  auto st = make(R"({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": [0.001, 0.002],
                     "lr_range_test_step_size": 10, "lr_range_test_staircase": true}})",
                 {1.0, 1.0});
  CHECK(st.lr_at(8, 0) == Approx(0.001));
  CHECK(st.lr_at(9, 0) == Approx(0.002));
  CHECK(st.lr_at(9, 1) == Approx(0.004));
}

TEST_CASE("stateful API: step, get_last_lr, state round trip") {
  auto s = make(R"({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}})",
                {0.1, 0.2});
  CHECK(s.last_batch_iteration() == -1);
  CHECK(s.get_last_lr() == std::vector<double>{0.0, 0.0});
  s.step();
  s.step();
  CHECK(s.last_batch_iteration() == 1);
  CHECK(s.get_last_lr()[0] == Approx(0.01));
  CHECK(s.get_lr() == s.get_last_lr());
  auto state = s.state_dict();
  CHECK(state == nlohmann::json{{"last_batch_iteration", 1}});

  auto t = make(R"({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"}})",
                {0.1, 0.2});
  t.load_state_dict(state);
  CHECK(t.step() == s.step());
  CHECK_THROWS_AS(t.load_state_dict(nlohmann::json{{"step", 3}}), zeroshard::Error);

  // A resumed schedule starts from params.last_batch_iteration.
  auto r = make(R"({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 10,
                    "warmup_type": "linear", "last_batch_iteration": 4}})");
  CHECK(r.step()[0] == Approx(0.05));
}

TEST_CASE("construction errors") {
  auto c = parse_config(R"({"train_micro_batch_size_per_gpu": 1})", "t.json");
  CHECK_THROWS_WITH(LrSchedule(c.scheduler, {0.1}), "scheduler: missing; the config has no \"scheduler\" block");
  CHECK_THROWS_WITH(make(R"({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.1]}})", {0.1, 0.1, 0.1}),
                    "scheduler.params.warmup_min_lr: got 2 values, expected 3 (one per parameter group)");
}
