// Proves a set of per-rank instruction lists runnable before anything runs: no deadlock, every
// send meeting its receive, every micro-batch through every stage once and in order. Also
// measures them: peak activations per rank and the simulated makespan, for the bubble.
#pragma once
#include <vector>

#include "pipeline/schedule.h"

namespace zeroshard::pipeline {

struct RankReport {
  int peak_activations = 0;  // chunk-forwards whose backward (or backward_input) had not run yet
  double busy_time = 0;      // time in compute passes
};

struct ScheduleReport {
  std::vector<RankReport> ranks;  // one per pipeline rank
  double makespan = 0;            // simulated end of the last rank's list
  // Share of the ranks' time spent waiting: 1 - sum(busy_time) / (p * makespan).
  double bubble_fraction() const;
};

// Runs all p lists (lists[r] is rank r's) in a simulation where a send completes only when its
// peer reaches the matching receive (rendezvous), so lists that pass also run with buffered
// sends. reduce_tied is treated as a collective of every rank. Throws UsageError on the first
// problem: a deadlock names each blocked rank, its instruction index and what it waits for; any
// other names the rank, the instruction and the rule it breaks.
ScheduleReport check_schedule(const PipelineShape& shape,
                              const std::vector<std::vector<Instruction>>& lists,
                              const InstructionCosts& costs = {});

}  // namespace zeroshard::pipeline
