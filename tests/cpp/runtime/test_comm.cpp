// CommWork::wait against fake c10d works: a collective that completes just as a wait slice runs
// out is a success, and a backend's own error is reported with its message.
#include <catch2/catch.hpp>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include "runtime/comm.h"
#include "runtime/error.h"

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
