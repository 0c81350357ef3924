// Gradient buckets: contiguous runs of parameters in a group's flat layout, at most bucket_numel
// elements, built from the last parameter backwards (the order backward produces gradients).
// A parameter larger than a bucket gets one of its own. Shared by every gradient reducer.
#pragma once
#include <cstdint>
#include <vector>

#include "runtime/shard.h"

namespace zeroshard {

struct BucketSpec {
  int64_t group = 0;
  int64_t first_param = 0;   // index within the group
  int64_t end_param = 0;     // exclusive
  int64_t offset = 0;        // start in the group's flat buffer
  int64_t numel = 0;
  int64_t num_params() const { return end_param - first_param; }
};

struct BucketPlan {
  std::vector<BucketSpec> buckets;          // in the order they are expected to fill
  std::vector<int64_t> bucket_of_param;     // global parameter index (groups in order) -> bucket
  std::vector<int64_t> param_offset;        // global parameter index -> offset in its group buffer
  int64_t max_bucket_numel = 0;
};

BucketPlan plan_buckets(const std::vector<const FlatLayout*>& layouts, int64_t bucket_numel);

}  // namespace zeroshard
