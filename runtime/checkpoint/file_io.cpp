// Checked POSIX I/O for checkpoints (file_io.h): one write buffer per file, fallocate reservation,
// fsync on close, pread for reads, and errors that name the path (and the bytes, for ENOSPC).
#include "runtime/checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "runtime/checkpoint/testing_hooks.h"
#include "runtime/error.h"

namespace zeroshard::checkpoint {
namespace {

constexpr size_t kBufferBytes = size_t(4) << 20;  // large enough that syscalls cost little

std::string human_bytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = double(n);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof text, unit == 0 ? "%.0f %s" : "%.1f %s", value, units[unit]);
  return text;
}

}  // namespace

uint64_t available_bytes(const fs::path& path) {
  struct statvfs st {};
  fs::path probe = path;
  // The file itself may not exist (its creation failed); its directory tells the same.
  while (::statvfs(probe.c_str(), &st) != 0) {
    if (!probe.has_parent_path() || probe.parent_path() == probe) return 0;
    probe = probe.parent_path();
  }
  return uint64_t(st.f_bavail) * uint64_t(st.f_frsize);
}

void throw_io_error(const std::string& call, const fs::path& path, int err, uint64_t bytes_needed) {
  std::string message = "checkpoint: " + call + " " + path.string() + ": " + std::strerror(err);
  if (err == ENOSPC || err == EDQUOT) {
    const uint64_t available = available_bytes(path);
    message += detail::cat(": needs ", bytes_needed, " bytes (", human_bytes(bytes_needed), "), the filesystem has ",
                           available, " bytes (", human_bytes(available), ") available");
  }
  throw Error(message);
}

OutputFile::OutputFile(fs::path path, uint64_t reserve_bytes)
    : path_(std::move(path)), reserved_bytes_(reserve_bytes) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw_io_error("open", path_, errno, reserve_bytes);
  if (reserve_bytes > 0 && !testing::hooks().skip_reserve) {
    int rc;
    do {
      rc = ::fallocate(fd_, 0, 0, off_t(reserve_bytes));
    } while (rc != 0 && errno == EINTR);
    // Filesystems without fallocate (some network ones) go on unreserved.
    if (rc != 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
      const int err = errno;
      ::close(fd_);
      fd_ = -1;
      ::unlink(path_.c_str());  // no empty file left behind under the name
      throw_io_error("fallocate (reserving space for)", path_, err, reserve_bytes);
    }
  }
  buffer_.resize(kBufferBytes);
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutputFile::write_fully(const char* data, uint64_t num_bytes) {
  while (num_bytes > 0) {
    const ssize_t n = ::write(fd_, data, size_t(std::min<uint64_t>(num_bytes, uint64_t(1) << 30)));
    if (n < 0) {
      if (errno == EINTR) continue;
      // What is still to come: this call's rest plus what the caller announced beyond it.
      const uint64_t later = reserved_bytes_ > bytes_written_ ? reserved_bytes_ - bytes_written_ : 0;
      throw_io_error("write", path_, errno, num_bytes + later);
    }
    data += n;
    num_bytes -= uint64_t(n);
  }
}

void OutputFile::flush() {
  if (buffered_ == 0) return;
  const size_t n = buffered_;
  buffered_ = 0;  // a failed flush is not retried: the file is abandoned
  write_fully(buffer_.data(), n);
}

void OutputFile::write(const void* data, uint64_t num_bytes) {
  ZS_CHECK(fd_ >= 0, "OutputFile::write on closed ", path_.string());
  const char* bytes = static_cast<const char*>(data);
  if (buffered_ + num_bytes <= buffer_.size()) {
    std::memcpy(buffer_.data() + buffered_, bytes, size_t(num_bytes));
    buffered_ += size_t(num_bytes);
    bytes_written_ += num_bytes;
    return;
  }
  flush();
  bytes_written_ += num_bytes;
  if (num_bytes >= buffer_.size()) {
    write_fully(bytes, num_bytes);  // large: straight from the caller's memory, no copy
  } else {
    std::memcpy(buffer_.data(), bytes, size_t(num_bytes));
    buffered_ = size_t(num_bytes);
  }
}

void OutputFile::close() {
  ZS_CHECK(fd_ >= 0, "OutputFile::close twice on ", path_.string());
  flush();
  // A reservation larger than what was written would leave zeros at the end.
  if (reserved_bytes_ > bytes_written_ && ::ftruncate(fd_, off_t(bytes_written_)) != 0)
    throw_io_error("ftruncate", path_, errno);
  if (::fsync(fd_) != 0) throw_io_error("fsync", path_, errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) throw_io_error("close", path_, errno);
}

InputFile::InputFile(fs::path path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) throw_io_error("open", path_, errno);
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    throw_io_error("fstat", path_, err);
  }
  size_ = uint64_t(st.st_size);
}

InputFile::InputFile(InputFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(other.fd_), size_(other.size_) {
  other.fd_ = -1;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InputFile::read_at(uint64_t offset, void* out, uint64_t num_bytes, const std::string& what) const {
  char* dst = static_cast<char*>(out);
  uint64_t done = 0;
  while (done < num_bytes) {
    const ssize_t n = ::pread(fd_, dst + done, size_t(std::min<uint64_t>(num_bytes - done, uint64_t(1) << 30)),
                              off_t(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_io_error("pread", path_, errno);
    }
    if (n == 0) {
      throw Error(detail::cat("checkpoint: ", path_.string(), " is truncated: ", what, " needs bytes [",
                              offset, ", ", offset + num_bytes, ") but the file ends at byte ",
                              offset + done));
    }
    done += uint64_t(n);
  }
}

void fsync_directory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_io_error("open (directory)", dir, errno);
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    throw_io_error("fsync (directory)", dir, err);
  }
  ::close(fd);
}

void write_file_durably(const fs::path& path, const std::string& content) {
  OutputFile file(path, content.size());
  try {
    file.write(content.data(), content.size());
    file.close();
  } catch (...) {
    ::unlink(path.c_str());
    throw;
  }
}

std::string read_small_file(const fs::path& path) {
  InputFile file(path);
  std::string content(size_t(file.size()), '\0');
  file.read_at(0, content.data(), content.size(), "its content");
  return content;
}

}  // namespace zeroshard::checkpoint
