// Pipeline schedules (pipeline/schedule.cpp, pipeline/schedules/): every schedule at every size
// passes the checker and holds the papers' memory and bubble numbers; the memory bounds, the
// loads, the argument errors, and the schedule names, which the config must accept exactly; and
// eval_batch's forward-only lists at every size.
#include <catch2/catch.hpp>

#include <algorithm>
#include <iterator>
#include <set>
#include <string>

#include "pipeline/schedule_check.h"
#include "runtime/config/config.h"
#include "runtime/error.h"

using namespace zeroshard;
using namespace zeroshard::pipeline;

namespace {

constexpr ScheduleKind kAllKinds[] = {ScheduleKind::gpipe, ScheduleKind::one_f_one_b,
                                      ScheduleKind::interleaved_1f1b, ScheduleKind::zero_bubble};

struct Scenario {
  ScheduleKind kind;
  PipelineShape shape;
};

// Stages 1-8 and micro-batches 1-32; virtual stages 1-4 for interleaved_1f1b, 1 for the others.
// What interleaved_1f1b accepts (validate_schedule_args): v = 1 at any p and m; v > 1 with p > 1
// and m % p == 0.
bool interleaved_accepts(const PipelineShape& s) {
  return s.virtual_stages == 1 || (s.num_stages > 1 && s.num_micro_batches % s.num_stages == 0);
}

std::vector<Scenario> scenarios(ScheduleKind kind) {
  std::vector<Scenario> out;
  const int max_virtual = kind == ScheduleKind::interleaved_1f1b ? 4 : 1;
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 32; ++m)
      for (int v = 1; v <= max_virtual; ++v)
        if (kind != ScheduleKind::interleaved_1f1b || interleaved_accepts({p, m, v}))
          out.push_back({kind, {p, m, v}});
  return out;
}

// Peak chunk-forwards held at once on rank r (a forward counts until its backward, or its
// backward_input, has run). Written from the papers, apart from schedules/.
int expected_peak(ScheduleKind kind, const PipelineShape& s, int r) {
  const int p = s.num_stages, m = s.num_micro_batches, v = s.virtual_stages;
  switch (kind) {
    case ScheduleKind::gpipe: return m;  // every forward before the first backward
    // DeepSpeed's TrainSchedule: p - r - 1 warm-up forwards plus the steady-state one.
    // ZB-H1 keeps 1F1B's warm-up and its B ends what 1F1B's backward ends (Qi et al. 2023,
    // section 3.1: "the same peak memory as 1F1B" counts activations this way).
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

// Peak chunk-forwards whose weight gradient has not run (their autograd graphs are alive). ZB-H1
// runs W of micro-batch k after B of k + r on rank r, so every rank reaches p once m >= p.
int expected_graphs(ScheduleKind kind, const PipelineShape& s, int r) {
  if (kind == ScheduleKind::zero_bubble) return std::min(s.num_micro_batches, s.num_stages);
  return expected_peak(kind, s, r);
}

ScheduleReport built_and_checked(ScheduleKind kind, const PipelineShape& shape) {
  return check_schedule(kind, shape, build_all_schedules(kind, shape));
}

std::string config_with_schedule(const std::string& name) {
  return R"({"train_micro_batch_size_per_gpu": 1, "pipeline": {"schedule": ")" + name + "\"}}";
}

}  // namespace

TEST_CASE("every schedule passes the checker, its bound and the papers' peaks") {
  for (ScheduleKind kind : kAllKinds) {
    for (const Scenario& s : scenarios(kind)) {
      const PipelineShape& shape = s.shape;
      CAPTURE(to_string(kind), shape.num_stages, shape.num_micro_batches, shape.virtual_stages);
      const auto lists = build_all_schedules(kind, shape);
      const ScheduleReport report = check_schedule(kind, shape, lists);
      REQUIRE(int(report.ranks.size()) == shape.num_stages);
      for (int r = 0; r < shape.num_stages; ++r) {
        CAPTURE(r);
        const MemoryBound bound = memory_bound(kind, shape, r);
        REQUIRE(bound.activations == expected_peak(kind, shape, r));
        REQUIRE(bound.graphs == expected_graphs(kind, shape, r));
        // The bound is reached, not just respected.
        REQUIRE(report.ranks[r].peak_activations == bound.activations);
        REQUIRE(report.ranks[r].peak_graphs == bound.graphs);
      }
    }
  }
}

TEST_CASE("zero_bubble holds at most p graphs on every rank, and exactly p once m >= p") {
  for (const Scenario& s : scenarios(ScheduleKind::zero_bubble)) {
    const int p = s.shape.num_stages, m = s.shape.num_micro_batches;
    CAPTURE(p, m);
    const ScheduleReport report = built_and_checked(ScheduleKind::zero_bubble, s.shape);
    for (int r = 0; r < p; ++r) {
      CAPTURE(r);
      REQUIRE(report.ranks[r].peak_graphs <= p);
      if (m >= p) REQUIRE(report.ranks[r].peak_graphs == p);
      // What deferring W costs over 1F1B on this rank: r more graphs once m >= p.
      REQUIRE(report.ranks[r].peak_graphs - report.ranks[r].peak_activations ==
              std::min(m, p) - std::min(m, p - r));
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
        const ScheduleReport report = built_and_checked(kind, s.shape);
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
    const ScheduleKind kind = ScheduleKind::interleaved_1f1b;
    for (const Scenario& s : scenarios(kind)) {
      const int p = s.shape.num_stages, m = s.shape.num_micro_batches;
      const int v = s.shape.virtual_stages;
      CAPTURE(p, m, v);
      const ScheduleReport report = built_and_checked(kind, s.shape);
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
      const ScheduleReport zb = built_and_checked(ScheduleKind::zero_bubble, s.shape);
      const ScheduleReport one_f_one_b = built_and_checked(ScheduleKind::one_f_one_b, s.shape);
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

TEST_CASE("a rank loads each micro-batch once, in order, even holding the first and last stage") {
  // The executor files the data iterator's next micro-batch under each load, so a second load of
  // one micro-batch on a rank would read another micro-batch's data.
  // One stage holds both (v = 1 there: interleaving needs several stages).
  for (const PipelineShape& shape : {PipelineShape{1, 4, 1}, PipelineShape{2, 4, 2},
                                     PipelineShape{3, 6, 1}, PipelineShape{4, 8, 3}}) {
    const ScheduleKind kind =
        shape.virtual_stages > 1 ? ScheduleKind::interleaved_1f1b : ScheduleKind::one_f_one_b;
    CAPTURE(shape.num_stages, shape.num_micro_batches, shape.virtual_stages);
    const auto lists = build_all_schedules(kind, shape);
    for (int r = 0; r < shape.num_stages; ++r) {
      std::vector<int> loaded;
      for (const Instruction& in : lists[r])
        if (in.op == Op::load_micro_batch) loaded.push_back(in.micro_batch);
      const bool loads = r == 0 || r == shape.rank_of(shape.num_global_stages() - 1);
      std::vector<int> expected;
      for (int mb = 0; loads && mb < shape.num_micro_batches; ++mb) expected.push_back(mb);
      CAPTURE(r);
      REQUIRE(loaded == expected);
    }
  }
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
             Contains("num_micro_batches: got 6") && Contains("multiple of num_stages (4)") &&
                 Contains("virtual_stages 2"));
  // The one owner of the rule (PipelineModule no longer checks it; the engine asks here).
  CHECK_THAT(error(ScheduleKind::interleaved_1f1b, {1, 4, 2}),
             Contains("virtual_stages: got 2 with num_stages 1") && Contains("expected 1"));
  CHECK_THAT(error(ScheduleKind::one_f_one_b, {4, 8, 1}, 4),
             Contains("rank: got 4") && Contains("0..3"));
  REQUIRE_THROWS_WITH(memory_bound(ScheduleKind::gpipe, {2, 4, 1}, -1),
                      Contains("rank: got -1") && Contains("0..1"));
}

TEST_CASE("interleaved_1f1b with one chunk per rank is 1F1B, at any number of micro-batches") {
  // Megatron-LM runs its plain 1F1B when no virtual pipeline size is set, with no m % p rule; a
  // config that names interleaved_1f1b and leaves virtual_stages at its default 1 gets the same.
  for (const PipelineShape& shape : {PipelineShape{2, 3, 1}, PipelineShape{4, 6, 1},
                                     PipelineShape{3, 1, 1}, PipelineShape{1, 5, 1}}) {
    CAPTURE(shape.num_stages, shape.num_micro_batches);
    REQUIRE(build_all_schedules(ScheduleKind::interleaved_1f1b, shape) ==
            build_all_schedules(ScheduleKind::one_f_one_b, shape));
    built_and_checked(ScheduleKind::interleaved_1f1b, shape);
  }
}

TEST_CASE("schedule names: one list, parsed both ways, named in the error") {
  REQUIRE(schedule_names().size() == std::size(kAllKinds));
  for (ScheduleKind kind : kAllKinds) {
    CAPTURE(to_string(kind));
    REQUIRE(std::count(schedule_names().begin(), schedule_names().end(), to_string(kind)) == 1);
    REQUIRE(parse_schedule_kind(to_string(kind)) == kind);
  }
  REQUIRE_THROWS_WITH(parse_schedule_kind("looped_bfs"),
                      "pipeline.schedule: got \"looped_bfs\", expected one of \"gpipe\", \"1f1b\", "
                      "\"interleaved_1f1b\", \"zero_bubble\"");
}

// runtime/config lists pipeline.schedule's values itself (it cannot include pipeline/). The
// config must accept each name pipeline/ knows and name exactly those in its error.
TEST_CASE("the config accepts exactly the schedules pipeline/ knows") {
  for (const std::string& name : schedule_names()) {
    CAPTURE(name);
    REQUIRE(parse_config(config_with_schedule(name), "x.json").pipeline.schedule == name);
  }
  std::string error = "<no error>";
  try {
    parse_config(config_with_schedule("no_such_schedule"), "x.json");
  } catch (const ConfigError& e) {
    error = e.what();
  }
  const std::string intro = "expected one of ";
  const size_t at = error.find(intro);
  INFO(error);
  REQUIRE(at != std::string::npos);
  std::set<std::string> allowed;  // "a", "b", ... after the intro
  for (size_t open = error.find('"', at); open != std::string::npos;
       open = error.find('"', error.find('"', open + 1) + 1)) {
    const size_t close = error.find('"', open + 1);
    REQUIRE(close != std::string::npos);
    allowed.insert(error.substr(open + 1, close - open - 1));
  }
  REQUIRE(allowed == std::set<std::string>(schedule_names().begin(), schedule_names().end()));
}

TEST_CASE("eval lists: every shape passes, forwards only, one unsent output, a full pipeline") {
  // Any number of micro-batches, also with chunks (training's interleaved order wants m % p == 0).
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 32; ++m)
      for (int v = 1; v <= (p > 1 ? 4 : 1); ++v) {
        const PipelineShape shape{p, m, v};
        CAPTURE(p, m, v);
        const auto lists = build_eval_schedules(shape);
        const ScheduleReport report = check_eval_schedule(shape, lists);
        for (int r = 0; r < p; ++r) {
          CAPTURE(r);
          const auto& list = lists[r];
          REQUIRE(std::count_if(list.begin(), list.end(),
                                [](const Instruction& i) { return i.op == Op::forward; }) == m * v);
          for (const Instruction& in : list)
            REQUIRE((in.op == Op::load_micro_batch || in.op == Op::forward ||
                     in.op == Op::send_activation || in.op == Op::receive_activation));
          // Every rank but the one holding only the last stage has outputs to send, one at a time.
          const bool sends = v > 1 || r < p - 1;
          REQUIRE(report.ranks[r].peak_activations == (sends ? 1 : 0));
          REQUIRE(report.ranks[r].peak_graphs == 0);
        }
        // Unit-cost forwards: the first micro-batch reaches rank p-1 after p-1 of them, and from
        // then on no rank waits when the groups are full, so (p-1)/(vm+p-1). A short last group
        // waits for its first micro-batch to come round.
        const double full = double(p - 1) / (v * m + p - 1);
        if (v == 1 || m % p == 0) {
          REQUIRE(report.bubble_fraction() == Approx(full).margin(1e-12));
        } else {
          REQUIRE(report.bubble_fraction() > full);
        }
      }
}

TEST_CASE("eval lists: micro-batches go through the chunks in groups of p") {
  const auto lists = build_eval_schedules({2, 3, 2});
  std::vector<std::pair<int, int>> forwards;  // rank 0's (micro-batch, chunk)
  for (const Instruction& in : lists[0])
    if (in.op == Op::forward) forwards.emplace_back(in.micro_batch, in.chunk);
  const std::vector<std::pair<int, int>> groups_of_two = {{0, 0}, {1, 0}, {0, 1},
                                                          {1, 1}, {2, 0}, {2, 1}};
  REQUIRE(forwards == groups_of_two);
}

TEST_CASE("eval lists: bad shapes name the argument") {
  REQUIRE_THROWS_WITH(build_eval_schedules({2, 0, 1}),
                      Catch::Matchers::Contains("num_micro_batches: got 0, expected >= 1"));
  REQUIRE_THROWS_WITH(build_eval_schedules({1, 4, 2}),
                      Catch::Matchers::Contains("virtual_stages: got 2 with num_stages 1") &&
                          Catch::Matchers::Contains("expected 1 for eval_batch's lists"));
}
