// When frozen parameters may be released early (zero/frozen_release.cpp), at world 1-3 in the
// in-process world: only in the engine's backward with grad mode off, and only for forwards
// that every rank tracks.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "runtime/in_process_world.h"
#include "zero/frozen_release.h"

using namespace zeroshard;

namespace {

// One rank's answers. `odd_rank` tracks its second forward differently (its graph differed).
std::vector<int64_t> answers(int rank, std::shared_ptr<Comm> comm, int odd_rank) {
  FrozenRelease f(std::move(comm), c10::Device("cpu"));
  std::vector<int64_t> seen;
  const int64_t first = f.record(true);
  const int64_t second = f.record(rank != odd_rank);
  seen.push_back(f.may_arm(first, false));        // before backward: never
  f.begin_backward();
  seen.push_back(f.may_arm(first, false));
  seen.push_back(f.may_arm(second, false));
  seen.push_back(f.may_arm(first, true));         // a backward that builds a graph: never
  seen.push_back(f.may_arm(FrozenRelease::kNever, false));
  // A recomputation within backward: compared on its own.
  seen.push_back(f.may_arm(f.agree_now(true), false));
  seen.push_back(f.may_arm(f.agree_now(rank != odd_rank), false));
  // The forwards of the next iteration are a new set.
  const int64_t next = f.record(true);
  f.end_backward();
  seen.push_back(f.may_arm(first, false));        // after the engine's backward: never
  f.begin_backward();
  seen.push_back(f.may_arm(next, false));
  return seen;
}

}  // namespace

TEST_CASE("frozen parameters are released early only where every rank tracks the same forwards") {
  for (int world = 1; world <= 3; ++world) {
    for (int odd_rank : {-1, world - 1}) {
      CAPTURE(world, odd_rank);
      const bool agree = odd_rank < 0 || world == 1;
      // world 1: "every rank" is the one rank, whatever it tracks.
      const std::vector<int64_t> want = {0, agree, agree, 0, 0, 1, agree, 0, 1};
      auto got = run_in_process_world<std::vector<int64_t>>(
          world, [&](int rank, std::shared_ptr<Comm> comm) { return answers(rank, comm, odd_rank); });
      for (const auto& seen : got) REQUIRE(seen == want);
    }
  }
}
