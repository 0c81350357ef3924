// ZB-H1's pass order: 1F1B's with each backward split in two and the weight halves deferred.
#include "pipeline/schedules/pass_order.h"

namespace zeroshard::pipeline::schedules {

// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1; the same order as
// torch.distributed.pipelining's ScheduleInterleavedZeroBubble with one chunk): 1F1B's order
// with each backward split into B (input gradient) and W (weight gradient), rank r running W of
// micro-batch k only after B of micro-batch k + r. Later ranks get their gradients sooner, so
// their deferred W's fill the cool-down bubble that earlier ranks wait in. B frees the
// activation as in 1F1B, so the peak stays at 1F1B's p - r; the bubble shrinks from
// (p-1)(F+B+W) to (p-1)(F+B-W).
PassOrder zero_bubble_order(const PipelineShape& shape, int rank) {
  PassOrder order;
  int next_weight = 0;
  for (Pass pass : one_f_one_b_order(shape, rank)) {
    if (pass.op == Op::forward) {
      order.push_back(pass);
      continue;
    }
    order.push_back({Op::backward_input, pass.micro_batch, 0});
    if (pass.micro_batch >= rank) order.push_back({Op::backward_weight, next_weight++, 0});
  }
  while (next_weight < shape.num_micro_batches)
    order.push_back({Op::backward_weight, next_weight++, 0});
  return order;
}

}  // namespace zeroshard::pipeline::schedules
