// The comms logger's table (runtime/comm_stats.cpp).
#include <catch2/catch.hpp>

#include "runtime/comm_stats.h"

using namespace zeroshard;

namespace {
const CommStatsRow* row(const std::vector<CommStatsRow>& rows, const std::string& op, int64_t bytes) {
  for (const auto& r : rows)
    if (r.op == op && r.bytes == bytes) return &r;
  return nullptr;
}
}  // namespace

TEST_CASE("disabled, nothing is counted") {
  CommStats s;
  s.record("all_reduce", "x", 1024, 2, 1.0);
  CHECK(s.rows().empty());
}

TEST_CASE("rows by kind and size: count, latencies and nccl-tests' bandwidths") {
  CommStats s;
  s.configure({true, false, true, false, {}}, 0);
  s.record("all_reduce", "bucket 0", 1'000'000, 4, 2.0);
  s.record("all_reduce", "bucket 1", 1'000'000, 4, 4.0);
  s.record("all_reduce", "bucket 2", 2'000'000, 4, 1.0);
  s.record("all_gather", "params", 1'000'000, 4, 1.0);
  s.record("send", "activation", 1'000'000, 4, 1.0);
  const auto rows = s.rows();
  REQUIRE(rows.size() == 4);
  const CommStatsRow* r = row(rows, "all_reduce", 1'000'000);
  REQUIRE(r != nullptr);
  CHECK(r->count == 2);
  CHECK(r->total_ms == Approx(6.0));
  CHECK(r->min_ms == Approx(2.0));
  CHECK(r->max_ms == Approx(4.0));
  // 2 MB in 6 ms: 2.667 Gbit/s; the bus carries 2(n-1)/n of it per link at n = 4.
  CHECK(r->algbw_gbps() == Approx(2e6 * 8 / 6e6));
  CHECK(r->busbw_gbps() == Approx(r->algbw_gbps() * 1.5));
  CHECK(row(rows, "all_gather", 1'000'000)->busbw_gbps() == Approx(8.0 * 0.75));
  CHECK(row(rows, "send", 1'000'000)->busbw_gbps() == Approx(8.0));
  s.reset();
  CHECK(s.rows().empty());
}

TEST_CASE("prof_all false keeps prof_ops only; debug keys rows by what moved") {
  CommStats only;
  only.configure({true, false, false, false, {"all_gather"}}, 0);
  only.record("all_reduce", "x", 8, 2, 1.0);
  only.record("all_gather", "x", 8, 2, 1.0);
  REQUIRE(only.rows().size() == 1);
  CHECK(only.rows()[0].op == "all_gather");
  CommStats debug;
  debug.configure({true, false, true, true, {}}, 0);
  debug.record("all_reduce", "gradient bucket 3", 8, 2, 1.0);
  REQUIRE(debug.rows().size() == 1);
  CHECK(debug.rows()[0].op == "all_reduce(gradient bucket 3)");
  CHECK(debug.rows()[0].busbw_gbps() == Approx(debug.rows()[0].algbw_gbps()));  // 2(n-1)/n at n = 2
}
