// What of a run's model and optimizer this rank holds, as entries a checkpoint writes and a load
// fills: for each parameter, the model copy ("param", the model dtype), the fp32 master values
// ("master", only where the shard keeps its own copy: 16-bit models) and each optimizer state
// (torch.optim's names), each a 1-D view of the live storage over the elements
// [tensor_begin, tensor_begin + numel) of the flattened parameter. A load writes into the views.
#pragma once
#include <ATen/core/Tensor.h>
#include <string>
#include <vector>
#include "zero/flat_group.h"
#include "zero/optimizer_shard.h"
#include "zero/strategy.h"

namespace zeroshard {

struct ShardEntry {
  std::string kind;          // "param", "master", or a state name ("exp_avg", ...)
  int64_t index = 0;         // numbered as FullValues does: trainable group by group, then frozen
  int64_t tensor_begin = 0;  // first element of the flattened parameter that `values` holds
  at::Tensor values;         // 1-D view of the live storage
  // Every rank holds these same elements (the model copy at stages 0-2, everything at stage 0):
  // a checkpoint writes a part from each rank, a load reads all of it.
  bool replicated = false;
};

// groups[i]'s shard is shards[i]; `frozen` (stage 3's partitioned frozen parameters) may be null.
// `with_state`: the optimizer state's entries too, created (torch's initial values) where no step
// has run yet, for a load to fill.
std::vector<ShardEntry> shard_entries(const std::vector<FlatGroup*>& groups,
                                      const std::vector<OptimizerShard*>& shards, FlatGroup* frozen,
                                      const ZeroStrategy& strategy, bool with_state);

}  // namespace zeroshard
