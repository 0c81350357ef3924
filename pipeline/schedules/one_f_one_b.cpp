// 1F1B's pass order: DeepSpeed's TrainSchedule with one model chunk per rank, Megatron-LM's
// interleaved schedule with v > 1 (one function: the two differ only in warm-up and chunk order).
#include "pipeline/schedules/pass_order.h"

#include <algorithm>

namespace zeroshard::pipeline::schedules {

namespace {

// The k-th forward (or backward) of an interleaved rank, in Megatron-LM's order
// (forward_backward_pipelining_with_interleaving): micro-batches go through the chunks in groups
// of p, forwards chunk 0 first, backwards the last chunk first. With v = 1 this is micro-batch k.
Pass interleaved_pass(Op op, int k, const PipelineShape& shape) {
  const int p = shape.num_stages, v = shape.virtual_stages;
  const int group = k / (p * v), in_group = k % (p * v);
  int chunk = in_group / p;
  if (op != Op::forward) chunk = v - 1 - chunk;
  return {op, group * p + in_group % p, chunk};
}

}  // namespace

// Warm-up forwards, then one forward and one backward at a time, then the remaining backwards.
// With v = 1 this is DeepSpeed's TrainSchedule (p - r - 1 warm-up forwards on rank r, so rank r
// holds at most p - r activations). With v > 1 it is Megatron-LM's interleaved schedule, whose
// warm-up is 2(p - r - 1) + (v - 1)p chunk-forwards.
PassOrder one_f_one_b_order(const PipelineShape& shape, int rank) {
  const int p = shape.num_stages, v = shape.virtual_stages;
  const int total = v * shape.num_micro_batches;
  const int ideal_warmup = v == 1 ? p - rank - 1 : 2 * (p - rank - 1) + (v - 1) * p;
  const int warmup = std::min(ideal_warmup, total);
  PassOrder order;
  for (int k = 0; k < warmup; ++k) order.push_back(interleaved_pass(Op::forward, k, shape));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(interleaved_pass(Op::forward, k + warmup, shape));
    order.push_back(interleaved_pass(Op::backward, k, shape));
  }
  for (int k = std::max(total - warmup, 0); k < total; ++k)
    order.push_back(interleaved_pass(Op::backward, k, shape));
  return order;
}

}  // namespace zeroshard::pipeline::schedules
