// Pipeline schedules (pipeline/schedule.cpp) and their checker (pipeline/schedule_check.cpp):
// every schedule at every size passes the checker and holds the papers' memory and bubble
// numbers; broken lists are caught with a message that says where.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>

#include "pipeline/schedule_check.h"
#include "runtime/error.h"

using namespace zeroshard;
using namespace zeroshard::pipeline;

namespace {

struct Scenario {
  ScheduleKind kind;
  PipelineShape shape;
};

// Stages 1-8 and micro-batches 1-32; virtual stages 1-4 for interleaved_1f1b where
// m % p == 0 (what it accepts), 1 for the others.
std::vector<Scenario> scenarios(ScheduleKind kind) {
  std::vector<Scenario> out;
  const int max_virtual = kind == ScheduleKind::interleaved_1f1b ? 4 : 1;
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 32; ++m)
      for (int v = 1; v <= max_virtual; ++v)
        if (kind != ScheduleKind::interleaved_1f1b || m % p == 0) out.push_back({kind, {p, m, v}});
  return out;
}

// Peak chunk-forwards held at once on rank r (a forward counts until its backward, or its
// backward_input, has run).
int expected_peak(ScheduleKind kind, const PipelineShape& s, int r) {
  const int p = s.num_stages, m = s.num_micro_batches, v = s.virtual_stages;
  switch (kind) {
    case ScheduleKind::gpipe: return m;  // every forward before the first backward
    // DeepSpeed's TrainSchedule: p - r - 1 warm-up forwards plus the steady-state one.
    // ZB-H1 keeps 1F1B's warm-up and frees at B (Qi et al. 2023, section 3.1: "the same peak
    // memory as 1F1B"); deferring W does not hold a forward's activation in this count.
    case ScheduleKind::one_f_one_b:
    case ScheduleKind::zero_bubble: return std::min(m, p - r);
    // Megatron-LM's interleaved warm-up, 2(p - r - 1) + (v - 1)p chunk-forwards, plus the
    // steady-state one. On rank 0 that is (p + (p - 1)/v) stages' worth of activations, the
    // p(1 + (p - 1)/(p v)) of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
    // Large Transformer Models", section 4.2.3), each chunk-forward holding 1/v of a stage's.
    case ScheduleKind::interleaved_1f1b:
      return std::min(v * m, v == 1 ? p - r : 2 * (p - r - 1) + (v - 1) * p + 1);
  }
  return -1;
}

std::vector<std::vector<Instruction>> with_tail(std::vector<std::vector<Instruction>> lists) {
  for (auto& list : lists)
    for (Op op : {Op::reduce_tied, Op::reduce_data_parallel, Op::optimizer_step})
      list.push_back({op});
  return lists;
}

Instruction load(int mb) { return {Op::load_micro_batch, mb, 0}; }
Instruction forward(int mb) { return {Op::forward, mb, 0}; }
Instruction backward(int mb) { return {Op::backward, mb, 0}; }
Instruction send_activation(int mb, int peer) { return {Op::send_activation, mb, 0, peer}; }
Instruction receive_activation(int mb, int peer) { return {Op::receive_activation, mb, 0, peer}; }
Instruction send_gradient(int mb, int peer) { return {Op::send_gradient, mb, 0, peer}; }
Instruction receive_gradient(int mb, int peer) { return {Op::receive_gradient, mb, 0, peer}; }

// Index of the first instruction on a list equal to `wanted`.
size_t index_of(const std::vector<Instruction>& list, const Instruction& wanted) {
  auto it = std::find(list.begin(), list.end(), wanted);
  REQUIRE(it != list.end());
  return size_t(it - list.begin());
}

std::string at(int rank, size_t index, const Instruction& in) {
  return "rank " + std::to_string(rank) + " at instruction " + std::to_string(index) + " (" +
         describe(in) + ")";
}

}  // namespace

TEST_CASE("every schedule passes the checker with the papers' peak activations") {
  for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b,
                            ScheduleKind::interleaved_1f1b, ScheduleKind::zero_bubble}) {
    for (const Scenario& s : scenarios(kind)) {
      const PipelineShape& shape = s.shape;
      CAPTURE(to_string(kind), shape.num_stages, shape.num_micro_batches, shape.virtual_stages);
      const auto lists = build_all_schedules(kind, shape);
      const ScheduleReport report = check_schedule(shape, lists);
      REQUIRE(int(report.ranks.size()) == shape.num_stages);
      for (int r = 0; r < shape.num_stages; ++r) {
        CAPTURE(r);
        REQUIRE(report.ranks[r].peak_activations == expected_peak(kind, shape, r));
      }
    }
  }
}

// Unit costs: forward 1, backward 2 (or backward_input 1 + backward_weight 1), sends free. Every
// rank computes 3vm; what the makespan adds beyond that is the bubble.
TEST_CASE("simulated bubbles match theory with unit costs") {
  SECTION("1f1b and gpipe: (p-1)/(m+p-1) exactly") {
    for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b}) {
      for (const Scenario& s : scenarios(kind)) {
        const int p = s.shape.num_stages, m = s.shape.num_micro_batches;
        CAPTURE(to_string(kind), p, m);
        const ScheduleReport report = check_schedule(s.shape, build_all_schedules(kind, s.shape));
        REQUIRE(report.makespan == 3 * (m + p - 1));
        REQUIRE(report.bubble_fraction() == Approx(double(p - 1) / (m + p - 1)));
      }
    }
  }
  SECTION("interleaved: (p-1)/(vm+p-1) exactly") {
    // Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
    // Using Megatron-LM", section 2.2.2): the bubble is (p-1)(t_f + t_b) with t_f, t_b the
    // time of one chunk's passes, against vm(t_f + t_b) of work, i.e. 1/v of 1F1B's. With
    // unit costs per chunk pass and sends free the simulation reaches that bound exactly.
    for (const Scenario& s : scenarios(ScheduleKind::interleaved_1f1b)) {
      const int p = s.shape.num_stages, m = s.shape.num_micro_batches;
      const int v = s.shape.virtual_stages;
      CAPTURE(p, m, v);
      const ScheduleReport report =
          check_schedule(s.shape, build_all_schedules(ScheduleKind::interleaved_1f1b, s.shape));
      REQUIRE(report.makespan == 3 * (v * m + p - 1));
      REQUIRE(report.bubble_fraction() == Approx(double(p - 1) / (v * m + p - 1)));
    }
  }
  SECTION("zero_bubble (ZB-H1): a third of 1F1B's bubble time for m >= p, below it always") {
    // Qi et al. 2023, section 3.1: ZB-H1's bubble is (p-1)(T_F + T_B - T_W) against 1F1B's
    // (p-1)(T_F + T_B + T_W): p - 1 against 3(p - 1) with unit costs, once m >= p fills the
    // steady state. With fewer micro-batches it is still below 1F1B's.
    for (const Scenario& s : scenarios(ScheduleKind::zero_bubble)) {
      const int p = s.shape.num_stages, m = s.shape.num_micro_batches;
      CAPTURE(p, m);
      const ScheduleReport zb =
          check_schedule(s.shape, build_all_schedules(ScheduleKind::zero_bubble, s.shape));
      const ScheduleReport one_f_one_b =
          check_schedule(s.shape, build_all_schedules(ScheduleKind::one_f_one_b, s.shape));
      if (m >= p) REQUIRE(zb.makespan == 3 * m + p - 1);
      if (p > 1) REQUIRE(zb.bubble_fraction() < one_f_one_b.bubble_fraction());
      if (p == 1) REQUIRE(zb.bubble_fraction() == 0);
    }
  }
}

TEST_CASE("a rank's list is its part of the whole schedule") {
  const PipelineShape shape{4, 8, 2};
  const auto all = build_all_schedules(ScheduleKind::interleaved_1f1b, shape);
  for (int r = 0; r < 4; ++r)
    REQUIRE(build_schedule(ScheduleKind::interleaved_1f1b, shape, r) == all[r]);
  // The first stage loads inputs, the last labels: chunk 0 on rank 0, chunk v-1 on rank p-1.
  REQUIRE(all[0][0] == Instruction{Op::load_micro_batch, 0, 0});
  REQUIRE(std::count(all[3].begin(), all[3].end(), Instruction{Op::load_micro_batch, 5, 1}) == 1);
  REQUIRE(std::none_of(all[1].begin(), all[1].end(),
                       [](const Instruction& in) { return in.op == Op::load_micro_batch; }));
}

TEST_CASE("the simulated makespan uses the caller's costs") {
  const PipelineShape shape{2, 2, 1};
  InstructionCosts costs;
  costs.forward = 2;
  costs.backward = 5;
  costs.communication = 0.5;
  const ScheduleReport report =
      check_schedule(shape, build_all_schedules(ScheduleKind::gpipe, shape), costs);
  // Rank 0: F0 [0,2], hands activation 0 over by 2.5, F1 [2.5,4.5] while rank 1 runs F0, then
  // activation 1 by 5. Rank 1: F1 [5,7], B0 [7,12], gradient 0 by 12.5, B1 [12.5,17.5] while
  // rank 0 runs B0, gradient 1 by 18. Rank 0: B1 [18,23].
  REQUIRE(report.makespan == 23);
  REQUIRE(report.ranks[0].busy_time == 14);
}

TEST_CASE("bad arguments name the argument and what is allowed") {
  auto error = [](ScheduleKind kind, PipelineShape shape, int rank = 0) {
    try {
      build_schedule(kind, shape, rank);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  using Catch::Contains;
  CHECK_THAT(error(ScheduleKind::one_f_one_b, {0, 4, 1}),
             Contains("num_stages: got 0") && Contains(">= 1"));
  CHECK_THAT(error(ScheduleKind::gpipe, {2, 0, 1}),
             Contains("num_micro_batches: got 0") && Contains(">= 1"));
  CHECK_THAT(error(ScheduleKind::interleaved_1f1b, {2, 4, 0}),
             Contains("virtual_stages: got 0") && Contains(">= 1"));
  CHECK_THAT(error(ScheduleKind::zero_bubble, {2, 4, 2}),
             Contains("virtual_stages: got 2") && Contains("expected 1 for schedule zero_bubble") &&
                 Contains("interleaved_1f1b"));
  CHECK_THAT(error(ScheduleKind::interleaved_1f1b, {4, 6, 2}),
             Contains("num_micro_batches: got 6") && Contains("multiple of num_stages (4)"));
  CHECK_THAT(error(ScheduleKind::one_f_one_b, {4, 8, 1}, 4),
             Contains("rank: got 4") && Contains("0..3"));
}

// Two ranks, two micro-batches, 1F1B by hand: rank 1 takes micro-batch 1's activation before it
// sends micro-batch 0's gradient, the order in which rank 0 offers them.
std::vector<std::vector<Instruction>> hand_1f1b() {
  return with_tail({
      {load(0), forward(0), send_activation(0, 1), load(1), forward(1), send_activation(1, 1),
       receive_gradient(0, 1), backward(0), receive_gradient(1, 1), backward(1)},
      {receive_activation(0, 0), load(0), forward(0), backward(0), receive_activation(1, 0),
       send_gradient(0, 0), load(1), forward(1), backward(1), send_gradient(1, 0)},
  });
}

TEST_CASE("the checker names every rank of a deadlock") {
  const PipelineShape two{2, 2, 1};
  auto lists = hand_1f1b();
  REQUIRE(check_schedule(two, lists).makespan == 9);
  SECTION("both ranks send first") {
    std::swap(lists[1][4], lists[1][5]);  // rank 1 sends its gradient before taking rank 0's send
    REQUIRE_THROWS_WITH(check_schedule(two, lists),
                        Catch::Contains("deadlock") &&
                            Catch::Contains(at(0, 5, send_activation(1, 1)) +
                                            " waits for rank 1 to receive it") &&
                            Catch::Contains(at(1, 4, send_gradient(0, 0)) +
                                            " waits for rank 0 to receive it"));
  }
  SECTION("a receive moved before the send it depends on, three ranks") {
    const PipelineShape three{3, 1, 1};
    auto built = build_all_schedules(ScheduleKind::one_f_one_b, three);
    auto& rank1 = built[1];
    const size_t send = index_of(rank1, send_activation(0, 2));
    const size_t receive = index_of(rank1, receive_gradient(0, 2));
    std::rotate(rank1.begin() + send, rank1.begin() + receive, rank1.begin() + receive + 1);
    REQUIRE_THROWS_WITH(
        check_schedule(three, built),
        Catch::Contains(at(0, index_of(built[0], receive_gradient(0, 1)), receive_gradient(0, 1)) +
                        " waits for rank 1 to send it") &&
            Catch::Contains(at(1, send, receive_gradient(0, 2)) + " waits for rank 2 to send it") &&
            Catch::Contains(at(2, 0, receive_activation(0, 1)) + " waits for rank 1 to send it"));
  }
}

TEST_CASE("the checker catches broken lists") {
  using Catch::Contains;
  SECTION("a missing receive") {
    const PipelineShape shape{4, 8, 1};
    auto lists = build_all_schedules(ScheduleKind::one_f_one_b, shape);
    const size_t i = index_of(lists[2], receive_activation(0, 1));
    lists[2].erase(lists[2].begin() + i);
    REQUIRE_THROWS_WITH(check_schedule(shape, lists),
                        Contains("rank 2 instruction " + std::to_string(i) +
                                 " (forward micro-batch 0 chunk 0): runs before receiving its "
                                 "activation"));
  }
  SECTION("a backward before its forward") {
    const PipelineShape shape{2, 2, 1};
    auto lists = build_all_schedules(ScheduleKind::one_f_one_b, shape);
    const size_t f = index_of(lists[1], forward(1)), b = index_of(lists[1], backward(1));
    std::swap(lists[1][f], lists[1][b]);
    REQUIRE_THROWS_WITH(check_schedule(shape, lists),
                        Contains("rank 1 instruction " + std::to_string(f) +
                                 " (backward micro-batch 1 chunk 0): runs before its forward"));
  }
  SECTION("a micro-batch forwarded twice") {
    const PipelineShape shape{2, 3, 1};
    auto lists = build_all_schedules(ScheduleKind::gpipe, shape);
    const size_t f = index_of(lists[0], forward(1));
    lists[0].insert(lists[0].begin() + f + 1, forward(1));
    REQUIRE_THROWS_WITH(check_schedule(shape, lists),
                        Contains("rank 0 instruction " + std::to_string(f + 1) +
                                 " (forward micro-batch 1 chunk 0): the micro-batch is forwarded "
                                 "twice"));
  }
  SECTION("sends in another order than the receives") {
    auto lists = hand_1f1b();
    lists[0] = with_tail({{load(0), forward(0), load(1), forward(1), send_activation(1, 1),
                           send_activation(0, 1), receive_gradient(0, 1), backward(0),
                           receive_gradient(1, 1), backward(1)}})[0];
    REQUIRE_THROWS_WITH(check_schedule({2, 2, 1}, lists),
                        Contains("rank 0 instruction 4 (send_activation micro-batch 1") &&
                            Contains("receive_activation micro-batch 0 chunk 0 from rank 0") &&
                            Contains("same order"));
  }
  SECTION("a send to the wrong rank") {
    const PipelineShape shape{3, 2, 1};
    auto lists = build_all_schedules(ScheduleKind::one_f_one_b, shape);
    const size_t i = index_of(lists[0], send_activation(0, 1));
    lists[0][i].peer = 2;
    REQUIRE_THROWS_WITH(check_schedule(shape, lists),
                        Contains("rank 0 instruction " + std::to_string(i)) &&
                            Contains("stage 1 is on rank 1, not rank 2"));
  }
  SECTION("a micro-batch never backwarded, and a missing step") {
    auto lists = hand_1f1b();
    lists[0].erase(lists[0].begin() + 9);  // rank 0's backward of micro-batch 1
    REQUIRE_THROWS_WITH(check_schedule({2, 2, 1}, lists),
                        Contains("rank 0 chunk 0 micro-batch 1: no backward"));
    lists = hand_1f1b();
    lists[1].pop_back();
    REQUIRE_THROWS_WITH(check_schedule({2, 2, 1}, lists),
                        Contains("rank 1: the list must end with reduce_tied"));
  }
}
