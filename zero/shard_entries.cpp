#include "zero/shard_entries.h"

namespace zeroshard {

namespace {

// The model copy of tensor i: this rank's chunk (stage 3) or the whole tensor (stages 0-2).
void add_model_copy(FlatGroup& g, int64_t i, int64_t index, std::vector<ShardEntry>& out) {
  if (g.partitioned()) {
    const auto piece = g.owned_piece(i);
    if (!piece) return;
    out.push_back({"param", index, piece->tensor_begin, g.params().narrow(0, piece->buffer_begin, piece->numel),
                   false});
    return;
  }
  const FlatLayout& layout = g.layout();
  out.push_back({"param", index, 0, g.params().narrow(0, layout.offsets[size_t(i)], layout.numels[size_t(i)]),
                 true});
}

}  // namespace

std::vector<ShardEntry> shard_entries(const std::vector<FlatGroup*>& groups,
                                      const std::vector<OptimizerShard*>& shards, FlatGroup* frozen,
                                      const ZeroStrategy& strategy, bool with_state) {
  std::vector<ShardEntry> out;
  const bool replicated = !strategy.shards_optimizer_state();
  int64_t index = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    FlatGroup& g = *groups[gi];
    OptimizerShard& shard = *shards[gi];
    const bool state = with_state || shard.has_state();
    if (state) shard.create_state();  // on every rank, also one that owns no tensor of the group
    for (int64_t i = 0; i < g.num_tensors(); ++i, ++index) {
      add_model_copy(g, i, index, out);
      const auto piece = g.owned_piece(i);
      if (!piece) continue;
      const int64_t b = piece->buffer_begin, n = piece->numel;
      if (!shard.shares_model_copy(b, n)) {
        out.push_back({"master", index, piece->tensor_begin, shard.master(b, n), replicated});
      }
      if (!state) continue;
      const auto& names = shard.row().state_names;
      for (size_t s = 0; s < names.size(); ++s) {
        out.push_back({names[s], index, piece->tensor_begin, shard.state(s, b, n), replicated});
      }
    }
  }
  if (frozen) {
    for (int64_t i = 0; i < frozen->num_tensors(); ++i, ++index) add_model_copy(*frozen, i, index, out);
  }
  return out;
}

}  // namespace zeroshard
