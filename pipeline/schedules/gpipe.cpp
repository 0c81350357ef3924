// GPipe's pass order: every forward, then every backward, the same on each rank.
#include "pipeline/schedules/pass_order.h"

namespace zeroshard::pipeline::schedules {

PassOrder gpipe_order(const PipelineShape& shape) {
  PassOrder order;
  for (int mb = 0; mb < shape.num_micro_batches; ++mb) order.push_back({Op::forward, mb, 0});
  for (int mb = 0; mb < shape.num_micro_batches; ++mb) order.push_back({Op::backward, mb, 0});
  return order;
}

// Every forward runs before the first backward: all m at once.
MemoryBound gpipe_bound(const PipelineShape& shape) {
  return {shape.num_micro_batches, shape.num_micro_batches};
}

}  // namespace zeroshard::pipeline::schedules
