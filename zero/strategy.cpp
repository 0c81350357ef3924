// The stage factory: the one switch on zero_optimization.stage.
#include "zero/strategy.h"

#include <utility>

#include "runtime/error.h"

namespace zeroshard {

void require_buildable(const ZeroConfig& config) {
  const OffloadOptimizerConfig& opt = config.offload_optimizer;
  const OffloadParamConfig& param = config.offload_param;
  if (opt.device != "none" && config.stage == 0) {
    throw ConfigError(detail::cat("zero_optimization.offload_optimizer.device: got \"", opt.device,
                                  "\" at stage 0; optimizer offload moves a rank's shard of the "
                                  "optimizer, so it needs stage 1, 2 or 3"));
  }
  if (param.device != "none" && config.stage != 3) {
    throw ConfigError(detail::cat("zero_optimization.offload_param.device: got \"", param.device, "\" at stage ",
                                  config.stage, "; parameter offload needs stage 3 (only stage 3 "
                                  "partitions parameters, so only it can keep them off the device)"));
  }
}

std::unique_ptr<ZeroStrategy> make_strategy(const ZeroConfig& config) {
  require_buildable(config);
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
  const int64_t world = comm.world_size();
  if (world == 1) return;
  at::Tensor flat = group.params();
  const int64_t shard = group.layout().shard_numel();
  if (comm.backend() == "nccl") {
    // NCCL's in-place all-gather is the fastest form there.
    comm.all_gather(flat, flat.narrow(0, group.owned().begin, shard), "updated parameters").wait();
    return;
  }
  // Elsewhere (Gloo) each owner broadcasts its slice in place: Gloo's broadcast moves about three
  // times the bytes per second of its all-gather here (shared/reference/machine.md) and needs no
  // copy of the input. All are started before any is waited for, so they overlap.
  std::vector<CommWork> works;
  for (int64_t r = 0; r < world; ++r) {
    works.push_back(comm.broadcast(flat.narrow(0, r * shard, shard), int(r),
                                   detail::cat("updated parameters of rank ", r)));
  }
  // Waited here: the next forward reads every parameter.
  for (auto& w : works) w.wait();
}

}  // namespace zeroshard
