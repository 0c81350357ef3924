// eval_batch's lists (build_eval_schedules, check_eval_schedule): every shape passes the checker
// with forwards only, holds at most one unsent output per rank, keeps the pipeline full (the
// forward-only bubble of p ranks and v chunks), and broken eval lists are refused by name.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>

#include "pipeline/schedule_check.h"
#include "runtime/error.h"

using namespace zeroshard;
using namespace zeroshard::pipeline;

namespace {

using Lists = std::vector<std::vector<Instruction>>;

Instruction load(int mb) { return {Op::load_micro_batch, mb, 0}; }
Instruction forward(int mb) { return {Op::forward, mb, 0}; }
Instruction send(int mb, int peer) { return {Op::send_activation, mb, 0, peer}; }
Instruction receive(int mb, int peer) { return {Op::receive_activation, mb, 0, peer}; }

void require_refused(const PipelineShape& shape, const Lists& lists, const std::string& text) {
  try {
    check_eval_schedule(shape, lists);
    FAIL("accepted: expected an error containing \"" << text << "\"");
  } catch (const UsageError& e) {
    REQUIRE_THAT(e.what(), Catch::Matchers::Contains(text));
  }
}

}  // namespace

TEST_CASE("eval lists: every shape passes, forwards only, one unsent output, a full pipeline") {
  // Any number of micro-batches, also with chunks (training's interleaved order wants m % p == 0).
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 32; ++m)
      for (int v = 1; v <= (p > 1 ? 4 : 1); ++v) {
        const PipelineShape shape{p, m, v};
        CAPTURE(p, m, v);
        const Lists lists = build_eval_schedules(shape);
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
  const Lists lists = build_eval_schedules({2, 3, 2});
  std::vector<std::pair<int, int>> forwards;  // rank 0's (micro-batch, chunk)
  for (const Instruction& in : lists[0])
    if (in.op == Op::forward) forwards.emplace_back(in.micro_batch, in.chunk);
  REQUIRE(forwards == std::vector<std::pair<int, int>>{{0, 0}, {1, 0}, {0, 1}, {1, 1}, {2, 0}, {2, 1}});
}

TEST_CASE("eval lists: bad shapes name the argument") {
  REQUIRE_THROWS_WITH(build_eval_schedules({2, 0, 1}),
                      Catch::Matchers::Contains("num_micro_batches: got 0, expected >= 1"));
  REQUIRE_THROWS_WITH(build_eval_schedules({1, 4, 2}),
                      Catch::Matchers::Contains("virtual_stages: got 2 with num_stages 1"));
}

TEST_CASE("the eval checker refuses what eval_batch cannot run") {
  const PipelineShape shape{2, 2, 1};
  const Lists good = {{load(0), forward(0), send(0, 1), load(1), forward(1), send(1, 1)},
                      {receive(0, 0), load(0), forward(0), receive(1, 0), load(1), forward(1)}};
  REQUIRE(check_eval_schedule(shape, good).ranks[0].peak_activations == 1);

  SECTION("a backward") {
    Lists lists = good;
    lists[1].push_back({Op::backward, 1, 0});
    require_refused(shape, lists, "rank 1 instruction 6 (backward micro-batch 1 chunk 0): eval_batch runs "
                                  "loads, forwards and activation transfers only");
  }
  SECTION("a training step's tail") {
    Lists lists = good;
    for (auto& list : lists)
      for (Op op : {Op::reduce_tied, Op::reduce_data_parallel, Op::optimizer_step}) list.push_back({op});
    require_refused(shape, lists, "(reduce_tied): eval_batch runs loads, forwards and activation");
  }
  SECTION("an output never sent") {
    require_refused(shape, {{load(0), forward(0), send(0, 1), load(1), forward(1)},
                            {receive(0, 0), load(0), forward(0), load(1)}},
                    "rank 0 chunk 0 micro-batch 1: no send_activation");
  }
  SECTION("two outputs held before their sends") {
    require_refused(shape, {{load(0), forward(0), load(1), forward(1), send(0, 1), send(1, 1)},
                            {receive(0, 0), load(0), forward(0), receive(1, 0), load(1), forward(1)}},
                    "rank 0 instruction 3 (forward micro-batch 1 chunk 0): rank 0 holds 2 forward outputs "
                    "not yet sent, above eval_batch's bound of 1");
  }
}
