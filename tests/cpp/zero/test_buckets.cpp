// Bucket planning (zero/buckets.cpp): every parameter in exactly one bucket, buckets contiguous,
// within the size limit unless one parameter alone exceeds it, filled from the last parameter.
#include <catch2/catch.hpp>

#include "runtime/error.h"
#include "zero/buckets.h"

using namespace zeroshard;

TEST_CASE("buckets tile every group's parameters within the size limit") {
  const std::vector<std::vector<int64_t>> groups = {{5, 3, 100, 2, 2, 7}, {1}, {40, 40, 40}};
  for (int64_t limit : {1, 7, 10, 50, 1000}) {
    std::vector<FlatLayout> layouts;
    for (const auto& g : groups) layouts.push_back(make_flat_layout(g, 2, 16));
    std::vector<const FlatLayout*> ptrs;
    for (const auto& l : layouts) ptrs.push_back(&l);
    const BucketPlan plan = plan_buckets(ptrs, limit);
    int64_t base = 0;
    for (size_t g = 0; g < groups.size(); ++g) {
      int64_t expected_end = int64_t(groups[g].size());  // buckets run from the last parameter
      for (const auto& b : plan.buckets) {
        if (b.group != int64_t(g)) continue;
        REQUIRE(b.end_param == expected_end);
        int64_t numel = 0;
        for (int64_t i = b.first_param; i < b.end_param; ++i) {
          numel += groups[g][size_t(i)];
          REQUIRE(plan.bucket_of_param[size_t(base + i)] == &b - plan.buckets.data());
          REQUIRE(plan.param_offset[size_t(base + i)] == layouts[g].offsets[size_t(i)]);
        }
        REQUIRE(b.numel == numel);
        REQUIRE(b.offset == layouts[g].offsets[size_t(b.first_param)]);
        REQUIRE((numel <= limit || b.num_params() == 1));
        REQUIRE(plan.max_bucket_numel >= numel);
        expected_end = b.first_param;
      }
      REQUIRE(expected_end == 0);
      base += int64_t(groups[g].size());
    }
  }
}

TEST_CASE("a non-positive bucket size is refused with the config key") {
  FlatLayout l = make_flat_layout({4}, 1, 1);
  REQUIRE_THROWS_WITH(plan_buckets({&l}, 0),
                      "zero_optimization.reduce_bucket_size: got 0, expected a positive number of elements");
}
