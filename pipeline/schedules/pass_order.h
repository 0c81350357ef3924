// Internal to pipeline/: each schedule's per-rank order of compute passes (the part the papers
// define) and the memory that order holds, one file per schedule in this folder, chosen by
// pass_order() and memory_bound(). schedule.cpp then places every send and receive around these
// passes, the same for all schedules.
#pragma once
#include <vector>

#include "pipeline/schedule.h"

namespace zeroshard::pipeline::schedules {

// A compute pass: forward, backward, backward_input or backward_weight.
struct Pass {
  Op op;
  int micro_batch;
  int chunk;
};
using PassOrder = std::vector<Pass>;

PassOrder gpipe_order(const PipelineShape& shape);                 // gpipe.cpp
PassOrder one_f_one_b_order(const PipelineShape& shape, int rank);  // one_f_one_b.cpp, any v
PassOrder zero_bubble_order(const PipelineShape& shape, int rank);  // zero_bubble.cpp
PassOrder forward_only_order(const PipelineShape& shape);           // forward_only.cpp: eval

// Beside each order, the most it holds on a rank (schedule.h's MemoryBound).
MemoryBound gpipe_bound(const PipelineShape& shape);
MemoryBound one_f_one_b_bound(const PipelineShape& shape, int rank);
MemoryBound zero_bubble_bound(const PipelineShape& shape, int rank);

// The one place that maps a ScheduleKind to its order and bound (pass_order.cpp); both expect
// arguments that passed validate_schedule_args.
PassOrder pass_order(ScheduleKind kind, const PipelineShape& shape, int rank);
MemoryBound memory_bound(ScheduleKind kind, const PipelineShape& shape, int rank);

}  // namespace zeroshard::pipeline::schedules
