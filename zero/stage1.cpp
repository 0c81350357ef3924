// ZeRO stage 1: master weights and optimizer state are sharded; rank r updates only its slice of
// the flat buffer, then an all-gather hands every rank the full updated parameters.
#include "zero/strategy.h"

#include "runtime/error.h"

namespace zeroshard {
namespace {
class Stage1 final : public ZeroStrategy {
 public:
  int64_t stage() const override { return 1; }
  bool shards_optimizer_state() const override { return true; }
  void sync_params(FlatGroup& group, Comm& comm) override {
    if (comm.world_size() == 1) return;
    const ShardRange own = group.owned();
    at::Tensor flat = group.params();
    // Waited here: the next forward reads every parameter.
    comm.all_gather(flat, flat.narrow(0, own.begin, own.numel()), "updated parameters").wait();
  }
};
}  // namespace

std::unique_ptr<ZeroStrategy> make_stage1() { return std::make_unique<Stage1>(); }

}  // namespace zeroshard
