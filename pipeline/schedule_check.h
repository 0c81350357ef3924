// Proves a set of per-rank instruction lists runnable before anything runs: no deadlock, every
// send meeting its receive, every micro-batch through every stage once and in order, what the
// Python executor reads there when it reads it, and (check_schedule) each rank's memory within
// its schedule's bound. Also measures them: peaks per rank and the simulated makespan.
#pragma once
#include <vector>

#include "pipeline/schedule.h"

namespace zeroshard::pipeline {

struct RankReport {
  int peak_activations = 0;  // chunk-forwards whose backward (or backward_input) had not run yet
  // Chunk-forwards whose weight gradient (backward, or backward_weight) had not run yet: their
  // autograd graphs, and the activations those keep, are alive. peak_activations but for
  // zero_bubble, whose B leaves the graph to W.
  int peak_graphs = 0;
  double busy_time = 0;  // time in compute passes
};

struct ScheduleReport {
  std::vector<RankReport> ranks;  // one per pipeline rank
  double makespan = 0;            // simulated end of the last rank's list
  // Share of the ranks' time spent waiting: 1 - sum(busy_time) / (p * makespan).
  double bubble_fraction() const;
};

// Runs all p lists (lists[r] is rank r's) in a simulation where a send completes only when its
// peer reaches the matching receive (rendezvous), so lists that pass also run with buffered
// sends, and with each receive's wait moved later to where its data is used (the Python runner
// does both: pipe/list_run.py says why that cannot deadlock). reduce_tied is treated as a
// collective of every rank. Throws UsageError on the first problem: a deadlock names each
// blocked rank, its instruction index and what it waits for; any other names the rank, the
// instruction and the rule it breaks. For lists of no particular schedule (written by hand, or
// re-simulated at measured costs).
ScheduleReport simulate_schedule(const PipelineShape& shape,
                                 const std::vector<std::vector<Instruction>>& lists,
                                 const InstructionCosts& costs = {});

// simulate_schedule, also holding every rank's peak_activations and peak_graphs to
// memory_bound(kind, shape, rank): an error names the rank, the forward that goes over, the
// schedule, the count and the bound. What lists pass before the engine runs them.
ScheduleReport check_schedule(ScheduleKind kind, const PipelineShape& shape,
                              const std::vector<std::vector<Instruction>>& lists,
                              const InstructionCosts& costs = {});

// eval_batch's lists (build_eval_schedules): simulate_schedule's rules for lists of loads,
// activation receives, forwards and activation sends only, with no reductions at the end, each
// micro-batch forwarded on every stage and sent on. Each rank holds at most one output not yet
// sent (peak_activations counts those here; peak_graphs stays 0, nothing is kept for backward).
ScheduleReport check_eval_schedule(const PipelineShape& shape,
                                   const std::vector<std::vector<Instruction>>& lists,
                                   const InstructionCosts& costs = {});

}  // namespace zeroshard::pipeline
