// The runtime's timeline (runtime/trace.cpp) and the memory samples it takes (runtime/memory.cpp).
#include <catch2/catch.hpp>

#include <thread>

#include "runtime/memory.h"
#include "runtime/trace.h"

using namespace zeroshard;

TEST_CASE("nothing is recorded while the trace is off, and a scope begun while off stays unrecorded") {
  trace::stop();
  trace::drain();
  trace::span("comm", "off", 1, 2);
  trace::counter("x", "\"a\": 1");
  bool described = false;
  {
    trace::Scope scope("gather", [&] {
      described = true;
      return std::string("begun while off");
    });
    trace::start(10);
  }
  CHECK_FALSE(described);  // off, the name is never built
  CHECK(trace::drain().empty());
  trace::stop();
}

TEST_CASE("spans, scopes and counters are kept in order up to max_events; the rest are counted") {
  trace::start(3);
  trace::span("comm", "first", 10, 25, "\"seq\": 1");
  { trace::Scope scope("gather", [] { return std::string("second"); }); }
  trace::counter("model state bytes", "\"parameters\": 4");
  trace::span("comm", "dropped", 30, 40);
  trace::span("comm", "dropped too", 40, 50);
  trace::stop();
  const auto events = trace::drain();
  REQUIRE(events.size() == 3);
  CHECK(events[0].name == "first");
  CHECK(events[0].duration_ns == 15);
  CHECK(events[0].args == "\"seq\": 1");
  CHECK(events[1].category == "gather");
  CHECK(events[1].duration_ns >= 0);
  CHECK(events[2].phase == 'C');
  CHECK(trace::dropped() == 2);
  CHECK(trace::drain().empty());  // drained once
  trace::start(5);                // a new trace starts empty, its drops counted afresh
  CHECK(trace::dropped() == 0);
  trace::stop();
}

TEST_CASE("each thread keeps one track; the blocked time adds up per thread") {
  const int mine = trace::track();
  CHECK(trace::track() == mine);
  int other = mine;
  int64_t other_blocked = -1;
  std::thread t([&] {
    other = trace::track();
    trace::add_blocked_ns(7);
    other_blocked = trace::blocked_ns();
  });
  t.join();
  CHECK(other != mine);
  CHECK(other_blocked == 7);
  const int64_t before = trace::blocked_ns();
  trace::add_blocked_ns(5);
  CHECK(trace::blocked_ns() == before + 5);
  trace::set_timing(true);
  CHECK(trace::timing());
  trace::set_timing(false);
}

TEST_CASE("the memory accounting takes a sample of every category at each change while tracing") {
  MemoryAccount a;
  trace::start(100);
  a.add(MemoryCategory::parameters, 100);
  a.release(MemoryCategory::parameters, 40);
  trace::stop();
  a.add(MemoryCategory::parameters, 1);  // not traced
  const auto events = trace::drain();
  REQUIRE(events.size() == 2);
  CHECK(events[0].name == "model state bytes");
  CHECK_THAT(events[0].args, Catch::StartsWith("\"parameters\": 100, \"gradients\": 0"));
  CHECK_THAT(events[1].args, Catch::StartsWith("\"parameters\": 60,"));
  CHECK_THAT(events[1].args, Catch::Contains("\"host_buffers\": 0"));
}
