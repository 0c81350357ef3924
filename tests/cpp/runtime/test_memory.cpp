// Model-state byte accounting (runtime/memory.cpp).
#include <catch2/catch.hpp>

#include "runtime/error.h"
#include "runtime/memory.h"

using namespace zeroshard;

TEST_CASE("categories add, release and keep their peaks") {
  MemoryAccount a;
  a.add(MemoryCategory::parameters, 100);
  a.add(MemoryCategory::gathered_parameters, 50);
  a.release(MemoryCategory::gathered_parameters, 50);
  a.add(MemoryCategory::gathered_parameters, 30);
  CHECK(a.bytes(MemoryCategory::parameters) == 100);
  CHECK(a.bytes(MemoryCategory::gathered_parameters) == 30);
  CHECK(a.peak_bytes(MemoryCategory::gathered_parameters) == 50);
  CHECK(a.total_bytes() == 130);
  CHECK(a.peak_total_bytes() == 150);
  CHECK_THROWS_AS(a.release(MemoryCategory::parameters, 101), Error);
  CHECK(a.summary() ==
        "parameters=100B gradients=0B master_weights=0B optimizer_state=0B gathered_parameters=30B");
  a.reset_peaks();
  CHECK(a.peak_bytes(MemoryCategory::gathered_parameters) == 30);
  a.release(MemoryCategory::gathered_parameters, 30);
  CHECK(a.summary() == "parameters=100B gradients=0B master_weights=0B optimizer_state=0B");
}

TEST_CASE("format_bytes picks a unit") {
  CHECK(format_bytes(999) == "999B");
  CHECK(format_bytes(1500) == "1.5KB");
  CHECK(format_bytes(2500000) == "2.50MB");
  CHECK(format_bytes(3000000000) == "3.00GB");
}
