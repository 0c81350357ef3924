// ZeRO stage 1: master weights and optimizer state are sharded; gradients stay whole and are
// all-reduced at the accumulation boundary. Rank r updates only its slice of the flat buffer, then
// an all-gather hands every rank the full updated parameters.
#include "zero/strategy.h"

namespace zeroshard {
namespace {
class Stage1 final : public ZeroStrategy {
 public:
  int64_t stage() const override { return 1; }
  bool shards_optimizer_state() const override { return true; }
  bool keeps_full_grads() const override { return true; }
  std::unique_ptr<Reducer> make_reducer(const std::vector<FlatGroup*>& groups,
                                        std::shared_ptr<Comm> comm, const ReduceOptions& options,
                                        MemoryAccount& memory) const override {
    return std::make_unique<GradReducer>(groups, std::move(comm), options, memory);
  }
  void sync_params(FlatGroup& group, Comm& comm) override { all_gather_updated_params(group, comm); }
};
}  // namespace

std::unique_ptr<ZeroStrategy> make_stage1() { return std::make_unique<Stage1>(); }

}  // namespace zeroshard
