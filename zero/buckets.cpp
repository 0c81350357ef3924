// Bucket planning; see buckets.h. Pure function, tested in tests/cpp/zero/test_buckets.cpp.
#include "zero/buckets.h"

#include <algorithm>

#include "runtime/error.h"

namespace zeroshard {

BucketPlan plan_buckets(const std::vector<const FlatLayout*>& layouts, int64_t bucket_numel) {
  if (bucket_numel <= 0) {
    throw ConfigError(detail::cat("zero_optimization.reduce_bucket_size: got ", bucket_numel,
                                  ", expected a positive number of elements"));
  }
  BucketPlan plan;
  int64_t base = 0;
  for (size_t g = 0; g < layouts.size(); ++g) {
    const FlatLayout& L = *layouts[g];
    const int64_t n = int64_t(L.numels.size());
    plan.bucket_of_param.resize(size_t(base + n), -1);
    for (int64_t i = 0; i < n; ++i) plan.param_offset.push_back(L.offsets[size_t(i)]);
    int64_t end = n;
    while (end > 0) {
      int64_t begin = end - 1;
      int64_t numel = L.numels[size_t(begin)];
      while (begin > 0 && numel + L.numels[size_t(begin - 1)] <= bucket_numel) {
        --begin;
        numel += L.numels[size_t(begin)];
      }
      const int64_t id = int64_t(plan.buckets.size());
      plan.buckets.push_back({int64_t(g), begin, end, L.offsets[size_t(begin)], numel});
      for (int64_t i = begin; i < end; ++i) plan.bucket_of_param[size_t(base + i)] = id;
      plan.max_bucket_numel = std::max(plan.max_bucket_numel, numel);
      end = begin;
    }
    base += n;
  }
  return plan;
}

}  // namespace zeroshard
