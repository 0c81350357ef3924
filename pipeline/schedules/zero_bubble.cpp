// ZB-H1's pass order: 1F1B's with each backward split in two and the weight halves deferred.
#include "pipeline/schedules/pass_order.h"

#include <algorithm>

namespace zeroshard::pipeline::schedules {

// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1; the same order as
// torch.distributed.pipelining's ScheduleInterleavedZeroBubble with one chunk): 1F1B's order
// with each backward split into B (input gradient) and W (weight gradient), rank r running W of
// micro-batch k only after B of micro-batch k + r. Later ranks get their gradients sooner, so
// their deferred W's fill the cool-down bubble that earlier ranks wait in; the bubble shrinks
// from (p-1)(F+B+W) to (p-1)(F+B-W). The price is memory: each graph lives until its W
// (zero_bubble_bound).
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

// B frees what 1F1B's backward frees, so the activations are 1F1B's p - r. The graphs wait for W:
// in the steady state, when rank r starts forward p - r - 1 + k, W has run for micro-batches
// 0..k - r - 1 only (W of j follows B of j + r), so it holds p - r - 1 + k + 1 - (k - r) = p of
// them; with m < p every forward comes before the first W, m. So min(m, p) on every rank:
// deferring W trades the later ranks' smaller 1F1B peak for the bubble.
MemoryBound zero_bubble_bound(const PipelineShape& shape, int rank) {
  return {one_f_one_b_bound(shape, rank).activations,
          std::min(shape.num_micro_batches, shape.num_stages)};
}

}  // namespace zeroshard::pipeline::schedules
