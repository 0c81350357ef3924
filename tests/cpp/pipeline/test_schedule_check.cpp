// The checker (pipeline/schedule_check.cpp): it measures what each rank holds and how long the
// step takes, holds the lists to their schedule's memory bound and to what the Python executor
// reads, and names where a broken list goes wrong: deadlocks, mismatched transfers, order; and
// eval_batch's lists to forwards only and one unsent output per rank.
#include <catch2/catch.hpp>

#include <algorithm>
#include <functional>
#include <string>

#include "pipeline/schedule_check.h"
#include "runtime/error.h"

using namespace zeroshard;
using namespace zeroshard::pipeline;

namespace {

using Lists = std::vector<std::vector<Instruction>>;

Lists with_tail(Lists lists) {
  for (auto& list : lists)
    for (Op op : {Op::reduce_tied, Op::reduce_data_parallel, Op::optimizer_step})
      list.push_back({op});
  return lists;
}

Instruction load(int mb, int chunk = 0) { return {Op::load_micro_batch, mb, chunk}; }
Instruction forward(int mb, int chunk = 0) { return {Op::forward, mb, chunk}; }
Instruction backward(int mb) { return {Op::backward, mb, 0}; }
Instruction backward_input(int mb) { return {Op::backward_input, mb, 0}; }
Instruction backward_weight(int mb) { return {Op::backward_weight, mb, 0}; }
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

// Takes `moved` out of the list and puts it back just before (or after) `anchor`.
void move_before(std::vector<Instruction>& list, const Instruction& moved,
                 const Instruction& anchor) {
  list.erase(list.begin() + index_of(list, moved));
  list.insert(list.begin() + index_of(list, anchor), moved);
}
void move_after(std::vector<Instruction>& list, const Instruction& moved,
                const Instruction& anchor) {
  list.erase(list.begin() + index_of(list, moved));
  list.insert(list.begin() + index_of(list, anchor) + 1, moved);
}

std::string at(int rank, size_t index, const Instruction& in) {
  return "rank " + std::to_string(rank) + " at instruction " + std::to_string(index) + " (" +
         describe(in) + ")";
}

// Two ranks, two micro-batches, 1F1B by hand: rank 1 takes micro-batch 1's activation before it
// sends micro-batch 0's gradient, the order in which rank 0 offers them.
Lists hand_1f1b() {
  return with_tail({
      {load(0), forward(0), send_activation(0, 1), load(1), forward(1), send_activation(1, 1),
       receive_gradient(0, 1), backward(0), receive_gradient(1, 1), backward(1)},
      {receive_activation(0, 0), load(0), forward(0), backward(0), receive_activation(1, 0),
       send_gradient(0, 0), load(1), forward(1), backward(1), send_gradient(1, 0)},
  });
}

// check_eval_schedule's error for `lists`, which must contain `text`.
void require_refused(const PipelineShape& shape, const Lists& lists, const std::string& text) {
  REQUIRE_THROWS_WITH(check_eval_schedule(shape, lists), Catch::Contains(text));
}

}  // namespace

TEST_CASE("the checker counts what each rank holds until backward and until the weight pass") {
  const ScheduleReport hand = simulate_schedule({2, 2, 1}, hand_1f1b());
  CHECK(hand.ranks[0].peak_activations == 2);
  CHECK(hand.ranks[1].peak_activations == 1);
  CHECK(hand.ranks[0].peak_graphs == 2);  // backward ends both
  CHECK(hand.ranks[1].peak_graphs == 1);
  // Zero bubble with every W moved to the end: B still frees the activation count, the graphs
  // wait for W, so each rank holds all m.
  const PipelineShape shape{2, 4, 1};
  auto lists = build_all_schedules(ScheduleKind::zero_bubble, shape);
  for (auto& list : lists)
    for (int mb = 0; mb < 4; ++mb) move_before(list, backward_weight(mb), {Op::reduce_tied});
  const ScheduleReport late = simulate_schedule(shape, lists);
  CHECK(late.ranks[0].peak_activations == 2);
  CHECK(late.ranks[1].peak_activations == 1);
  CHECK(late.ranks[0].peak_graphs == 4);
  CHECK(late.ranks[1].peak_graphs == 4);
}

TEST_CASE("the checker holds each rank to its schedule's memory bound") {
  using Catch::Contains;
  SECTION("gpipe's order checked as 1f1b") {
    const PipelineShape one{1, 4, 1};
    const auto lists = build_all_schedules(ScheduleKind::gpipe, one);
    REQUIRE_NOTHROW(check_schedule(ScheduleKind::gpipe, one, lists));
    REQUIRE_THROWS_WITH(
        check_schedule(ScheduleKind::one_f_one_b, one, lists),
        "pipeline schedule check: rank 0 instruction 3 (forward micro-batch 1 chunk 0): rank 0 "
        "holds 2 activations (forwards whose backward has not run), above schedule 1f1b's bound "
        "of 1 (p 1, m 4, v 1)");
    const PipelineShape four{4, 8, 1};
    REQUIRE_THROWS_WITH(check_schedule(ScheduleKind::one_f_one_b, four,
                                       build_all_schedules(ScheduleKind::gpipe, four)),
                        Contains("activations (forwards whose backward has not run), above "
                                 "schedule 1f1b's bound"));
  }
  SECTION("zero_bubble with its weight passes all at the end") {
    const PipelineShape shape{2, 4, 1};
    auto lists = build_all_schedules(ScheduleKind::zero_bubble, shape);
    for (auto& list : lists)
      for (int mb = 0; mb < 4; ++mb) move_before(list, backward_weight(mb), {Op::reduce_tied});
    REQUIRE_THROWS_WITH(check_schedule(ScheduleKind::zero_bubble, shape, lists),
                        Contains("holds 3 autograd graphs (forwards whose weight gradient has not "
                                 "run), above schedule zero_bubble's bound of 2 (p 2, m 4, v 1)"));
  }
}

TEST_CASE("the simulated makespan uses the caller's costs") {
  const PipelineShape shape{2, 2, 1};
  InstructionCosts costs;
  costs.forward = 2;
  costs.backward = 5;
  costs.communication = 0.5;
  const ScheduleReport report = check_schedule(
      ScheduleKind::gpipe, shape, build_all_schedules(ScheduleKind::gpipe, shape), costs);
  // Rank 0: F0 [0,2], hands activation 0 over by 2.5, F1 [2.5,4.5] while rank 1 runs F0, then
  // activation 1 by 5. Rank 1: F1 [5,7], B0 [7,12], gradient 0 by 12.5, B1 [12.5,17.5] while
  // rank 0 runs B0, gradient 1 by 18. Rank 0: B1 [18,23].
  REQUIRE(report.makespan == 23);
  REQUIRE(report.ranks[0].busy_time == 14);
}

TEST_CASE("the checker names every rank of a deadlock") {
  const PipelineShape two{2, 2, 1};
  auto lists = hand_1f1b();
  REQUIRE(check_schedule(ScheduleKind::one_f_one_b, two, lists).makespan == 9);
  SECTION("both ranks send first") {
    std::swap(lists[1][4], lists[1][5]);  // rank 1 sends its gradient before taking rank 0's send
    REQUIRE_THROWS_WITH(simulate_schedule(two, lists),
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
        simulate_schedule(three, built),
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
    REQUIRE_THROWS_WITH(simulate_schedule(shape, lists),
                        Contains("rank 2 instruction " + std::to_string(i) +
                                 " (forward micro-batch 0 chunk 0): runs before receiving its "
                                 "activation"));
  }
  SECTION("a backward before its forward") {
    const PipelineShape shape{2, 2, 1};
    auto lists = build_all_schedules(ScheduleKind::one_f_one_b, shape);
    const size_t f = index_of(lists[1], forward(1)), b = index_of(lists[1], backward(1));
    std::swap(lists[1][f], lists[1][b]);
    REQUIRE_THROWS_WITH(simulate_schedule(shape, lists),
                        Contains("rank 1 instruction " + std::to_string(f) +
                                 " (backward micro-batch 1 chunk 0): runs before its forward"));
  }
  SECTION("a micro-batch forwarded twice") {
    const PipelineShape shape{2, 3, 1};
    auto lists = build_all_schedules(ScheduleKind::gpipe, shape);
    const size_t f = index_of(lists[0], forward(1));
    lists[0].insert(lists[0].begin() + f + 1, forward(1));
    REQUIRE_THROWS_WITH(simulate_schedule(shape, lists),
                        Contains("rank 0 instruction " + std::to_string(f + 1) +
                                 " (forward micro-batch 1 chunk 0): the micro-batch is forwarded "
                                 "twice"));
  }
  SECTION("sends in another order than the receives") {
    auto lists = hand_1f1b();
    lists[0] = with_tail({{load(0), forward(0), load(1), forward(1), send_activation(1, 1),
                           send_activation(0, 1), receive_gradient(0, 1), backward(0),
                           receive_gradient(1, 1), backward(1)}})[0];
    REQUIRE_THROWS_WITH(simulate_schedule({2, 2, 1}, lists),
                        Contains("rank 0 instruction 4 (send_activation micro-batch 1") &&
                            Contains("receive_activation micro-batch 0 chunk 0 from rank 0") &&
                            Contains("same order"));
  }
  SECTION("a send to the wrong rank") {
    const PipelineShape shape{3, 2, 1};
    auto lists = build_all_schedules(ScheduleKind::one_f_one_b, shape);
    const size_t i = index_of(lists[0], send_activation(0, 1));
    lists[0][i].peer = 2;
    REQUIRE_THROWS_WITH(simulate_schedule(shape, lists),
                        Contains("rank 0 instruction " + std::to_string(i)) &&
                            Contains("stage 1 is on rank 1, not rank 2"));
  }
  SECTION("a micro-batch never backwarded, and a missing step") {
    auto lists = hand_1f1b();
    lists[0].erase(lists[0].begin() + 9);  // rank 0's backward of micro-batch 1
    REQUIRE_THROWS_WITH(simulate_schedule({2, 2, 1}, lists),
                        Contains("rank 0 chunk 0 micro-batch 1: no backward"));
    lists = hand_1f1b();
    lists[1].pop_back();
    REQUIRE_THROWS_WITH(simulate_schedule({2, 2, 1}, lists),
                        Contains("rank 1: the list must end with reduce_tied"));
  }
}

// python/zeroshard/pipe/executor.py keeps, per (micro-batch, chunk), what one instruction leaves
// for a later one; each row breaks one such hand-over in a list that is otherwise the builder's.
TEST_CASE("the checker holds the lists to what the executor reads") {
  struct Broken {
    const char* what;  // the executor's state that would be missing
    ScheduleKind kind;
    PipelineShape shape;
    std::function<void(Lists&)> mutate;
    std::string error;
  };
  const std::vector<Broken> rows = {
      {"outputs: receive_gradient sizes its tensors from the forward's", ScheduleKind::one_f_one_b,
       {2, 2, 1}, [](Lists& l) { move_before(l[0], receive_gradient(1, 1), forward(1)); },
       "(receive_gradient micro-batch 1 chunk 0 from rank 1): receives the gradient before its "
       "forward on this rank"},
      {"outputs: send_activation reads what backward drops", ScheduleKind::one_f_one_b,
       {2, 1, 1}, [](Lists& l) { move_after(l[0], send_activation(0, 1), backward(0)); },
       "deadlock: rank 0 at instruction 2 (receive_gradient micro-batch 0 chunk 0 from rank 1) "
       "waits for rank 1 to send it"},
      {"batches: the k-th load takes the data iterator's k-th micro-batch", ScheduleKind::gpipe,
       {2, 3, 1}, [](Lists& l) { move_before(l[0], load(1), load(0)); },
       "rank 0 instruction 0 (load_micro_batch micro-batch 1 chunk 0): loads out of order: "
       "expected micro-batch 0 (the executor gives each load the data iterator's next "
       "micro-batch)"},
      {"batches: one load per micro-batch and rank, first and last stage on one rank",
       ScheduleKind::one_f_one_b, {1, 2, 1},
       [](Lists& l) { l[0].insert(l[0].begin() + index_of(l[0], forward(1)), load(0)); },
       "(load_micro_batch micro-batch 0 chunk 0): loads the micro-batch twice on this rank"},
      {"batches: the labels before the last stage's forward", ScheduleKind::one_f_one_b,
       {2, 2, 1}, [](Lists& l) { move_after(l[1], load(1), forward(1)); },
       "(forward micro-batch 1 chunk 0): runs before its micro-batch is loaded"},
      {"inputs: receive_activation before the forward", ScheduleKind::one_f_one_b, {2, 2, 1},
       [](Lists& l) { move_after(l[1], receive_activation(0, 0), forward(0)); },
       "(forward micro-batch 0 chunk 0): runs before receiving its activation"},
      {"out_grads: receive_gradient before the backward", ScheduleKind::one_f_one_b, {3, 1, 1},
       [](Lists& l) { move_after(l[1], receive_gradient(0, 2), backward(0)); },
       "(backward micro-batch 0 chunk 0): runs before receiving its gradient"},
      {"in_grads: backward before send_gradient", ScheduleKind::one_f_one_b, {3, 1, 1},
       [](Lists& l) { move_before(l[1], send_gradient(0, 0), backward(0)); },
       "(send_gradient micro-batch 0 chunk 0 to rank 0): sends a gradient before its backward"},
      {"weight_passes: backward_input before backward_weight", ScheduleKind::zero_bubble,
       {2, 2, 1}, [](Lists& l) { move_before(l[1], backward_weight(0), backward_input(0)); },
       "(backward_weight micro-batch 0 chunk 0): runs without a backward_input before it"},
  };
  for (const Broken& row : rows) {
    CAPTURE(row.what);
    Lists lists = build_all_schedules(row.kind, row.shape);
    REQUIRE_NOTHROW(check_schedule(row.kind, row.shape, lists));
    row.mutate(lists);
    REQUIRE_THROWS_WITH(check_schedule(row.kind, row.shape, lists), Catch::Contains(row.error));
  }
}

TEST_CASE("the eval checker refuses what eval_batch cannot run") {
  const PipelineShape shape{2, 2, 1};
  const Lists good = {{load(0), forward(0), send_activation(0, 1), load(1), forward(1),
                       send_activation(1, 1)},
                      {receive_activation(0, 0), load(0), forward(0), receive_activation(1, 0),
                       load(1), forward(1)}};
  REQUIRE(check_eval_schedule(shape, good).ranks[0].peak_activations == 1);

  SECTION("a backward") {
    Lists lists = good;
    lists[1].push_back(backward(1));
    require_refused(shape, lists,
                    "rank 1 instruction 6 (backward micro-batch 1 chunk 0): eval_batch runs "
                    "loads, forwards and activation transfers only");
  }
  SECTION("a training step's tail") {
    Lists lists = good;
    for (auto& list : lists)
      for (Op op : {Op::reduce_tied, Op::reduce_data_parallel, Op::optimizer_step})
        list.push_back({op});
    require_refused(shape, lists, "(reduce_tied): eval_batch runs loads, forwards and activation");
  }
  SECTION("an output never sent") {
    require_refused(shape, {{load(0), forward(0), send_activation(0, 1), load(1), forward(1)},
                            {receive_activation(0, 0), load(0), forward(0), load(1)}},
                    "rank 0 chunk 0 micro-batch 1: no send_activation");
  }
  SECTION("two outputs held before their sends") {
    require_refused(shape, {{load(0), forward(0), load(1), forward(1), send_activation(0, 1),
                             send_activation(1, 1)},
                            {receive_activation(0, 0), load(0), forward(0),
                             receive_activation(1, 0), load(1), forward(1)}},
                    "rank 0 instruction 3 (forward micro-batch 1 chunk 0): rank 0 holds 2 forward "
                    "outputs not yet sent, above eval_batch's bound of 1");
  }
}

TEST_CASE("the eval checker: an output handed to the next chunk on the same rank is not held") {
  // build_eval_schedules refuses one rank with two chunks (chunks need ranks); a hand-written
  // list may have it, and its outputs never wait for a send.
  const Lists one_rank = {{load(0), forward(0, 0), forward(0, 1), load(1), forward(1, 0),
                           forward(1, 1)}};
  REQUIRE(check_eval_schedule({1, 2, 2}, one_rank).ranks[0].peak_activations == 0);
}
