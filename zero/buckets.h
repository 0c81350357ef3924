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

// reduce_bucket_size is an upper bound. Stages 0-1 reduce gradients in place in slices of the flat
// buffer, so a bucket costs no memory, but DeepSpeed's default (5e8) would make one bucket that can
// only start after backward ends: capped at 25M elements, so reduction overlaps backward. (DDP's
// cap is 25 MiB, 6.5M fp32 elements; that cap measured no faster here, 19 buckets instead of 4.)
// Stages 2-3 stage each bucket in buffers of its size, so their cap also bounds that memory: 8M
// elements in all, about one transformer layer of a 100M model, in one buffer, or with
// overlap_comm in two of 4M (a larger parameter gets a bucket of its own size). On the 100M GPT
// of bench/zero_step.py, two of 8M put stage 3's peak heap rise level with FSDP2's (1.00), two of
// 4M at 0.97 (bench/RESULTS.md).
constexpr int64_t kInPlaceBucketNumel = 25000000;
constexpr int64_t kStagedBucketNumel = 8000000;

// The bucket size the reducers use: the config's reduce_bucket_size under the cap above for
// full-gradient stages (`full_grads`) or staged ones with and without overlap_comm. The memory
// planner (python/zeroshard/planner) reads it through the binding, so this is its one owner.
inline int64_t effective_bucket_numel(int64_t reduce_bucket_size, bool full_grads, bool overlap_comm) {
  const int64_t cap = full_grads ? kInPlaceBucketNumel : overlap_comm ? kStagedBucketNumel / 2 : kStagedBucketNumel;
  return reduce_bucket_size < cap ? reduce_bucket_size : cap;
}

}  // namespace zeroshard
