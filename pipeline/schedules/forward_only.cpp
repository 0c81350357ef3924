// eval_batch's pass order: forwards only, the same on every rank.
#include "pipeline/schedules/pass_order.h"

#include <algorithm>

namespace zeroshard::pipeline::schedules {

// One chunk per rank: micro-batch after micro-batch. Several: Megatron-LM's interleaved forward
// order without its backwards. Micro-batches go in groups of p, each group through chunk 0, then
// chunk 1, and so on. Each rank then has the group's next forward to run while the group's first
// micro-batch goes round the other ranks; taking one micro-batch through every chunk before the
// next would leave all ranks but one idle. A last group of fewer than p goes the same way.
PassOrder forward_only_order(const PipelineShape& shape) {
  const int p = shape.num_stages, m = shape.num_micro_batches;
  PassOrder order;
  for (int first = 0; first < m; first += p)
    for (int chunk = 0; chunk < shape.virtual_stages; ++chunk)
      for (int mb = first; mb < std::min(first + p, m); ++mb)
        order.push_back({Op::forward, mb, chunk});
  return order;
}

}  // namespace zeroshard::pipeline::schedules
