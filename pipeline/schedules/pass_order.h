// Internal to pipeline/: each schedule's per-rank order of compute passes (the part the papers
// define), one file per schedule in this folder, chosen by pass_order(). schedule.cpp then places
// every send and receive around these passes, the same for all schedules.
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

// The one place that maps a ScheduleKind to its order (pass_order.cpp); expects arguments that
// passed validate_schedule_args.
PassOrder pass_order(ScheduleKind kind, const PipelineShape& shape, int rank);

}  // namespace zeroshard::pipeline::schedules
