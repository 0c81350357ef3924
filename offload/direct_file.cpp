// DirectFile (declared in aio_engine.h): a file descriptor opened with O_DIRECT, and its
// preallocation, with errors that say which file and why.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "offload/aio_engine.h"
#include "offload/filesystem.h"

namespace zeroshard {
namespace {

// The directory holding `path` (the file itself may not exist when open failed).
std::string parent_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

DirectFile::DirectFile(const std::string& path, bool create) : path_(path) {
  const int flags = O_RDWR | O_DIRECT | O_CLOEXEC | (create ? O_CREAT : 0);
  do {
    fd_ = ::open(path.c_str(), flags, 0600);
  } while (fd_ < 0 && errno == EINTR);
  if (fd_ >= 0) return;
  const int err = errno;
  if (err == EINVAL) {
    throw IoError(detail::cat("open ", path, " with O_DIRECT: the filesystem (", filesystem_type(parent_of(path)),
                              ") does not support O_DIRECT (direct I/O); use a directory on a local disk "
                              "(ext4/xfs)"));
  }
  throw IoError(detail::cat("open ", path, create ? " (create)" : "", " with O_DIRECT: ", std::strerror(err)));
}

DirectFile::~DirectFile() {
  if (fd_ >= 0) ::close(fd_);
}

void DirectFile::preallocate(int64_t bytes) {
  ZS_REQUIRE(bytes >= 0, "DirectFile::preallocate(", path_, "): bytes must be >= 0, got ", bytes);
  if (bytes == 0) return;
  int rc;
  do {
    rc = ::fallocate(fd_, 0, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return;
  const int err = errno;
  if (err == ENOSPC) {
    const int64_t available = filesystem_available_bytes(path_);
    throw IoError(detail::cat("preallocate ", path_, ": ", bytes, " bytes asked but the filesystem has ",
                              available >= 0 ? std::to_string(available) : std::string("an unknown number of"),
                              " bytes available (", std::strerror(err),
                              "); free space or move the swap directory to a larger disk"));
  }
  throw IoError(detail::cat("preallocate ", path_, ": fallocate of ", bytes, " bytes failed: ",
                            std::strerror(err),
                            err == EOPNOTSUPP ? " (the filesystem cannot preallocate; use ext4 or xfs)" : ""));
}

}  // namespace zeroshard
