// Atomic checkpoint directories (runtime/checkpoint/atomic_dir.cpp): a first save and `latest`,
// replacing a tag (RENAME_EXCHANGE and move-aside), what crashed saves left being cleaned, the
// many-rank steps, and a full disk on a real 256 KiB tmpfs leaving the old checkpoint intact.
// With ATen included, Catch2's CHECK is shadowed by c10's: only REQUIRE here.
#include <catch2/catch.hpp>
#include <sys/mount.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>

#include "checkpoint_helpers.h"
#include "runtime/checkpoint/testing_hooks.h"
#include "runtime/error.h"

using namespace zeroshard;
using namespace zeroshard::checkpoint;
using namespace zs_test;

namespace {

// Names in `dir` that start with a dot: what a save leaves behind when it is not clean.
std::vector<std::string> hidden_entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string()[0] == '.') out.push_back(e.path().filename().string());
  return out;
}

// Resets the process-global test hooks when a test ends, however it ends.
struct HooksGuard {
  ~HooksGuard() { testing::hooks() = testing::Hooks{}; }
};

// A tmpfs of `size` mounted on a fresh directory, unmounted at scope exit on every path.
struct SmallFilesystem {
  TempDir mountpoint;
  bool mounted = false;
  std::string skip_reason;
  explicit SmallFilesystem(const char* size) {
    const std::string options = std::string("size=") + size;
    if (::mount("tmpfs", mountpoint.path.c_str(), "tmpfs", 0, options.c_str()) == 0) {
      mounted = true;
    } else if (errno == EPERM || errno == EACCES) {
      skip_reason = std::string("mount -t tmpfs needs root (CAP_SYS_ADMIN): ") + std::strerror(errno);
    } else {
      throw std::runtime_error(std::string("mount tmpfs: ") + std::strerror(errno));
    }
  }
  ~SmallFilesystem() {
    if (mounted && ::umount(mountpoint.path.c_str()) != 0) ::umount2(mountpoint.path.c_str(), MNT_DETACH);
  }
};

}  // namespace

TEST_CASE("atomic dir: a first save creates <tag> and latest, and leaves no temporary directory") {
  TempDir dir;
  const fs::path save_dir = dir.path / "ckpt";  // created by the save
  const Named tensors = model_tensors(1);
  save_two_rank_checkpoint(save_dir, "global_step1", tensors);
  REQUIRE(read_bytes(save_dir / "latest") == "global_step1");  // DeepSpeed's format: the tag, no newline
  REQUIRE(read_latest(save_dir) == "global_step1");
  REQUIRE(hidden_entries(save_dir).empty());
  REQUIRE_FALSE(fs::exists(save_dir / "latest.tmp"));
  REQUIRE(same_tensors(load_checkpoint(save_dir / "global_step1"), tensors));

  save_two_rank_checkpoint(save_dir, "global_step2", model_tensors(2), /*save_latest=*/false);
  REQUIRE(read_latest(save_dir) == "global_step1");  // save_latest=false keeps it
  REQUIRE(same_tensors(load_checkpoint(save_dir / "global_step2"), model_tensors(2)));
  REQUIRE(same_tensors(load_checkpoint(save_dir / "global_step1"), tensors));

  write_bytes(save_dir / "latest", "global_step2\n");  // a hand-edited latest still reads
  REQUIRE(read_latest(save_dir) == "global_step2");
  REQUIRE_FALSE(read_latest(dir.path).has_value());
  REQUIRE(find_checkpoint_dir(save_dir, "global_step2") == save_dir / "global_step2");
  REQUIRE_FALSE(find_checkpoint_dir(save_dir, "global_step3").has_value());
}

TEST_CASE("atomic dir: saving an existing tag replaces it whole, with or without RENAME_EXCHANGE") {
  HooksGuard guard;
  for (bool exchange : {true, false}) {
    INFO("rename exchange: " << exchange);
    testing::hooks().no_rename_exchange = !exchange;
    TempDir dir;
    std::vector<std::string> points;
    testing::hooks().at_point = [&](const std::string& p) { points.push_back(p); };
    save_two_rank_checkpoint(dir.path, "best", model_tensors(1));
    // A file only the old copy has must not survive into the new one.
    write_bytes(dir.path / "best" / "old-only.txt", "x");
    save_two_rank_checkpoint(dir.path, "best", model_tensors(2));
    REQUIRE(same_tensors(load_checkpoint(dir.path / "best"), model_tensors(2)));
    REQUIRE_FALSE(fs::exists(dir.path / "best" / "old-only.txt"));
    REQUIRE(hidden_entries(dir.path).empty());
    REQUIRE(read_latest(dir.path) == "best");
    const std::string step = exchange ? "commit:after_exchange" : "commit:after_move_aside";
    REQUIRE(std::count(points.begin(), points.end(), step) == 1);
  }
}

TEST_CASE("atomic dir: the next save cleans what crashed saves left, restoring a moved-aside copy") {
  TempDir dir;
  save_two_rank_checkpoint(dir.path, "kept", model_tensors(1));
  save_two_rank_checkpoint(dir.path, "replaced", model_tensors(2));
  // A crash mid-write, a crash after an exchange, a crash after the second rename (the old
  // copy still aside) and a crash between the two renames (the only copy aside).
  fs::create_directory(dir.path / ".tmp-global_step9-0badf00d");
  write_bytes(dir.path / ".tmp-global_step9-0badf00d" / "rank0.safetensors", "partial");
  fs::create_directory(dir.path / ".tmp-kept-12345678");
  fs::copy(dir.path / "replaced", dir.path / ".aside-replaced");
  fs::rename(dir.path / "kept", dir.path / ".aside-kept");
  REQUIRE(find_checkpoint_dir(dir.path, "kept") == dir.path / ".aside-kept");  // loadable meanwhile
  REQUIRE(same_tensors(load_checkpoint(*find_checkpoint_dir(dir.path, "kept")), model_tensors(1)));

  auto next = StagedCheckpoint::create(dir.path, "global_step10");
  std::vector<std::string> hidden = hidden_entries(dir.path);
  REQUIRE(hidden == std::vector<std::string>{next.temp_name()});
  REQUIRE(same_tensors(load_checkpoint(dir.path / "kept"), model_tensors(1)));
  REQUIRE(same_tensors(load_checkpoint(dir.path / "replaced"), model_tensors(2)));
}

TEST_CASE("atomic dir: the many-rank steps: attach, release, and an uncommitted save removed") {
  TempDir dir;
  {
    auto rank0 = StagedCheckpoint::create(dir.path, "t1");
    auto rank1 = StagedCheckpoint::attach(dir.path, "t1", rank0.temp_name());
    REQUIRE(rank1.temp_dir() == rank0.temp_dir());
    write_file_durably(rank1.file("rank1.txt"), "from rank 1");
    rank1.release();  // rank 1 is done; its handle goes away before rank 0 commits
  }
  // Rank 0 never committed (another rank failed): nothing is left, `latest` was never written.
  REQUIRE(hidden_entries(dir.path).empty());
  REQUIRE_FALSE(fs::exists(dir.path / "t1"));
  REQUIRE_FALSE(fs::exists(dir.path / "latest"));

  auto rank0 = StagedCheckpoint::create(dir.path, "t2");
  {
    auto rank1 = StagedCheckpoint::attach(dir.path, "t2", rank0.temp_name());
    write_file_durably(rank1.file("rank1.txt"), "from rank 1");
    rank1.release();
  }
  write_file_durably(rank0.file("rank0.txt"), "from rank 0");
  rank0.commit();
  REQUIRE(read_bytes(dir.path / "t2" / "rank1.txt") == "from rank 1");
  REQUIRE(read_bytes(dir.path / "t2" / "rank0.txt") == "from rank 0");
  REQUIRE(read_latest(dir.path) == "t2");
  REQUIRE_THROWS_WITH(rank0.commit(), Catch::Contains("commit() after commit"));

  REQUIRE_THROWS_WITH(StagedCheckpoint::attach(dir.path, "t3", ".tmp-t3-00000000"),
                      Catch::Contains("does not exist: rank 0 creates it"));
  REQUIRE_THROWS_AS(StagedCheckpoint::attach(dir.path, "t3", "../x"), UsageError);
  for (const char* bad : {"", "a/b", ".hidden", "latest", "latest.tmp", ".."}) {
    INFO("tag \"" << bad << "\"");
    REQUIRE_THROWS_AS(StagedCheckpoint::create(dir.path, bad), UsageError);
  }
  REQUIRE_THROWS_WITH(validate_tag("a/b"), Catch::Contains("no '/'"));
  REQUIRE_THROWS_AS(rank0.file("../escape"), UsageError);
}

TEST_CASE("atomic dir: a full disk is found, named with the bytes, and loses nothing") {
  HooksGuard guard;
  SmallFilesystem small("256k");
  if (!small.mounted) {
    std::cout << "SKIPPED the ENOSPC test: " << small.skip_reason << std::endl;
    WARN("skipped: " << small.skip_reason);
    return;
  }
  const fs::path save_dir = small.mountpoint.path / "ckpt";
  const Named old_tensors = model_tensors(1);  // about 3 KiB
  save_two_rank_checkpoint(save_dir, "global_step1", old_tensors);

  struct Case {
    const char* what;
    bool skip_reserve;  // true: the space runs out during write(), not at the reservation
    std::vector<int64_t> file_elements;  // F32 elements per file written into the save
    const char* call;
  };
  const std::vector<Case> cases = {
      {"one file too large, at the reservation", false, {100000}, "fallocate"},
      {"the second file does not fit, at its reservation", false, {40000, 40000}, "fallocate"},
      {"no reservation: during the write", true, {100000}, "write"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    testing::hooks().skip_reserve = c.skip_reserve;
    std::string message;
    fs::path failing;
    try {
      auto staged = StagedCheckpoint::create(save_dir, "global_step2");
      std::vector<std::unique_ptr<SafetensorsWriter>> writers;
      // Every file is created (and reserved) before any data is written, as the engine will.
      for (size_t i = 0; i < c.file_elements.size(); ++i) {
        failing = staged.file("rank" + std::to_string(i) + ".safetensors");
        writers.push_back(std::make_unique<SafetensorsWriter>(
            failing, std::vector<TensorSpec>{{"w", "F32", {c.file_elements[i]}}}));
      }
      for (size_t i = 0; i < writers.size(); ++i) {
        failing = writers[i]->path();
        writers[i]->append(pattern(at::kFloat, {c.file_elements[i]}, 2));
        writers[i]->close();
      }
      staged.commit();
    } catch (const Error& e) {
      message = e.what();
    }
    INFO(message);
    const uint64_t needed = safetensors_file_bytes({{"w", "F32", {c.file_elements.back()}}});
    REQUIRE_THAT(message, Catch::Contains(std::string(c.call) + " ") && Catch::Contains(failing.string()) &&
                              Catch::Contains("No space left on device: needs ") &&
                              Catch::Contains("), the filesystem has ") && Catch::Contains(") available"));
    // At a reservation the whole file is needed; during a write, what was still to come.
    if (!c.skip_reserve) REQUIRE_THAT(message, Catch::Contains("needs " + std::to_string(needed) + " bytes ("));
    REQUIRE(hidden_entries(save_dir).empty());  // the temporary directory is gone
    REQUIRE_FALSE(fs::exists(save_dir / "global_step2"));
    REQUIRE(read_latest(save_dir) == "global_step1");
    REQUIRE(same_tensors(load_checkpoint(save_dir / "global_step1"), old_tensors));
  }
  // The space came back: the next save fits and commits.
  testing::hooks().skip_reserve = false;
  save_two_rank_checkpoint(save_dir, "global_step3", model_tensors(3));
  REQUIRE(read_latest(save_dir) == "global_step3");
}
