// What differs between ZeRO stages, behind one small interface. make_strategy() is the only code
// that looks at zero_optimization.stage; everything else asks the strategy.
#pragma once
#include <memory>

#include "runtime/comm.h"
#include "runtime/config/config.h"
#include "runtime/memory.h"
#include "zero/flat_group.h"
#include "zero/grad_reducer.h"
#include "zero/reducer.h"

namespace zeroshard {

class ZeroStrategy {
 public:
  virtual ~ZeroStrategy() = default;
  virtual int64_t stage() const = 0;
  // True when each rank owns only its slice of master weights and optimizer state, so gradient
  // norms and overflow flags need a reduction across ranks.
  virtual bool shards_optimizer_state() const = 0;
  // True when each rank keeps full gradients (param.grad views into a flat buffer, reduced at the
  // accumulation boundary); false when only the owned shard is kept, reduced every micro-step.
  virtual bool keeps_full_grads() const = 0;
  // True when each rank keeps only its chunks of every parameter (stage 3).
  virtual bool partitions_params() const { return false; }
  virtual std::unique_ptr<Reducer> make_reducer(const std::vector<FlatGroup*>& groups,
                                                std::shared_ptr<Comm> comm,
                                                const ReduceOptions& options,
                                                MemoryAccount& memory) const = 0;
  // After the owned range was updated, brings every rank's full parameters up to date.
  virtual void sync_params(FlatGroup& group, Comm& comm) = 0;
};

// Refuses what the zero_optimization block asks for and this build cannot do (NVMe offload,
// optimizer offload at stage 0, parameter offload below stage 3), naming the keys. The engine
// and zero.Init call it before they touch the model; make_strategy too.
void require_buildable(const ZeroConfig& config);
std::unique_ptr<ZeroStrategy> make_strategy(const ZeroConfig& config);

// One per stage file.
std::unique_ptr<ZeroStrategy> make_stage0();
std::unique_ptr<ZeroStrategy> make_stage1();
std::unique_ptr<ZeroStrategy> make_stage2();
std::unique_ptr<ZeroStrategy> make_stage3();

// Shared by the stages that shard parameters' optimizer state but keep full parameters (1 and 2):
// shares every rank's updated owned range so every rank holds the full parameters again.
void all_gather_updated_params(FlatGroup& group, Comm& comm);

}  // namespace zeroshard
