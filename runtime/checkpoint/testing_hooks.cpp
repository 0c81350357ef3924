// The one instance of the test-only hooks (testing_hooks.h).
#include "runtime/checkpoint/testing_hooks.h"

namespace zeroshard::checkpoint::testing {

Hooks& hooks() {
  static Hooks instance;
  return instance;
}

void reached(const std::string& point) {
  if (hooks().at_point) hooks().at_point(point);
}

}  // namespace zeroshard::checkpoint::testing
