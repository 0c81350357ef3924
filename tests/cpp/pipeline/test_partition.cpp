// Layer partitioning (pipeline/partition.cpp): the balanced split's heaviest part is the exact
// optimum of every split of small inputs, ties go as partition.h documents, the uniform split is
// DeepSpeed's, and bad arguments say what is allowed.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "pipeline/partition.h"
#include "runtime/error.h"

using namespace zeroshard;
using namespace zeroshard::pipeline;

namespace {

// Part weights added in order, as partition.h defines them.
std::vector<double> part_weights(const std::vector<double>& weights, const std::vector<int>& b) {
  std::vector<double> out;
  for (std::size_t p = 0; p + 1 < b.size(); ++p) {
    double sum = 0;
    for (int i = b[p]; i < b[p + 1]; ++i) sum += weights[i];
    out.push_back(sum);
  }
  return out;
}

double max_part(const std::vector<double>& weights, const std::vector<int>& b) {
  const auto w = part_weights(weights, b);
  return *std::max_element(w.begin(), w.end());
}

// parts + 1 boundaries from 0 to n, strictly increasing.
bool is_split(const std::vector<int>& b, int n, int parts) {
  if (static_cast<int>(b.size()) != parts + 1 || b.front() != 0 || b.back() != n) return false;
  for (int p = 0; p < parts; ++p)
    if (b[p + 1] <= b[p]) return false;
  return true;
}

// Every split of n items into `parts` non-empty ranges, boundaries in lexicographic order.
std::vector<std::vector<int>> all_splits(int n, int parts) {
  std::vector<std::vector<int>> out;
  std::vector<int> b(parts + 1, 0);
  b[parts] = n;
  auto place = [&](auto&& self, int p) -> void {  // choose b[p], given b[p - 1]
    if (p == parts) {
      out.push_back(b);
      return;
    }
    for (int end = b[p - 1] + 1; end <= n - (parts - p); ++end) {
      b[p] = end;
      self(self, p + 1);
    }
  };
  place(place, 1);
  return out;
}

// partition.h's whole rule by brute force, exact for small integer weights: least heaviest part,
// then least sum of squared weights, then least sum of squared counts, then the lexicographically
// largest boundaries.
std::vector<int> brute_force_choice(const std::vector<double>& weights, int parts) {
  const int n = static_cast<int>(weights.size());
  std::vector<int> chosen;
  double best_max = 0, best_squares = 0;
  long long best_counts = 0;
  for (const auto& b : all_splits(n, parts)) {  // lexicographic order: ties keep the later
    double squares = 0;
    for (double w : part_weights(weights, b)) squares += w * w;
    long long counts = 0;
    for (int p = 0; p < parts; ++p) counts += 1LL * (b[p + 1] - b[p]) * (b[p + 1] - b[p]);
    const double heaviest = max_part(weights, b);
    const bool better =
        chosen.empty() || heaviest < best_max ||
        (heaviest == best_max &&
         (squares < best_squares || (squares == best_squares && counts <= best_counts)));
    if (better) chosen = b, best_max = heaviest, best_squares = squares, best_counts = counts;
  }
  return chosen;
}

// Weight lists for the brute-force comparison: n 1..9, some drawn from a continuous range, some
// small integers with many zeros (the tie-heavy case), some all zero.
struct WeightCase {
  std::vector<double> weights;
  bool integers;  // exact in double, so the full tie-breaking rule can be compared
};
std::vector<WeightCase> weight_cases() {
  std::mt19937 rng(20240531);
  std::uniform_real_distribution<double> real(0.0, 10.0);
  std::uniform_int_distribution<int> small(0, 3);
  std::bernoulli_distribution zero(0.4);
  std::vector<WeightCase> out;
  for (int n = 1; n <= 9; ++n) {
    for (int trial = 0; trial < 30; ++trial) {
      WeightCase real_case{{}, false}, zero_case{{}, true};
      for (int i = 0; i < n; ++i) {
        real_case.weights.push_back(zero(rng) ? 0.0 : real(rng));
        zero_case.weights.push_back(zero(rng) ? 0.0 : small(rng));
      }
      out.push_back(real_case);
      out.push_back(zero_case);
    }
    out.push_back({std::vector<double>(n, 0.0), true});
    out.push_back({std::vector<double>(n, 0.1), false});  // 0.1 sums round
  }
  return out;
}

std::string show(const std::vector<double>& v) {
  std::string s;
  for (double x : v) s += std::to_string(x) + " ";
  return s;
}

}  // namespace

TEST_CASE("balanced: the heaviest part is the brute-force optimum for n <= 9") {
  for (const auto& c : weight_cases()) {
    const int n = static_cast<int>(c.weights.size());
    for (int parts = 1; parts <= n; ++parts) {
      INFO("weights " << show(c.weights) << "parts " << parts);
      const auto b = partition_balanced(c.weights, parts);
      REQUIRE(is_split(b, n, parts));
      const auto expected = brute_force_choice(c.weights, parts);
      REQUIRE(max_part(c.weights, b) == max_part(c.weights, expected));
      if (c.integers) REQUIRE(b == expected);
    }
  }
}

TEST_CASE("balanced: ties balance the other parts, then spread zero-weight items") {
  struct Tie {
    std::vector<double> weights;
    int parts;
    std::vector<int> expected;
  };
  const std::vector<Tie> ties = {
      {{4, 1, 1, 1, 1}, 3, {0, 1, 3, 5}},        // (4, 2, 2), not (4, 1, 3)
      {{4, 3, 1, 0, 0, 0, 0}, 3, {0, 1, 2, 7}},  // (4, 3, 1): weights balance before counts
      {{1, 0, 1, 0, 1, 0, 1, 0}, 2, {0, 4, 8}},  // zeros split 2 / 2, not 1 / 3
      {{1, 0, 0, 0, 0, 0, 1}, 2, {0, 4, 7}},     // zeros 3 / 2, the extra one first
      // type:regex-like: embedding, 8 matching blocks, norm and head; 2 blocks a stage.
      {{0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0}, 4, {0, 3, 5, 7, 11}},
  };
  for (const auto& t : ties) {
    INFO("weights " << show(t.weights) << "parts " << t.parts);
    CHECK(partition_balanced(t.weights, t.parts) == t.expected);
  }
}

TEST_CASE("balanced: equal or zero weights give the uniform split") {
  for (int n = 1; n <= 40; ++n)
    for (int parts = 1; parts <= n; ++parts) {
      INFO("n " << n << " parts " << parts);
      REQUIRE(partition_balanced(std::vector<double>(n, 0.0), parts) ==
              partition_uniform(n, parts));
      REQUIRE(partition_balanced(std::vector<double>(n, 3.0), parts) ==
              partition_uniform(n, parts));
    }
}

TEST_CASE("uniform: DeepSpeed's split, sizes within one, the larger parts first") {
  CHECK(partition_uniform(10, 4) == std::vector<int>{0, 3, 6, 8, 10});  // ds_utils' answer
  CHECK(partition_uniform(8, 4) == std::vector<int>{0, 2, 4, 6, 8});
  CHECK(partition_uniform(3, 3) == std::vector<int>{0, 1, 2, 3});
  for (int n = 1; n <= 50; ++n)
    for (int parts = 1; parts <= n; ++parts) {
      const auto b = partition_uniform(n, parts);
      REQUIRE(is_split(b, n, parts));
      for (int p = 0; p < parts; ++p) {
        const int size = b[p + 1] - b[p];
        REQUIRE(size == n / parts + (p < n % parts ? 1 : 0));
      }
    }
}

TEST_CASE("balanced: 2000 layers into 64 stages is optimal and fast") {
  std::mt19937 rng(7);
  std::lognormal_distribution<double> size(0.0, 1.0);
  std::bernoulli_distribution zero(0.3);
  std::vector<double> weights(2000);
  for (double& w : weights) w = zero(rng) ? 0.0 : size(rng) * 1e6;  // parameter-count-like
  const auto start = std::chrono::steady_clock::now();
  const auto b = partition_balanced(weights, 64);
  const auto all_zero = partition_balanced(std::vector<double>(2000, 0.0), 64);  // worst case
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  REQUIRE(is_split(b, 2000, 64));
  REQUIRE(all_zero == partition_uniform(2000, 64));
  // No split's heaviest part is below ours: greedy packing under the next smaller double
  // needs more than 64 parts.
  const double below = std::nextafter(max_part(weights, b), 0.0);
  int used = 1;
  double sum = 0;
  for (double w : weights) {
    if (sum + w > below) ++used, sum = 0;
    sum += w;
  }
  CHECK(used > 64);
  CHECK(seconds < 2.0);  // about 0.1 s in a release build; the bound only catches a blow-up
}

TEST_CASE("bad arguments name the argument, its value and what is allowed") {
  auto error = [](auto call) {
    try {
      call();
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  using Catch::Contains;
  const std::vector<double> three = {1, 2, 3};
  CHECK_THAT(error([&] { partition_balanced(three, 0); }),
             Contains("parts: got 0") && Contains(">= 1"));
  CHECK_THAT(error([&] { partition_balanced(three, 5); }),
             Contains("parts: got 5 for 3 weights") && Contains("at most the number of weights"));
  CHECK_THAT(error([&] { partition_balanced({}, 1); }), Contains("parts: got 1 for 0 weights"));
  CHECK_THAT(error([&] { partition_balanced({1, -0.5, 2}, 2); }),
             Contains("weights[1]: got -0.5") && Contains("finite number >= 0"));
  CHECK_THAT(error([&] { partition_balanced({1, std::nan(""), 2}, 2); }),
             Contains("weights[1]: got nan") && Contains("finite number >= 0"));
  const double inf = std::numeric_limits<double>::infinity();
  CHECK_THAT(error([&] { partition_balanced({inf}, 1); }), Contains("weights[0]: got inf"));
  const double big = std::numeric_limits<double>::max();
  CHECK_THAT(error([&] { partition_balanced({big, big}, 2); }),
             Contains("weights: sum to inf") && Contains("finite total"));
  CHECK_THAT(error([] { partition_uniform(4, 0); }), Contains("parts: got 0") && Contains(">= 1"));
  CHECK_THAT(error([] { partition_uniform(3, 5); }),
             Contains("parts: got 5 for 3 items") && Contains("at most the number of items"));
  CHECK_THAT(error([] { partition_uniform(-1, 1); }),
             Contains("num_items: got -1") && Contains(">= 0"));
}
