// The trace's event store (runtime/event_store.cpp): records kept whole across chunks, and none of
// them on malloc's heap.
#include <catch2/catch.hpp>

#include <malloc.h>

#include <string>

#include "runtime/event_store.h"

using namespace zeroshard::trace;

TEST_CASE("records come back whole and in order across chunks, one larger than a chunk included") {
  EventStore store(4096);  // one page per chunk: 200 records of ~70 bytes span several pages
  for (int i = 0; i < 200; ++i) {
    store.append(i % 2 ? 'C' : 'X', "comm", "all_gather #" + std::to_string(i), 1000 + i, i, i % 3,
               i % 5 ? "\"seq\": " + std::to_string(i) : std::string());
  }
  const std::string huge(10000, 'a');  // over two pages: a chunk of its own
  store.append('X', "io", huge, 7, 8, 1, huge);
  store.append('X', "", "", -5, 0, 0, "");
  CHECK(store.size() == 202);
  CHECK(store.mapped_bytes() > 3 * 4096);
  CHECK(store.mapped_bytes() < (1 << 20));  // page-sized chunks, not one default 4 MiB chunk
  const auto events = store.take();
  REQUIRE(events.size() == 202);
  for (int i = 0; i < 200; ++i) {
    const Event& e = events[size_t(i)];
    CHECK(e.phase == (i % 2 ? 'C' : 'X'));
    CHECK(e.category == "comm");
    CHECK(e.name == "all_gather #" + std::to_string(i));
    CHECK(e.start_ns == 1000 + i);
    CHECK(e.duration_ns == i);
    CHECK(e.track == i % 3);
    CHECK(e.args == (i % 5 ? "\"seq\": " + std::to_string(i) : std::string()));
  }
  CHECK(events[200].name == huge);
  CHECK(events[200].args == huge);
  CHECK(events[200].category == "io");
  CHECK(events[200].phase == 'X');
  CHECK(events[200].start_ns == 7);
  CHECK(events[200].duration_ns == 8);
  CHECK(events[200].track == 1);
  CHECK(events[201].category.empty());
  CHECK(events[201].name.empty());
  CHECK(events[201].args.empty());
  CHECK(events[201].start_ns == -5);
  CHECK(events[201].track == 0);
  CHECK(store.size() == 0);  // taken once: emptied and unmapped
  CHECK(store.mapped_bytes() == 0);
  CHECK(store.take().empty());
}

TEST_CASE("appending events takes nothing from malloc's heap") {
  // One 64 MiB chunk holds all 10,001 records (~3.7 MB), so the chunk index never grows on the
  // heap either; glibc's counters (mallinfo2) are what is read: not meaningful under another malloc.
  EventStore store(size_t(64) << 20);
  const std::string name = "model state bytes";
  const std::string args(300, 'x');  // as long as a memory sample's args
  store.append('C', "memory", name, 0, 0, 0, args);  // the first chunk and its entry
  const size_t before = mallinfo2().uordblks;
  for (int i = 0; i < 10000; ++i) store.append('C', "memory", name, i, 0, 0, args);
  CHECK(mallinfo2().uordblks == before);
  CHECK(store.size() == 10001);
}
