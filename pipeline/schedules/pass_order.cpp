// The factory from ScheduleKind to a schedule's pass order and memory bound; the only switches
// on the kind.
#include "pipeline/schedules/pass_order.h"

#include "runtime/error.h"

namespace zeroshard::pipeline::schedules {

PassOrder pass_order(ScheduleKind kind, const PipelineShape& shape, int rank) {
  switch (kind) {
    case ScheduleKind::gpipe: return gpipe_order(shape);
    case ScheduleKind::one_f_one_b:
    case ScheduleKind::interleaved_1f1b: return one_f_one_b_order(shape, rank);
    case ScheduleKind::zero_bubble: return zero_bubble_order(shape, rank);
  }
  ZS_CHECK(false, "unknown schedule kind ", static_cast<int>(kind));
  return {};
}

MemoryBound memory_bound(ScheduleKind kind, const PipelineShape& shape, int rank) {
  switch (kind) {
    case ScheduleKind::gpipe: return gpipe_bound(shape);
    case ScheduleKind::one_f_one_b:
    case ScheduleKind::interleaved_1f1b: return one_f_one_b_bound(shape, rank);
    case ScheduleKind::zero_bubble: return zero_bubble_bound(shape, rank);
  }
  ZS_CHECK(false, "unknown schedule kind ", static_cast<int>(kind));
  return {};
}

}  // namespace zeroshard::pipeline::schedules
