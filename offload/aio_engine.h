// Asynchronous file I/O for NVMe offload: reads and writes of large, block-aligned host buffers
// to and from files opened with O_DIRECT, split into `block_size` requests with `queue_depth` of
// them in flight per worker thread (`intra_op_parallelism` workers). The kernel interface is
// io_uring (liburing) where it is available and allowed, else Linux AIO (libaio); which one is in
// use, and why, is reported once. Torch-free: buffers are plain pointers.
//
// Every failure (an errno from the kernel, a short transfer) is an IoError that names the file,
// the offset and the size of the request, raised by the wait() of the request it belongs to.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "runtime/error.h"

namespace zeroshard {

// An I/O request failed: what() names the file, offset, size, operation and reason.
struct IoError : Error {
  using Error::Error;
};

// The `aio` block's settings, as the engine uses them.
struct AioOptions {
  int64_t block_size = 1048576;       // bytes per request; a multiple of kDirectAlignment
  int64_t queue_depth = 8;            // requests in flight per worker
  int64_t intra_op_parallelism = 1;   // worker threads, each with its own ring / context
  bool single_submit = false;         // submit requests one at a time instead of in batches
  bool overlap_events = true;         // submit new requests before reaping every completion
  // "auto" (io_uring, else libaio), "io_uring" or "libaio" (an error if that one cannot run).
  std::string backend = "auto";
};

// O_DIRECT needs buffers, offsets and sizes aligned to the device's logical block; 4096 covers
// every device zeroshard supports.
constexpr int64_t kDirectAlignment = 4096;
constexpr int64_t align_up(int64_t bytes) { return (bytes + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment; }

// A file opened for direct I/O; closed by the destructor. The engine reads and writes it.
class DirectFile {
 public:
  // Opens (creating when `create`) `path` with O_DIRECT; an IoError naming the path and the
  // reason otherwise (EINVAL from O_DIRECT says the filesystem does not support direct I/O).
  DirectFile(const std::string& path, bool create);
  ~DirectFile();
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;
  // Reserves `bytes` on disk (fallocate): an IoError with the bytes asked and available on
  // ENOSPC, so a full disk is found now, not in the middle of a step.
  void preallocate(int64_t bytes);
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// Test hook: fail the n-th block request (1-based, counted per engine) of one kind. Also set for a
// whole process by ZEROSHARD_NVME_FAULT="<eio|short>:<read|write>:<n>" (fault tests in Python).
// Blocks are counted from the injection (the variable: from the engine's construction); the
// faulty block runs, then completes as if the kernel returned -EIO (eio) or half its bytes
// (short_transfer), through the same error path as a real failure.
struct AioFault {
  enum class Kind { none, eio, short_transfer } kind = Kind::none;
  bool on_write = false;
  int64_t nth = 0;
};

// "<eio|short>:<read|write>:<n>" as an AioFault; a UsageError naming `source` (the variable or
// call it came from) and the format otherwise.
AioFault parse_aio_fault(const std::string& spec, const std::string& source);

class AioEngine {
 public:
  explicit AioEngine(const AioOptions& options);
  ~AioEngine();  // waits for what is in flight
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  // A submitted request; wait() on it once.
  class Ticket;
  using Handle = std::shared_ptr<Ticket>;
  // Starts reading/writing `bytes` at `offset` of `file` into/from `buffer`. `buffer` and
  // `offset` are kDirectAlignment-aligned; `bytes` is a multiple of it (callers pad). The
  // buffer and the file must outlive the wait.
  Handle read(const DirectFile& file, void* buffer, int64_t bytes, int64_t offset);
  Handle write(const DirectFile& file, const void* buffer, int64_t bytes, int64_t offset);
  // Blocks until the request is done; throws its IoError if any of its blocks failed.
  static void wait(const Handle& h);

  // "io_uring" or "libaio", and why (e.g. "io_uring: available", "io_uring: requested",
  // "libaio: io_uring_queue_init failed: Operation not permitted (...)"). The engine logs
  // nothing: its owner reports these once.
  const std::string& backend() const;
  const std::string& backend_reason() const;
  const AioOptions& options() const;
  void inject_fault(const AioFault& fault);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace zeroshard
