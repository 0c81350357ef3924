// What differs between ZeRO stages, behind one small interface. make_strategy() is the only code
// that looks at zero_optimization.stage; everything else asks the strategy.
#pragma once
#include <memory>

#include "runtime/comm.h"
#include "runtime/config/config.h"
#include "zero/flat_group.h"

namespace zeroshard {

class ZeroStrategy {
 public:
  virtual ~ZeroStrategy() = default;
  virtual int64_t stage() const = 0;
  // True when each rank owns only its slice of master weights and optimizer state, so gradient
  // norms and overflow flags need a reduction across ranks.
  virtual bool shards_optimizer_state() const = 0;
  // After the owned range was updated, brings every rank's full parameters up to date.
  virtual void sync_params(FlatGroup& group, Comm& comm) = 0;
};

std::unique_ptr<ZeroStrategy> make_strategy(const ZeroConfig& config);

// One per stage file.
std::unique_ptr<ZeroStrategy> make_stage0();
std::unique_ptr<ZeroStrategy> make_stage1();

}  // namespace zeroshard
