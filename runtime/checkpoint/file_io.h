// Checked POSIX file I/O for checkpoints. Every failure is an Error naming the call, the path and
// strerror; a full disk (ENOSPC, EDQUOT) also names the bytes still needed and the bytes the
// filesystem has available, because "no space" alone does not tell the user how much to free.
// Files are written through one buffer and fsync'd on close; reads are pread, so many threads
// (or ranks) can read disjoint ranges of one file.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace zeroshard::checkpoint {

namespace fs = std::filesystem;

// Throws Error("<call> <path>: <strerror(err)>"); for ENOSPC/EDQUOT the message adds
// "needs <bytes_needed> bytes, the filesystem has <n> bytes available" (statvfs at this moment).
[[noreturn]] void throw_io_error(const std::string& call, const fs::path& path, int err,
                                 uint64_t bytes_needed = 0);

// Bytes an unprivileged writer can still allocate on the filesystem holding `path`.
uint64_t available_bytes(const fs::path& path);

// A new file written front to back: created (or truncated), reserved, buffered, fsync'd on close.
class OutputFile {
 public:
  // Creates `path` and reserves `reserve_bytes` with fallocate, so a full disk is an error here,
  // before any data is written. Filesystems without fallocate skip the reservation (a full disk
  // then shows at write()).
  OutputFile(fs::path path, uint64_t reserve_bytes);
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  // Closes without fsync if close() was not reached (an error path: the file is abandoned).
  ~OutputFile();

  void write(const void* data, uint64_t num_bytes);
  // Writes the buffer out, fsyncs and closes. The file is durable once this returns.
  void close();

  const fs::path& path() const { return path_; }
  uint64_t bytes_written() const { return bytes_written_; }

 private:
  void flush();
  void write_fully(const char* data, uint64_t num_bytes);

  fs::path path_;
  int fd_ = -1;
  uint64_t reserved_bytes_ = 0;
  uint64_t bytes_written_ = 0;  // accepted by write(), buffered or not
  std::vector<char> buffer_;
  size_t buffered_ = 0;
};

// A file read with pread at any offset. Not copyable; closes on destruction.
class InputFile {
 public:
  explicit InputFile(fs::path path);
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  InputFile(InputFile&& other) noexcept;
  ~InputFile();

  const fs::path& path() const { return path_; }
  uint64_t size() const { return size_; }
  // Reads exactly `num_bytes` at `offset`; a file that ends first is an Error naming the path,
  // `what` (e.g. "tensor \"w\""), the offset and the size, and saying the file is truncated.
  void read_at(uint64_t offset, void* out, uint64_t num_bytes, const std::string& what) const;

 private:
  fs::path path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// fsync on a directory: makes the entries created, renamed or removed in it durable.
void fsync_directory(const fs::path& dir);
// Writes `content` to a new file at `path` (reserved, fsync'd; removed again on an error); the
// directory is not fsync'd.
void write_file_durably(const fs::path& path, const std::string& content);
// The whole content of a small file (a manifest, `latest`).
std::string read_small_file(const fs::path& path);

}  // namespace zeroshard::checkpoint
