// Splits layers among pipeline stages; see partition.h. The bottleneck weight is found first
// (a search over doubles with a greedy check), then a dynamic programme picks, among the splits
// that meet it, the one partition.h's tie-breaking rules prefer.
#include "pipeline/partition.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "runtime/error.h"

namespace zeroshard::pipeline {

namespace {

void require_parts(int parts, long long num_items, const char* items) {
  ZS_REQUIRE(parts >= 1, "parts: got ", parts, ", expected >= 1");
  ZS_REQUIRE(parts <= num_items, "parts: got ", parts, " for ", num_items, " ", items,
             ", expected at most the number of ", items, " (every part needs one)");
}

// Non-negative doubles order as their bit patterns do, so the search below can step through
// every double between two bounds.
std::uint64_t bits_of(double x) {
  std::uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
double double_of(std::uint64_t u) {
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Whether `weights` split into at most `parts` parts none heavier than `limit`. Greedy (each part
// takes items while its in-order sum stays <= limit) needs the fewest parts, because a range is
// never heavier than a range containing it: weights are >= 0 and rounding is monotone. At most
// `parts` is enough since n >= parts, and splitting a part further makes no part heavier.
bool fits(const std::vector<double>& weights, int parts, double limit) {
  int used = 1;
  double sum = 0;
  for (double w : weights) {
    if (w > limit) return false;
    if (sum + w > limit) {
      if (++used > parts) return false;
      sum = 0;
    }
    sum += w;
  }
  return true;
}

// The exact least achievable heaviest part: the smallest double `limit` for which `fits` holds.
// That is a part weight of an optimal split (one that fits with a smaller limit would be
// lighter), and 64 greedy passes over the bit patterns find it.
double min_bottleneck(const std::vector<double>& weights, int parts, double total) {
  std::uint64_t lo = 0, hi = bits_of(total);
  while (lo < hi) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    if (fits(weights, parts, double_of(mid)))
      hi = mid;
    else
      lo = mid + 1;
  }
  return double_of(lo);
}

// Tie-breaking rules 1 and 2 of partition.h, compared in that order. Sums of squares within a
// relative 1e-12 count as equal: they are added in a different order for different splits, and
// rounding must not decide between splits that exact arithmetic ties (the same part weights in
// another order), or rule 2 would never get to spread the zero-weight items.
struct Cost {
  double squared_weights = std::numeric_limits<double>::infinity();
  long long squared_counts = 0;
  bool operator<(const Cost& o) const {
    const double a = squared_weights, b = o.squared_weights;  // infinity: no split yet
    const bool tied = a == b || (std::isfinite(a - b) && std::abs(a - b) <= 1e-12 * std::max(a, b));
    if (!tied) return a < b;
    return squared_counts < o.squared_counts;
  }
  bool operator<=(const Cost& o) const { return !(o < *this); }
};

}  // namespace

std::vector<int> partition_balanced(const std::vector<double>& weights, int parts) {
  ZS_REQUIRE(weights.size() <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
             "weights: got ", weights.size(), " items, expected at most ",
             std::numeric_limits<int>::max());
  const int n = static_cast<int>(weights.size());
  require_parts(parts, n, "weights");
  double total = 0;
  for (int i = 0; i < n; ++i) {
    ZS_REQUIRE(std::isfinite(weights[i]) && weights[i] >= 0, "weights[", i, "]: got ", weights[i],
               ", expected a finite number >= 0");
    total += weights[i];
  }
  ZS_REQUIRE(std::isfinite(total), "weights: sum to ", total,
             ", expected a finite total (scale the weights down)");
  if (total == 0) total = 0;  // -0.0, whose bit pattern would not bound the search

  const double bottleneck = min_bottleneck(weights, parts, total);
  // A power of two near 1 / bottleneck: part weights scale exactly into [0, 2), so their squares
  // neither overflow nor vanish.
  const double scale = bottleneck > 0 ? std::ldexp(1.0, -std::ilogb(bottleneck)) : 0;

  // rest[i] (then best[i]): the least Cost of splitting items [i, n) into k - 1 (then k) parts
  // none heavier than the bottleneck; first_end[k][i]: where the first of those k parts ends.
  // Solved from the back so that the forward walk below can take the longest first part among
  // equal costs (rule 3).
  std::vector<Cost> rest(n + 1), best(n + 1);
  rest[n] = Cost{0, 0};
  std::vector<std::vector<int>> first_end(parts + 1, std::vector<int>(n + 1, -1));
  for (int k = 1; k <= parts; ++k) {
    std::fill(best.begin(), best.end(), Cost{});
    // Items [i, n) into k parts, leaving at least one item for each of the parts - k before.
    for (int i = parts - k; i <= n - k; ++i) {
      double sum = 0;
      for (int j = i + 1; j <= n - (k - 1); ++j) {
        sum += weights[j - 1];
        if (sum > bottleneck) break;  // longer first parts are heavier still
        if (std::isinf(rest[j].squared_weights)) continue;
        const double w = sum * scale;
        const long long count = j - i;
        const Cost cost{w * w + rest[j].squared_weights, count * count + rest[j].squared_counts};
        if (cost <= best[i]) {  // `<=`: among equals, the longest first part
          best[i] = cost;
          first_end[k][i] = j;
        }
      }
    }
    std::swap(rest, best);
  }

  std::vector<int> bounds(parts + 1);
  for (int p = 0; p < parts; ++p) {
    bounds[p + 1] = first_end[parts - p][bounds[p]];
    ZS_CHECK(bounds[p + 1] > bounds[p], "partition_balanced: no split of ", n, " items into ",
             parts, " parts meets the bottleneck ", bottleneck, " that the greedy check found");
  }
  return bounds;
}

std::vector<int> partition_uniform(int num_items, int parts) {
  ZS_REQUIRE(num_items >= 0, "num_items: got ", num_items, ", expected >= 0");
  require_parts(parts, num_items, "items");
  // As ds_utils.partition_uniform: the first num_items % parts parts take one item more.
  const int size = num_items / parts, larger = num_items % parts;
  std::vector<int> bounds(parts + 1);
  for (int p = 0; p <= parts; ++p) bounds[p] = p * size + std::min(p, larger);
  return bounds;
}

}  // namespace zeroshard::pipeline
