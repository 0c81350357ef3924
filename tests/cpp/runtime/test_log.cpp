// The warning channel (runtime/log.cpp): warnings reach the sink set with set_warning_sink,
// kernels/ ones (kernels/warn.h, which cannot include the runtime's logger) included.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu_isa.h"
#include "runtime/log.h"

using namespace zeroshard;

namespace {

// Collects the warnings of one test; standard error is the sink again afterwards.
struct CapturedWarnings {
  std::vector<std::string> messages;
  CapturedWarnings() {
    set_warning_sink([this](const std::string& m) { messages.push_back(m); });
  }
  ~CapturedWarnings() { set_warning_sink(nullptr); }
};

// Sets an environment variable for one test and puts back what was there.
struct ScopedEnv {
  std::string name;
  std::optional<std::string> saved;
  ScopedEnv(const char* n, const char* value) : name(n) {
    if (const char* old = std::getenv(n)) saved = old;
    setenv(n, value, 1);
  }
  ~ScopedEnv() {
    if (saved) setenv(name.c_str(), saved->c_str(), 1);
    else unsetenv(name.c_str());
  }
};

}  // namespace

TEST_CASE("warn goes to the sink", "[log]") {
  CapturedWarnings captured;
  warn("rank 0: module order changed");
  REQUIRE(captured.messages == std::vector<std::string>{"rank 0: module order changed"});
}

TEST_CASE("a bad ZEROSHARD_CPU_ISA reaches the sink set through set_warning_sink", "[log]") {
  CapturedWarnings captured;
  ScopedEnv env("ZEROSHARD_CPU_ISA", "sse9");
  const kernels::Isa best = kernels::best_cpu_isa();
  REQUIRE(kernels::cpu_isa_from_env() == best);
  REQUIRE(captured.messages ==
          std::vector<std::string>{std::string("ZEROSHARD_CPU_ISA=sse9: expected one of scalar, "
                                               "avx2, avx512; using ") + kernels::isa_name(best)});
}
