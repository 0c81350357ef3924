// One run's NVMe swap directory on one rank: <nvme_path>/zeroshard-swap-<host>-<pid>-<n>-rank<r>/
// (n numbers the SwapDirs of one process),
// checked when it is made (the path exists, is a writable directory, and its filesystem takes
// O_DIRECT), held by an flock on a lock file inside it for as long as the process lives, and
// removed with its files by the destructor, or at process exit when its owner was never destroyed
// (a clean exit, or one by an exception; not kill -9). A directory of this naming whose lock
// nobody holds belongs to a run that died: it is named in a warning with its size, never deleted
// (a lock another process holds means a live run owns it: left alone, not named).
#pragma once
#include <cstdint>
#include <string>

namespace zeroshard {

class SwapDir {
 public:
  // `config_key` (e.g. "zero_optimization.offload_optimizer.nvme_path") is named in every error:
  // a UsageError that says the path, what is wrong and the fix (missing, not a directory, not
  // writable, no O_DIRECT: tmpfs and some network filesystems refuse it).
  SwapDir(const std::string& nvme_path, const std::string& config_key, int rank);
  ~SwapDir();
  SwapDir(const SwapDir&) = delete;
  SwapDir& operator=(const SwapDir&) = delete;

  const std::string& path() const { return path_; }
  // The path of a file `name` inside the directory (not created).
  std::string file(const std::string& name) const;
  // Before preallocating `bytes` in total: a UsageError naming the key, the path, the bytes
  // needed and the bytes available when the filesystem has fewer free.
  void require_space(int64_t bytes) const;
  // Free bytes on the directory's filesystem for an unprivileged writer (statvfs f_bavail).
  int64_t available_bytes() const;

 private:
  std::string path_;
  std::string config_key_;
  int lock_fd_ = -1;
  int owner_pid_ = -1;  // the process that made it (a fork()ed child does not remove it)
};

}  // namespace zeroshard
