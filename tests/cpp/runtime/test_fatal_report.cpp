#include <catch2/catch.hpp>

#include <csignal>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

#include "runtime/fatal_report.h"

using namespace zeroshard;

namespace {

// Runs body in a forked child whose stdout goes to a pipe; returns (what it wrote, wait status).
template <typename Body>
std::pair<std::string, int> in_child(Body body) {
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], STDOUT_FILENO);
    std::signal(SIGABRT, SIG_DFL);  // Catch2's handler would report the abort into the pipe
    body();
    _exit(0);
  }
  close(fds[1]);
  std::string out;
  char buf[256];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, size_t(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  return {out, status};
}

}  // namespace

TEST_CASE("an exception escaping a backend thread reaches every reporter before the abort") {
  auto [out, status] = in_child([] {
    add_fatal_reporter([](const std::string& cause) { std::printf("first: %s\n", cause.c_str()); });
    const int gone = add_fatal_reporter([](const std::string&) { std::printf("removed\n"); });
    add_fatal_reporter([](const std::string&) {
      std::printf("second\n");
      throw std::runtime_error("a reporter's own failure is swallowed");
    });
    add_fatal_reporter([](const std::string&) { std::printf("third\n"); });
    remove_fatal_reporter(gone);
    std::fflush(stdout);
    std::thread io([] { throw std::runtime_error("Received data size doesn't match"); });
    io.join();
  });
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGABRT);
  CHECK(out == "first: std::runtime_error: Received data size doesn't match\nsecond\nthird\n");
}

TEST_CASE("a direct std::terminate reports no exception") {
  auto [out, status] = in_child([] {
    add_fatal_reporter([](const std::string& cause) { std::printf("%s\n", cause.c_str()); });
    std::terminate();
  });
  REQUIRE(WIFSIGNALED(status));
  CHECK(out == "no exception\n");
}

TEST_CASE("current_exception_text names the type and the message") {
  CHECK(current_exception_text() == "no exception");
  try {
    throw std::invalid_argument("bad size");
  } catch (...) {
    CHECK(current_exception_text() == "std::invalid_argument: bad size");
  }
}
