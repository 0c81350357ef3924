// The ZeRO-3 fetch-order trace (zero/fetch_trace.cpp): record, follow, notice a change, re-record.
#include <catch2/catch.hpp>

#include "zero/fetch_trace.h"

using namespace zeroshard;

TEST_CASE("records the first iteration, then follows it") {
  FetchTrace t;
  for (int64_t m : {0, 1, 2, 1, 0}) REQUIRE(t.on_fetch(m));
  REQUIRE(t.end_iteration());
  REQUIRE(t.mode() == FetchTrace::Mode::follow);
  REQUIRE(t.modules() == std::vector<int64_t>{0, 1, 2, 1, 0});
  for (int64_t m : {0, 1, 2, 1, 0}) REQUIRE(t.on_fetch(m));
  REQUIRE(t.position() == 5);
  REQUIRE(t.end_iteration());
  REQUIRE(t.invalidations() == 0);
}

TEST_CASE("a different order invalidates the trace and the next iteration records again") {
  FetchTrace t;
  for (int64_t m : {0, 1, 2}) t.on_fetch(m);
  t.end_iteration();
  REQUIRE(t.on_fetch(0));
  REQUIRE_FALSE(t.on_fetch(2));        // module 1 skipped
  REQUIRE(t.on_fetch(1));              // no second warning in the same iteration
  REQUIRE_FALSE(t.end_iteration());
  REQUIRE(t.invalidations() == 1);
  REQUIRE(t.mode() == FetchTrace::Mode::record);
  for (int64_t m : {0, 2}) t.on_fetch(m);
  REQUIRE(t.end_iteration());
  REQUIRE(t.modules() == std::vector<int64_t>{0, 2});
}

TEST_CASE("an iteration that ends early also counts as a change") {
  FetchTrace t;
  for (int64_t m : {3, 4}) t.on_fetch(m);
  t.end_iteration();
  t.on_fetch(3);
  REQUIRE_FALSE(t.end_iteration());
  REQUIRE(t.mode() == FetchTrace::Mode::record);
}

TEST_CASE("an abandoned iteration records again while recording and keeps a followed trace") {
  FetchTrace t;
  for (int64_t m : {0, 1}) t.on_fetch(m);  // the first iteration's backward raised here
  t.abandon_iteration();
  REQUIRE(t.mode() == FetchTrace::Mode::record);
  for (int64_t m : {0, 1, 2, 1, 0}) t.on_fetch(m);
  REQUIRE(t.end_iteration());
  REQUIRE(t.modules() == std::vector<int64_t>{0, 1, 2, 1, 0});
  for (int64_t m : {0, 1, 2}) REQUIRE(t.on_fetch(m));  // followed, then abandoned part-way
  t.abandon_iteration();
  REQUIRE(t.mode() == FetchTrace::Mode::follow);
  REQUIRE(t.position() == 0);
  for (int64_t m : {0, 1, 2, 1, 0}) REQUIRE(t.on_fetch(m));
  REQUIRE(t.end_iteration());
  REQUIRE(t.invalidations() == 0);
  t.on_fetch(0);
  REQUIRE_FALSE(t.on_fetch(2));  // an order change, then abandoned: recorded again whole
  t.abandon_iteration();
  REQUIRE(t.mode() == FetchTrace::Mode::record);
  for (int64_t m : {0, 2}) t.on_fetch(m);
  REQUIRE(t.end_iteration());
  REQUIRE(t.modules() == std::vector<int64_t>{0, 2});
}

TEST_CASE("a module that joins mid-iteration restarts the recording without a warning") {
  FetchTrace t;
  for (int64_t m : {0, 1}) t.on_fetch(m);
  t.end_iteration();                   // following {0, 1}
  REQUIRE(t.on_fetch(0));
  t.restart_recording(true);           // module 2 registered while this iteration runs
  REQUIRE(t.on_fetch(1));
  REQUIRE(t.end_iteration());          // dropped, not a change
  REQUIRE(t.invalidations() == 0);
  REQUIRE(t.mode() == FetchTrace::Mode::record);
  for (int64_t m : {2, 0, 1}) REQUIRE(t.on_fetch(m));
  REQUIRE(t.end_iteration());
  REQUIRE(t.mode() == FetchTrace::Mode::follow);
  REQUIRE(t.modules() == std::vector<int64_t>{2, 0, 1});
}

TEST_CASE("a restart between iterations records the next one") {
  FetchTrace t;
  for (int64_t m : {0, 1}) t.on_fetch(m);
  t.end_iteration();
  t.restart_recording(false);          // an evaluation trace while training ran
  for (int64_t m : {1, 0}) REQUIRE(t.on_fetch(m));
  REQUIRE(t.end_iteration());
  REQUIRE(t.modules() == std::vector<int64_t>{1, 0});
  REQUIRE(t.invalidations() == 0);
}
