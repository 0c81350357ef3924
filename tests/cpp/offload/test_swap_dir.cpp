// The NVMe swap directory (offload/swap_dir.cpp): made, checked and removed; bad paths refused
// with the config key; dead runs' directories named but kept, live runs' left alone.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "offload/swap_dir.h"
#include "offload_helpers.h"
#include "runtime/error.h"
#include "runtime/log.h"

using namespace zeroshard;
using zs_test::TempDir;
namespace fs = std::filesystem;

namespace {

const std::string kKey = "zero_optimization.offload_optimizer.nvme_path";

// Collects the warnings of one test; standard error is the sink again afterwards.
struct CapturedWarnings {
  std::vector<std::string> messages;
  CapturedWarnings() {
    set_warning_sink([this](const std::string& m) { messages.push_back(m); });
  }
  ~CapturedWarnings() { set_warning_sink(nullptr); }
  int mentioning(const std::string& text) const {
    int n = 0;
    for (const std::string& m : messages) n += m.find(text) != std::string::npos ? 1 : 0;
    return n;
  }
};

// A directory as a run that died would leave it: swap files and an unheld lock file.
fs::path dead_run_dir(const fs::path& parent, const std::string& name, int64_t file_bytes, bool with_lock) {
  const fs::path dir = parent / name;
  fs::create_directories(dir);
  if (with_lock) std::ofstream(dir / ".lock").flush();
  std::ofstream(dir / "optimizer.swp", std::ios::binary) << std::string(static_cast<size_t>(file_bytes), 'x');
  return dir;
}

}  // namespace

TEST_CASE("a SwapDir makes its rank's directory, holds its lock, and removes it with its files", "[swap]") {
  TempDir parent;
  std::string path;
  {
    SwapDir swap(parent.path.string() + "/", kKey, 3);  // a trailing slash is not doubled
    path = swap.path();
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    const std::string prefix = parent.path.string() + "/zeroshard-swap-" + host + "-" + std::to_string(getpid()) + "-";
    CHECK(path.rfind(prefix, 0) == 0);
    CHECK(path.size() > prefix.size() + 6);
    CHECK(path.substr(path.size() - 6) == "-rank3");
    REQUIRE(fs::is_directory(path));
    CHECK(fs::exists(path + "/.lock"));
    CHECK(swap.file("params.swp") == path + "/params.swp");
    CHECK_THROWS_AS(swap.file("a/b"), UsageError);
    std::ofstream(swap.file("params.swp")) << "bytes";
    fs::create_directories(path + "/nested");
    std::ofstream(path + "/nested/x") << "x";
    // The lock is held: another open file description cannot take it.
    const int fd = ::open((path + "/.lock").c_str(), O_RDONLY);
    REQUIRE(fd >= 0);
    CHECK(flock(fd, LOCK_EX | LOCK_NB) != 0);
    ::close(fd);
    CHECK(swap.available_bytes() > 0);
    CHECK_NOTHROW(swap.require_space(4096));
    // Two engines of one process on the same path and rank: each has its own directory.
    {
      SwapDir second(parent.path.string(), kKey, 3);
      CHECK(second.path() != path);
      CHECK(fs::is_directory(second.path()));
    }
    CHECK(fs::exists(swap.file("params.swp")));
  }
  CHECK_FALSE(fs::exists(path));
  CHECK(fs::is_empty(parent.path));
}

TEST_CASE("bad nvme_paths are UsageErrors naming the key, the path, the problem and the fix", "[swap]") {
  TempDir parent;
  const std::string missing = parent.file("nope");
  CHECK_THROWS_AS(SwapDir(missing, kKey, 0), UsageError);
  CHECK_THROWS_WITH(SwapDir(missing, kKey, 0), Catch::StartsWith(kKey + ": \"" + missing + "\" does not exist") &&
                                                   Catch::Contains("mkdir -p"));

  const std::string regular = parent.file("a-file");
  std::ofstream(regular) << "not a directory";
  CHECK_THROWS_WITH(SwapDir(regular, kKey, 0),
                    Catch::StartsWith(kKey + ": \"" + regular + "\" is not a directory"));
  CHECK_THROWS_WITH(SwapDir("", kKey, 0), Catch::Contains("is empty"));
}

TEST_CASE("a read-only directory is refused as not writable", "[swap]") {
  // chmod does not stop root, so the directory is a read-only mount.
  TempDir parent;
  zs_test::ScopedMount ro(parent.path / "ro", "tmpfs", MS_RDONLY, "size=1m");
  if (!ro.mounted) {
    WARN("the read-only case is skipped: " << ro.error);
    return;
  }
  CHECK_THROWS_WITH(SwapDir(ro.target.string(), kKey, 0),
                    Catch::StartsWith(kKey + ": \"" + ro.target.string() + "\" is not writable") &&
                        Catch::Contains("Read-only file system"));
}

TEST_CASE("tmpfs is refused: it keeps files in memory and has no real O_DIRECT", "[swap]") {
  TempDir parent;
  std::unique_ptr<zs_test::ScopedMount> mounted;
  std::string tmpfs = "/dev/shm";
  struct statfs st {};
  if (statfs(tmpfs.c_str(), &st) != 0 || st.f_type != 0x01021994 || access(tmpfs.c_str(), W_OK) != 0) {
    mounted = std::make_unique<zs_test::ScopedMount>(parent.path / "tmpfs", "tmpfs", 0, "size=1m");
    if (!mounted->mounted) {
      WARN("the tmpfs case is skipped: no writable /dev/shm and " << mounted->error);
      return;
    }
    tmpfs = mounted->target.string();
  }
  CHECK_THROWS_WITH(SwapDir(tmpfs, kKey, 0), Catch::StartsWith(kKey + ": \"" + tmpfs + "\" is on tmpfs") &&
                                                 Catch::Contains("O_DIRECT") && Catch::Contains("ext4/xfs"));
  // Nothing is left behind in the refused directory.
  for (const auto& entry : fs::directory_iterator(tmpfs)) {
    CHECK(entry.path().filename().string().rfind("zeroshard-swap-", 0) != 0);
  }
}

TEST_CASE("a dead run's directory is named with its size and kept; a live run's is left alone", "[swap]") {
  TempDir parent;
  const fs::path dead = dead_run_dir(parent.path, "zeroshard-swap-otherhost-4242-rank0", 5000, true);
  const fs::path died_early = dead_run_dir(parent.path, "zeroshard-swap-otherhost-4243-rank1", 10, false);
  const fs::path live = dead_run_dir(parent.path, "zeroshard-swap-otherhost-777-rank0", 100, true);
  const fs::path unrelated = dead_run_dir(parent.path, "my-data", 1, true);

  // The live run is another process holding the lock, as a running zeroshard rank does.
  int ready[2];
  int release[2];
  REQUIRE(pipe(ready) == 0);
  REQUIRE(pipe(release) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::close(release[1]);  // else its own copy of the write end would keep the read below from ending
    const int fd = ::open((live / ".lock").c_str(), O_RDWR);
    const char ok = fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) == 0 ? 'y' : 'n';
    (void)!::write(ready[1], &ok, 1);
    char byte;
    (void)!::read(release[0], &byte, 1);  // returns when the parent closes its end
    _exit(0);
  }
  ::close(ready[1]);
  ::close(release[0]);
  char ok = 'n';
  REQUIRE(::read(ready[0], &ok, 1) == 1);
  REQUIRE(ok == 'y');

  CapturedWarnings warnings;
  {
    SwapDir swap(parent.path.string(), kKey, 0);
    CHECK(warnings.mentioning(dead.string() + " (5000 bytes)") == 1);
    CHECK(warnings.mentioning(died_early.string() + " (10 bytes)") == 1);
    CHECK(warnings.mentioning("ended without cleaning up") == 2);
    CHECK(warnings.mentioning("can be deleted") == 2);
    CHECK(warnings.mentioning(live.string()) == 0);
    CHECK(warnings.mentioning(unrelated.string()) == 0);
    CHECK(warnings.mentioning(swap.path()) == 0);
  }
  ::close(release[1]);
  int status = 0;
  waitpid(child, &status, 0);
  // The probe locks were given back at once and nothing was deleted.
  for (const fs::path& d : {dead, died_early, live, unrelated}) CHECK(fs::exists(d / "optimizer.swp"));
  const int fd = ::open((dead / ".lock").c_str(), O_RDONLY);
  REQUIRE(fd >= 0);
  CHECK(flock(fd, LOCK_EX | LOCK_NB) == 0);
  ::close(fd);
}

TEST_CASE("require_space names the bytes needed and available", "[swap]") {
  TempDir parent;
  SwapDir swap(parent.path.string(), kKey, 0);
  const int64_t available = swap.available_bytes();
  const int64_t needed = available + (int64_t{1} << 40);
  std::string what;
  try {
    swap.require_space(needed);
  } catch (const UsageError& e) {
    what = e.what();
  }
  CHECK_THAT(what, Catch::StartsWith(kKey + ": " + swap.path() + " needs " + std::to_string(needed) + " bytes"));
  std::smatch m;
  REQUIRE(std::regex_search(what, m, std::regex("has ([0-9]+) bytes available")));
  // The disk is shared with other work: its free space moves a little between the two reads.
  CHECK(std::abs(std::stoll(m[1].str()) - available) < (int64_t{1} << 30));
}
