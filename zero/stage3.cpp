// ZeRO stage 3: parameters are partitioned too. Each rank keeps its chunks of every parameter,
// master weights and optimizer state, and from backward to the step its gradient shard (16P/N
// bytes with bf16 at the peak); the coordinator gathers a module's parameters around its forward
// and backward, and gradients are reduce-scattered straight into the owned chunks.
#include "zero/scatter_grad_reducer.h"
#include "zero/strategy.h"

namespace zeroshard {
namespace {
class Stage3 final : public ZeroStrategy {
 public:
  int64_t stage() const override { return 3; }
  bool shards_optimizer_state() const override { return true; }
  bool keeps_full_grads() const override { return false; }
  bool partitions_params() const override { return true; }
  std::unique_ptr<Reducer> make_reducer(const std::vector<FlatGroup*>& groups,
                                        std::shared_ptr<Comm> comm, const ReduceOptions& options,
                                        MemoryAccount& memory) const override {
    return std::make_unique<ScatterGradReducer>(groups, std::move(comm), options, memory);
  }
  // Nothing to gather after the step: modules gather their parameters when they next run.
  void sync_params(FlatGroup&, Comm&) override {}
};
}  // namespace

std::unique_ptr<ZeroStrategy> make_stage3() { return std::make_unique<Stage3>(); }

}  // namespace zeroshard
