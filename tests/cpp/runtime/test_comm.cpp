// CommWork::wait against fake c10d works: a collective that completes just as a wait slice runs
// out is a success, a backend's own error is reported with its message, and a collective waited
// for long after it finished is traced as it ran.
#include <catch2/catch.hpp>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "runtime/comm.h"
#include "runtime/comm_stats.h"
#include "runtime/error.h"
#include "runtime/trace.h"

using zeroshard::CommError;
using zeroshard::CommMonitor;
using zeroshard::CommWork;

namespace {

// Every wait finishes the work (with `error`, if any) and then throws c10d's slice-timeout
// error: the order of events when completion races the end of a wait slice.
class RacingWork : public c10d::Work {
 public:
  explicit RacingWork(std::exception_ptr error = nullptr) : error_(std::move(error)) {}
  bool wait(std::chrono::milliseconds) override {
    finish(error_);
    TORCH_CHECK(false, "Operation timed out!");
  }

 private:
  std::exception_ptr error_;
};

CommWork make_work(c10::intrusive_ptr<c10d::Work> work) {
  auto monitor = std::make_shared<CommMonitor>(c10::intrusive_ptr<c10d::Store>(), 0, 2,
                                               std::chrono::seconds(5), false);
  const std::string what = "all_reduce(gradient bucket 0, 4 x Float, 16 B)";
  monitor->starting(1, what, true);
  return CommWork(std::move(work), 1, what, monitor, /*device_async=*/false);
}

}  // namespace

TEST_CASE("a collective that completes as its wait slice runs out has succeeded") {
  CommWork w = make_work(c10::make_intrusive<RacingWork>());
  CHECK_NOTHROW(w.wait());
  CHECK_FALSE(w.pending());
}

TEST_CASE("a backend error is reported with the backend's own message") {
  CommWork w = make_work(c10::make_intrusive<RacingWork>(
      std::make_exception_ptr(std::runtime_error("Connection reset by peer"))));
  CHECK_THROWS_AS(w.wait(), CommError);
  CommWork again = make_work(c10::make_intrusive<RacingWork>(
      std::make_exception_ptr(std::runtime_error("Connection reset by peer"))));
  CHECK_THROWS_WITH(again.wait(), Catch::Contains("Connection reset by peer") &&
                                      Catch::Contains("gradient bucket 0"));
}

namespace {

// A host backend's work whose future the test completes, as Gloo's worker thread does.
class FutureWork : public c10d::Work {
 public:
  FutureWork() : future_(c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get())) {}
  void complete() {
    finish();
    future_->markCompleted(c10::IValue());
  }
  bool wait(std::chrono::milliseconds) override { return true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace

TEST_CASE("a collective waited for after it finished is traced from issue to its completion") {
  // REQUIRE, not CHECK: c10's logging header (through c10d) defines its own CHECK macro.
  namespace trace = zeroshard::trace;
  auto monitor = std::make_shared<CommMonitor>(c10::intrusive_ptr<c10d::Store>(), 0, 2,
                                               std::chrono::seconds(5), false);
  const std::string what = "all_gather(parameter chunks 3, 8 x Float, 32 B)";
  monitor->starting(1, what, true);
  zeroshard::CommOp op;
  op.kind = "all_gather";
  op.what = what;
  op.bytes = 32;
  op.world_size = 2;
  zeroshard::CommLoggerOptions logger;
  logger.enabled = true;
  zeroshard::CommStats::global().configure(logger, 0);
  zeroshard::CommStats::global().reset();
  trace::start(100);
  op.issued_ns = trace::now_ns();
  auto work = c10::make_intrusive<FutureWork>();
  CommWork w(work, 1, what, monitor, /*device_async=*/false, /*point_to_point=*/false, op);
  work->complete();
  const int64_t completed_ns = trace::now_ns();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));  // a prefetch waited for later
  const int64_t wait_start_ns = trace::now_ns();
  w.wait();
  trace::stop();
  int spans = 0;
  for (const auto& e : trace::drain()) {
    if (e.category == "comm") {
      ++spans;
      REQUIRE(e.start_ns == op.issued_ns);
      REQUIRE(e.start_ns + e.duration_ns <= completed_ns);  // not stretched to the wait's end
    } else if (e.category == "wait") {
      ++spans;
      REQUIRE(e.start_ns >= wait_start_ns);  // the wait is only the blocked part
      REQUIRE(e.start_ns + e.duration_ns >= completed_ns + 30'000'000);
    }
  }
  REQUIRE(spans == 2);
  // The comms logger's latency is the collective's too, not the 30 ms it waited unclaimed.
  const auto rows = zeroshard::CommStats::global().rows();
  zeroshard::CommStats::global().configure({}, 0);
  REQUIRE(rows.size() == 1);
  REQUIRE(rows[0].count == 1);
  REQUIRE(rows[0].total_ms < 25.0);
}
