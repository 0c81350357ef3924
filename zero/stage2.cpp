// ZeRO stage 2: gradients are sharded too. Each rank keeps only its owned gradient shard, fed every
// micro-step by the staged bucket reduction; the step and the parameter all-gather are stage 1's.
#include "zero/sharded_grad_reducer.h"
#include "zero/strategy.h"

namespace zeroshard {
namespace {
class Stage2 final : public ZeroStrategy {
 public:
  int64_t stage() const override { return 2; }
  bool shards_optimizer_state() const override { return true; }
  bool keeps_full_grads() const override { return false; }
  std::unique_ptr<Reducer> make_reducer(const std::vector<FlatGroup*>& groups,
                                        std::shared_ptr<Comm> comm, const ReduceOptions& options,
                                        MemoryAccount& memory) const override {
    return std::make_unique<ShardedGradReducer>(groups, std::move(comm), options, memory);
  }
  void sync_params(FlatGroup& group, Comm& comm) override { all_gather_updated_params(group, comm); }
};
}  // namespace

std::unique_ptr<ZeroStrategy> make_stage2() { return std::make_unique<Stage2>(); }

}  // namespace zeroshard
