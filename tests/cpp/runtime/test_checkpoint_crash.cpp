// A save killed at any moment (runtime/checkpoint/atomic_dir.cpp): a forked child saves and is
// SIGKILLed at each named step of a commit, and at random moments; afterwards `latest` must name a
// directory that loads, verifies and holds exactly one complete save, and the next save cleans up.
// With ATen included, Catch2's CHECK is shadowed by c10's: only REQUIRE here.
#include <catch2/catch.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>

#include "checkpoint_helpers.h"
#include "runtime/error.h"

using namespace zeroshard;
using namespace zeroshard::checkpoint;
using namespace zs_test;

namespace {

// Tensors of versions 0, 1, 2, made before any fork so the children run no ATen math.
const std::vector<Named>& versions() {
  static const std::vector<Named> all = {model_tensors(10, 32), model_tensors(11, 32), model_tensors(12, 32)};
  return all;
}

// Runs `body` in a child process that SIGKILLs itself at hook point `kill_at` (if reached).
// Returns the child's exit: "killed", "exited 0", or "failed: <message>" when it threw.
std::string run_child(const std::string& kill_at, bool exchange, const std::function<void()>& body) {
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(pipe_fds[0]);
    testing::hooks().no_rename_exchange = !exchange;
    testing::hooks().at_point = [&](const std::string& point) {
      if (point == kill_at) ::raise(SIGKILL);
    };
    try {
      body();
    } catch (const std::exception& e) {
      const std::string message = e.what();
      (void)!::write(pipe_fds[1], message.data(), message.size());
      ::_exit(3);
    }
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  std::string message;
  char buffer[512];
  for (ssize_t n; (n = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0;) message.append(buffer, size_t(n));
  ::close(pipe_fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) return "killed";
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "exited 0";
  return "failed: " + message;
}

// What `latest` leads to: its version (the manifest's training_state), after checking that the
// directory loads, every file verifies, and every tensor is that version's.
int loadable_latest_version(const fs::path& save_dir) {
  const auto tag = read_latest(save_dir);
  REQUIRE(tag.has_value());
  const auto dir = find_checkpoint_dir(save_dir, *tag);
  INFO("latest: " << *tag);
  REQUIRE(dir.has_value());
  const Named loaded = load_checkpoint(*dir);
  const int version = Manifest::load(*dir / kManifestFileName).section("training_state")["global_steps"].get<int>();
  REQUIRE(same_tensors(loaded, versions()[size_t(version % 3)]));
  return version;
}

}  // namespace

TEST_CASE("crash: killed at each step of a save, latest loads one complete save, the next save cleans") {
  struct Scenario {
    const char* kill_at;
    bool same_tag;  // the save replaces the tag `latest` names, or writes a new one
    bool exchange;  // RENAME_EXCHANGE, or move-aside + rename
    int expect;     // the version `latest` must then give: 1 (before) or 2 (the killed save)
  };
  const std::vector<Scenario> scenarios = {
      {"test:between_files", false, true, 1},       {"test:between_files", true, true, 1},
      {"commit:begin", false, true, 1},             {"commit:begin", true, true, 1},
      {"commit:after_exchange", true, true, 2},     {"commit:before_latest", true, true, 2},
      {"commit:after_move_aside", true, false, 1},  {"commit:after_rename", true, false, 2},
      {"commit:after_rename", false, true, 1},      {"commit:before_latest", false, true, 1},
      {"latest:after_write_tmp", false, true, 1},   {"commit:end", false, true, 2},
  };
  for (const auto& s : scenarios) {
    INFO("killed at " << s.kill_at << (s.same_tag ? ", same tag" : ", new tag")
                      << (s.exchange ? ", exchange" : ", move-aside"));
    TempDir dir;
    save_two_rank_checkpoint(dir.path, "global_step1", versions()[1], true, 1);
    const std::string tag = s.same_tag ? "global_step1" : "global_step2";
    const std::string outcome = run_child(s.kill_at, s.exchange, [&] {
      save_two_rank_checkpoint(dir.path, tag, versions()[2], true, 2);
    });
    REQUIRE(outcome == "killed");
    REQUIRE(loadable_latest_version(dir.path) == s.expect);

    // The next save removes the leftovers (restoring a moved-aside copy) and commits.
    save_two_rank_checkpoint(dir.path, "global_step3", versions()[0], true, 3);
    for (const auto& e : fs::directory_iterator(dir.path)) REQUIRE(e.path().filename().string()[0] != '.');
    REQUIRE(loadable_latest_version(dir.path) == 3);
    if (s.same_tag) REQUIRE(same_tensors(load_checkpoint(dir.path / tag), versions()[size_t(s.expect)]));
  }
}

TEST_CASE("crash: a child that is not killed commits, so the kill points above are reached") {
  TempDir dir;
  save_two_rank_checkpoint(dir.path, "global_step1", versions()[1], true, 1);
  REQUIRE(run_child("never", false, [&] { save_two_rank_checkpoint(dir.path, "global_step1", versions()[2], true, 2); }) ==
          "exited 0");
  REQUIRE(loadable_latest_version(dir.path) == 2);
}

TEST_CASE("crash: kill -9 at 20 random moments of back-to-back saves; latest always loads") {
  TempDir dir;
  save_two_rank_checkpoint(dir.path, "global_step0", versions()[0], true, 0);
  const auto start = std::chrono::steady_clock::now();
  save_two_rank_checkpoint(dir.path, "global_step1", versions()[1], true, 1);
  const double save_us =
      double(std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count());
  std::mt19937 rng(2024);
  int last_version = 1;
  for (int trial = 0; trial < 20; ++trial) {
    INFO("trial " << trial);
    const bool exchange = trial % 2 == 0;
    const int first = last_version + 1;
    std::uniform_real_distribution<double> delay_us(0.0, 3.0 * save_us);
    const auto delay = std::chrono::microseconds(int64_t(delay_us(rng)));
    int pipe_fds[2];
    REQUIRE(::pipe(pipe_fds) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      testing::hooks().no_rename_exchange = !exchange;
      ::close(pipe_fds[0]);
      ::close(pipe_fds[1]);  // the parent's read end sees EOF: saving has started
      try {
        // Two tags in turn, so saves both add a tag and replace one.
        for (int v = first;; ++v) save_two_rank_checkpoint(dir.path, v % 2 ? "odd" : "even", versions()[size_t(v % 3)], true, v);
      } catch (...) {
        ::_exit(3);
      }
    }
    ::close(pipe_fds[1]);
    char ignored;
    (void)!::read(pipe_fds[0], &ignored, 1);
    ::close(pipe_fds[0]);
    std::this_thread::sleep_for(delay);
    ::kill(pid, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    REQUIRE((WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL));
    const int version = loadable_latest_version(dir.path);
    REQUIRE(version >= last_version);  // never older than what was committed before
    last_version = version;
  }
  save_two_rank_checkpoint(dir.path, "final", versions()[0], true, 999);
  for (const auto& e : fs::directory_iterator(dir.path)) REQUIRE(e.path().filename().string()[0] != '.');
  REQUIRE(loadable_latest_version(dir.path) == 999);
}
