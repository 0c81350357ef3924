// The stage factory: the one switch on zero_optimization.stage.
#include "zero/strategy.h"

#include "runtime/error.h"

namespace zeroshard {

std::unique_ptr<ZeroStrategy> make_strategy(const ZeroConfig& config) {
  switch (config.stage) {
    case 0: return make_stage0();
    case 1: return make_stage1();
    case 2: return make_stage2();
    case 3: return make_stage3();
    default:
      throw ConfigError(detail::cat("zero_optimization.stage: got ", config.stage,
                                    ", expected one of 0, 1, 2, 3"));
  }
}

void all_gather_updated_params(FlatGroup& group, Comm& comm) {
  if (comm.world_size() == 1) return;
  const ShardRange own = group.owned();
  at::Tensor flat = group.params();
  // Waited here: the next forward reads every parameter.
  comm.all_gather(flat, flat.narrow(0, own.begin, own.numel()), "updated parameters").wait();
}

}  // namespace zeroshard
