// The flight recorder's ring: order, wrap-around, state marks, summary text.
#include <catch2/catch.hpp>

#include "runtime/error.h"
#include "runtime/flight_recorder.h"

using zeroshard::FlightRecorder;
using State = FlightRecorder::State;

TEST_CASE("an empty recorder has nothing to say") {
  FlightRecorder r(4);
  CHECK(r.recent().empty());
  CHECK(r.summary() == "none");
}

TEST_CASE("entries come back oldest first with their states") {
  FlightRecorder r(4);
  r.started(1, "all_reduce(a, 4 x Float, 16 B)");
  r.started(2, "all_gather(b, 8 x Float, 32 B)");
  r.finished(1);
  const auto e = r.recent();
  REQUIRE(e.size() == 2);
  CHECK(e[0].seq == 1);
  CHECK(e[0].state == State::done);
  CHECK(e[1].seq == 2);
  CHECK(e[1].state == State::in_flight);
  CHECK(r.summary() == "#1 all_reduce(a, 4 x Float, 16 B) done, #2 all_gather(b, 8 x Float, 32 B) in flight");
}

TEST_CASE("the ring keeps only the last capacity entries, across many wraps") {
  for (size_t capacity : {1, 2, 3, 8}) {
    FlightRecorder r(capacity);
    for (uint64_t seq = 1; seq <= 20; ++seq) {
      r.started(seq, "op");
      if (seq % 2 == 0) r.finished(seq, seq % 4 != 0);
    }
    const auto e = r.recent();
    REQUIRE(e.size() == capacity);
    for (size_t i = 0; i < capacity; ++i) {
      const uint64_t seq = 20 - capacity + 1 + i;
      CHECK(e[i].seq == seq);
      CHECK(e[i].state == (seq % 2 ? State::in_flight : seq % 4 ? State::done : State::failed));
    }
  }
}

TEST_CASE("finishing a collective that already left the ring changes nothing") {
  FlightRecorder r(2);
  r.started(1, "a");
  r.started(2, "b");
  r.started(3, "c");
  r.finished(1, false);
  for (const auto& e : r.recent()) CHECK(e.state == State::in_flight);
}

TEST_CASE("a zero capacity is refused") {
  CHECK_THROWS_WITH(FlightRecorder(0), Catch::Contains("capacity must be at least 1"));
}
