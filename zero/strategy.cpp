// The stage factory: the one switch on zero_optimization.stage.
#include "zero/strategy.h"

#include "runtime/error.h"

namespace zeroshard {

std::unique_ptr<ZeroStrategy> make_strategy(const ZeroConfig& config) {
  switch (config.stage) {
    case 0: return make_stage0();
    case 1: return make_stage1();
    default:
      throw ConfigError(detail::cat("zero_optimization.stage: got ", config.stage,
                                    ", but this build implements stages 0 and 1 only"));
  }
}

}  // namespace zeroshard
