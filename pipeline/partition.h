// Splitting a model's layers among pipeline stages: DeepSpeed's partition_method 'parameters' and
// 'type:regex' (balanced by a weight per layer) and 'uniform' (by layer count). Pure C++, no Torch.
#pragma once
#include <vector>

namespace zeroshard::pipeline {

// Splits items 0..n-1 (layers, in order) into `parts` contiguous non-empty ranges so that the
// heaviest range is as light as possible. Returns parts+1 boundaries: part i is [b[i], b[i+1]).
//
// A part's weight is its items' weights added in order, in double; the returned split's heaviest
// part is the exact minimum of that over all splits, not an approximation.
// Among splits with that minimum it returns, in order of precedence:
//   1. the smallest sum of squared part weights (to a relative 1e-12, so that rounding never
//      decides): the stages off the bottleneck are balanced too ((4, 2, 2) rather than
//      (4, 3, 1)), since a stage's weight is its parameter memory and, in warm-up and
//      cool-down, its share of the bubble;
//   2. the smallest sum of squared item counts: zero-weight items (layers without parameters,
//      or those 'type:regex' does not match) still hold activations and take time, so they are
//      spread evenly rather than all left to the first or last stage;
//   3. the larger parts first (the lexicographically largest boundaries), as partition_uniform,
//      which all-equal or all-zero weights therefore reproduce.
// Takes O(parts * n * r), r the most consecutive items that fit in one part: O(parts * n^2) when
// most weights are zero. Throws UsageError unless 1 <= parts <= n and every weight is finite and
// >= 0 with a finite total.
std::vector<int> partition_balanced(const std::vector<double>& weights, int parts);

// DeepSpeed's 'uniform' (ds_utils.partition_uniform): balanced by item count, sizes differing by
// at most one, the larger parts first. Same boundaries convention. Throws UsageError unless
// 1 <= parts <= num_items.
std::vector<int> partition_uniform(int num_items, int parts);

}  // namespace zeroshard::pipeline
