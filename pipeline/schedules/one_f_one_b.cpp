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

// Chunk-forwards before the first backward. With v = 1 DeepSpeed's TrainSchedule, p - r - 1;
// with v > 1 Megatron-LM's interleaved warm-up, 2(p - r - 1) + (v - 1)p.
int ideal_warmup(const PipelineShape& shape, int rank) {
  const int p = shape.num_stages, v = shape.virtual_stages;
  return v == 1 ? p - rank - 1 : 2 * (p - rank - 1) + (v - 1) * p;
}

}  // namespace

// Warm-up forwards, then one forward and one backward at a time, then the remaining backwards.
// With v = 1 this is DeepSpeed's TrainSchedule, with v > 1 Megatron-LM's interleaved schedule.
PassOrder one_f_one_b_order(const PipelineShape& shape, int rank) {
  const int total = shape.virtual_stages * shape.num_micro_batches;
  const int warmup = std::min(ideal_warmup(shape, rank), total);
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

// The warm-up forwards plus the steady state's one, as long as there are that many: p - r with
// v = 1. With v > 1, on rank 0 that is p + (p - 1)/v stages' worth of activations (each
// chunk-forward holds 1/v of a stage's), the p(1 + (p - 1)/(p v)) of Korthikanti et al. 2022
// ("Reducing Activation Recomputation in Large Transformer Models", section 4.2.3).
MemoryBound one_f_one_b_bound(const PipelineShape& shape, int rank) {
  const int held = std::min(ideal_warmup(shape, rank) + 1,
                            shape.virtual_stages * shape.num_micro_batches);
  return {held, held};
}

}  // namespace zeroshard::pipeline::schedules
