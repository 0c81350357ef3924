// ZeRO stage 0: plain data parallelism. Every rank holds everything and applies the same step to
// the same averaged gradients, so nothing needs gathering afterwards.
#include "zero/strategy.h"

namespace zeroshard {
namespace {
class Stage0 final : public ZeroStrategy {
 public:
  int64_t stage() const override { return 0; }
  bool shards_optimizer_state() const override { return false; }
  bool keeps_full_grads() const override { return true; }
  std::unique_ptr<Reducer> make_reducer(const std::vector<FlatGroup*>& groups,
                                        std::shared_ptr<Comm> comm, const ReduceOptions& options,
                                        MemoryAccount& memory) const override {
    return std::make_unique<GradReducer>(groups, std::move(comm), options, memory);
  }
  void sync_params(FlatGroup&, Comm&) override {}
};
}  // namespace

std::unique_ptr<ZeroStrategy> make_stage0() { return std::make_unique<Stage0>(); }

}  // namespace zeroshard
