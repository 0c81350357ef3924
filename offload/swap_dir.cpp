// SwapDir: one rank's NVMe swap directory, checked up front so a bad nvme_path is a config error
// at startup, not an I/O error in the middle of a step; see swap_dir.h.
#include "offload/swap_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "offload/filesystem.h"
#include "runtime/error.h"
#include "runtime/log.h"

namespace zeroshard {
namespace {

constexpr const char* kPrefix = "zeroshard-swap-";
constexpr const char* kLockName = ".lock";
constexpr const char* kProbeName = ".odirect-probe";
constexpr int64_t kProbeBytes = 4096;

// Bytes in the files under `dir` (what deleting it would free).
int64_t tree_bytes(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return 0;
  int64_t total = 0;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st {};
    const std::string child = dir + "/" + name;
    if (lstat(child.c_str(), &st) != 0) continue;
    if (S_ISDIR(st.st_mode)) total += tree_bytes(child);
    else if (S_ISREG(st.st_mode)) total += static_cast<int64_t>(st.st_size);
  }
  closedir(d);
  return total;
}

// Best effort: a destructor and a failed constructor use it, and neither may throw.
void remove_tree(const std::string& dir) {
  if (DIR* d = opendir(dir.c_str())) {
    while (const dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      const std::string child = dir + "/" + name;
      struct stat st {};
      if (lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) remove_tree(child);
      else ::unlink(child.c_str());
    }
    closedir(d);
  }
  ::rmdir(dir.c_str());
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "unknown-host";
  std::string name(buf);
  for (char& c : name) {
    if (c == '/') c = '_';  // never a path separator in a directory name
  }
  return name;
}

// Writes one aligned block with O_DIRECT: some filesystems take the flag at open and refuse the
// write. Returns 0 or the errno of the call that failed, naming it in `call`.
int probe_direct_write(const std::string& file, const char** call) {
  *call = "open";
  const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) return errno;
  *call = "write";
  int err = 0;
  void* block = nullptr;
  if (posix_memalign(&block, kProbeBytes, kProbeBytes) != 0) {
    err = ENOMEM;
  } else {
    std::memset(block, 0, kProbeBytes);
    ssize_t wrote;
    do {
      wrote = ::pwrite(fd, block, kProbeBytes, 0);
    } while (wrote < 0 && errno == EINTR);
    if (wrote < 0) err = errno;
    else if (wrote != kProbeBytes) err = EIO;
    std::free(block);
  }
  ::close(fd);
  ::unlink(file.c_str());
  return err;
}

// Directories of this naming whose lock nobody holds: their runs died. Named, never deleted (the
// user may want the files, and a mistaken delete cannot be undone).
void warn_about_stale_siblings(const std::string& parent, const std::string& own_name) {
  DIR* d = opendir(parent.c_str());
  if (d == nullptr) return;
  while (const dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind(kPrefix, 0) != 0 || name == own_name) continue;
    const std::string dir = parent + "/" + name;
    struct stat st {};
    if (lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    const int fd = ::open((dir + "/" + kLockName).c_str(), O_RDONLY | O_CLOEXEC);
    bool stale;
    if (fd < 0) {
      // No lock file in a directory that is still there: a directory of the prefix always has
      // one while its run lives (it is locked before it is renamed into place, and renamed away
      // before it is emptied), so its run died. One that vanished meanwhile was removed by its
      // owner; another error (another user's directory) is not ours to judge.
      stale = errno == ENOENT && lstat(dir.c_str(), &st) == 0;
    } else {
      // Taking the lock proves nobody holds it; closing the descriptor gives it back at once.
      stale = flock(fd, LOCK_EX | LOCK_NB) == 0;
      ::close(fd);
    }
    if (stale) {
      warn(detail::cat("NVMe swap directory ", dir, " (", tree_bytes(dir),
                       " bytes) belongs to a zeroshard run that ended without cleaning up (no process holds its ",
                       kLockName, "); it can be deleted"));
    }
  }
  closedir(d);
}

// The directories of the SwapDirs alive in this process, removed at exit when their owners were
// never destroyed (Python does not free every object before the interpreter ends). Built on
// first use, before the exit handler is registered, so it outlives the handler's call.
struct LiveDirs {
  std::mutex mutex;
  std::vector<std::pair<std::string, pid_t>> dirs;  // path, the process that made it
};

void remove_live_dirs_at_exit();

LiveDirs& live_dirs() {
  static LiveDirs* dirs = [] {
    auto* d = new LiveDirs();  // never destroyed: the exit handler may run after static destructors
    std::atexit(remove_live_dirs_at_exit);
    return d;
  }();
  return *dirs;
}

// Out of the prefix's names first, so no scan takes a directory being emptied for a dead run's.
void remove_owned(const std::string& path) {
  const size_t slash = path.rfind('/');
  const std::string gone = path.substr(0, slash + 1) + ".old-" + path.substr(slash + 1);
  remove_tree(::rename(path.c_str(), gone.c_str()) == 0 ? gone : path);
}

void remove_live_dirs_at_exit() {
  LiveDirs& d = live_dirs();
  std::lock_guard<std::mutex> lock(d.mutex);
  for (const auto& [path, pid] : d.dirs) {
    if (pid == ::getpid()) remove_owned(path);
  }
  d.dirs.clear();
}

}  // namespace

SwapDir::SwapDir(const std::string& nvme_path, const std::string& config_key, int rank) : config_key_(config_key) {
  ZS_REQUIRE(rank >= 0, "SwapDir: rank must be >= 0, got ", rank);
  ZS_REQUIRE(!nvme_path.empty(), config_key, ": is empty; set it to a directory on a local NVMe disk");
  auto refuse = [&](const std::string& what) {
    return UsageError(detail::cat(config_key, ": \"", nvme_path, "\" ", what));
  };
  struct stat st {};
  if (::stat(nvme_path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) {
      throw refuse("does not exist; create it (mkdir -p) or set " + config_key +
                   " to an existing directory on a local NVMe disk");
    }
    throw refuse(detail::cat("cannot be inspected (stat: ", std::strerror(err), "); set ", config_key,
                             " to a directory this user can reach"));
  }
  if (!S_ISDIR(st.st_mode)) {
    throw refuse("is not a directory; set " + config_key + " to a directory on a local NVMe disk");
  }
  if (::access(nvme_path.c_str(), W_OK | X_OK) != 0) {
    throw refuse(detail::cat("is not writable (", std::strerror(errno), "); make it writable by this user or set ",
                             config_key, " to another directory"));
  }
  if (filesystem_in_memory(nvme_path)) {
    throw refuse(detail::cat("is on ", filesystem_type(nvme_path),
                             ", which keeps files in host memory and has no real O_DIRECT (older kernels refuse "
                             "the flag, newer ones only accept it): offloading there would use the memory it is "
                             "meant to free; use a directory on a local disk (ext4/xfs)"));
  }

  std::string parent = nvme_path;
  while (parent.size() > 1 && parent.back() == '/') parent.pop_back();
  const std::string base = parent == "/" ? "" : parent;
  // A process may hold several (two engines, or one made before the last was freed): numbered.
  static std::atomic<int64_t> made{0};
  const std::string own_name = detail::cat(kPrefix, host_name(), "-", ::getpid(), "-", made++, "-rank", rank);
  // Made and locked under a name no scan matches, then renamed into place: a directory of the
  // prefix always has its lock file, held while its run lives.
  const std::string staging = base + "/.new-" + own_name;
  path_ = staging;
  if (::mkdir(staging.c_str(), 0700) != 0) {
    throw refuse(detail::cat("is not writable: cannot create ", staging, " (", std::strerror(errno),
                             "); make it writable by this user or set ", config_key, " to another directory"));
  }
  lock_fd_ = ::open(file(kLockName).c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd_ < 0 || flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (lock_fd_ >= 0) ::close(lock_fd_);
    lock_fd_ = -1;
    remove_tree(staging);
    throw refuse(detail::cat("is not writable: cannot create and lock ", staging, "/", kLockName, " (",
                             std::strerror(err), ")"));
  }

  const char* call = "";
  int err = probe_direct_write(file(kProbeName), &call);
  if (err == 0 && ::rename(staging.c_str(), (base + "/" + own_name).c_str()) != 0) {
    err = errno;
    call = "rename into place";
  }
  if (err != 0) {
    remove_tree(staging);
    ::close(lock_fd_);
    lock_fd_ = -1;
    if (err == EINVAL) {
      throw refuse(detail::cat("is on a filesystem (", filesystem_type(nvme_path), ") that does not support O_DIRECT (",
                               call, " of a test file with O_DIRECT: ", std::strerror(err),
                               "); use a directory on a local disk (ext4/xfs)"));
    }
    throw refuse(detail::cat("cannot take swap files: ", call, " of a ", kProbeBytes,
                             "-byte test file with O_DIRECT in ", staging, " failed: ", std::strerror(err)));
  }
  path_ = base + "/" + own_name;
  owner_pid_ = ::getpid();
  warn_about_stale_siblings(parent, own_name);
  LiveDirs& live = live_dirs();
  std::lock_guard<std::mutex> lock(live.mutex);
  live.dirs.emplace_back(path_, owner_pid_);
}

SwapDir::~SwapDir() {
  if (path_.empty() || lock_fd_ < 0) return;
  {
    LiveDirs& live = live_dirs();
    std::lock_guard<std::mutex> lock(live.mutex);
    live.dirs.erase(std::remove(live.dirs.begin(), live.dirs.end(), std::make_pair(path_, owner_pid_)),
                    live.dirs.end());
  }
  // A child of fork() that exits does not own its parent's directory.
  if (::getpid() == owner_pid_) remove_owned(path_);
  ::close(lock_fd_);  // the lock goes last: until the directory is gone, no scan may call it stale
}

std::string SwapDir::file(const std::string& name) const {
  ZS_REQUIRE(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos,
             "SwapDir::file: \"", name, "\" must be a plain file name (no '/')");
  return path_ + "/" + name;
}

void SwapDir::require_space(int64_t bytes) const {
  const int64_t available = available_bytes();
  if (available >= bytes) return;
  throw UsageError(detail::cat(config_key_, ": ", path_, " needs ", bytes,
                               " bytes for swap files but its filesystem has ", available,
                               " bytes available; free space there or set ", config_key_,
                               " to a directory on a larger disk"));
}

int64_t SwapDir::available_bytes() const {
  const int64_t available = filesystem_available_bytes(path_);
  if (available < 0) {
    throw Error(detail::cat("SwapDir: statvfs ", path_, " failed: ", std::strerror(static_cast<int>(-available))));
  }
  return available;
}

}  // namespace zeroshard
