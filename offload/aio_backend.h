// The kernel side of one AioEngine worker: a queue of block reads/writes, one implementation per
// kernel interface (aio_uring.cpp, aio_libaio.cpp), chosen by AioEngine's constructor. Internal to
// offload/: the worker thread that owns a queue is its only user, so nothing here is thread-safe.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace zeroshard {

// One block request. `tag` is the worker's slot index, below the queue's depth; it comes back
// with the completion (and lets libaio keep its iocb in slot `tag`).
struct BlockIo {
  int fd = -1;
  void* buffer = nullptr;
  int64_t bytes = 0;
  int64_t offset = 0;
  bool is_write = false;
  uint32_t tag = 0;
};

// A finished request: bytes transferred, or -errno.
struct BlockDone {
  uint32_t tag = 0;
  int64_t result = 0;
};

class AioQueue {
 public:
  virtual ~AioQueue() = default;
  // Stages one request for the next submit(). The caller keeps staged + in-flight <= depth.
  virtual void prepare(const BlockIo& io) = 0;
  // Hands the staged requests to the kernel; returns how many it accepted. A request the kernel
  // refused outright is appended to `refused` with its -errno (it never reaches reap). Requests
  // left staged (the kernel was out of resources, EAGAIN) go with the next submit(). Throws Error
  // when the queue itself is broken (a bug, not a bad request): then nothing more is submitted.
  virtual int submit(std::vector<BlockDone>& refused) = 0;
  // Staged requests not yet accepted by the kernel.
  virtual int staged() const = 0;
  // Waits until at least `min_done` accepted requests finished (0: does not wait) and appends
  // every finished one to `done`. Throws Error when waiting itself fails.
  virtual void reap(int min_done, std::vector<BlockDone>& done) = 0;
};

// Each returns nullptr and says why in `why_not` when the backend cannot run here or was not
// built ("io_uring_queue_init failed: Operation not permitted (...)").
std::unique_ptr<AioQueue> make_uring_queue(int depth, std::string* why_not);
std::unique_ptr<AioQueue> make_libaio_queue(int depth, std::string* why_not);

}  // namespace zeroshard
