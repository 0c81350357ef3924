// AioQueue over Linux AIO (libaio): one io_context per worker, the fallback where io_uring is not
// allowed (older kernels, container seccomp policies).
#include "offload/aio_backend.h"

#include <cerrno>
#include <cstring>

#include "runtime/error.h"

#ifdef ZEROSHARD_HAVE_LIBAIO
#include <libaio.h>
#endif

namespace zeroshard {

#ifdef ZEROSHARD_HAVE_LIBAIO
namespace {

class LibaioQueue final : public AioQueue {
 public:
  explicit LibaioQueue(int depth) : iocbs_(static_cast<size_t>(depth)), events_(static_cast<size_t>(depth)) {}
  ~LibaioQueue() override {
    if (initialised_) io_destroy(ctx_);
  }
  // 0 or -errno (libaio returns errors negated instead of setting errno).
  int init() {
    const int rc = io_setup(static_cast<int>(iocbs_.size()), &ctx_);
    initialised_ = rc == 0;
    return rc;
  }

  void prepare(const BlockIo& io) override {
    // The kernel reads the iocb at io_submit and hands its address back at completion: it lives
    // in the slot named by the tag until then.
    iocb* cb = &iocbs_.at(io.tag);
    if (io.is_write) {
      io_prep_pwrite(cb, io.fd, io.buffer, static_cast<size_t>(io.bytes), io.offset);
    } else {
      io_prep_pread(cb, io.fd, io.buffer, static_cast<size_t>(io.bytes), io.offset);
    }
    cb->data = reinterpret_cast<void*>(static_cast<uintptr_t>(io.tag));
    staged_.push_back(cb);
  }

  int submit(std::vector<BlockDone>& refused) override {
    int accepted = 0;
    size_t next = 0;
    while (next < staged_.size()) {
      const int rc = io_submit(ctx_, static_cast<long>(staged_.size() - next), &staged_[next]);
      if (rc > 0) {
        next += static_cast<size_t>(rc);
        accepted += rc;
      } else if (rc == -EINTR) {
        continue;
      } else if (rc == -EAGAIN || rc == 0) {
        break;  // out of kernel resources: the rest go with the next submit
      } else {
        // The kernel rejected the first remaining iocb (bad fd, misaligned O_DIRECT request...):
        // its error belongs to that block, and the ones behind it are still good.
        refused.push_back(BlockDone{tag_of(staged_[next]), rc});
        ++next;
      }
    }
    staged_.erase(staged_.begin(), staged_.begin() + static_cast<long>(next));
    return accepted;
  }

  int staged() const override { return static_cast<int>(staged_.size()); }

  void reap(int min_done, std::vector<BlockDone>& done) override {
    int rc;
    do {
      rc = io_getevents(ctx_, min_done, static_cast<long>(events_.size()), events_.data(), nullptr);
    } while (rc == -EINTR);
    if (rc < 0) throw Error(detail::cat("io_getevents failed: ", std::strerror(-rc)));
    for (int i = 0; i < rc; ++i) {
      // res is unsigned long in the ABI; a failure is -errno in it.
      done.push_back(BlockDone{tag_of(events_[static_cast<size_t>(i)].obj),
                               static_cast<int64_t>(static_cast<long>(events_[static_cast<size_t>(i)].res))});
    }
  }

 private:
  static uint32_t tag_of(const iocb* cb) { return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(cb->data)); }

  io_context_t ctx_ = nullptr;
  bool initialised_ = false;
  std::vector<iocb> iocbs_;
  std::vector<io_event> events_;
  std::vector<iocb*> staged_;
};

}  // namespace

std::unique_ptr<AioQueue> make_libaio_queue(int depth, std::string* why_not) {
  auto queue = std::make_unique<LibaioQueue>(depth);
  const int rc = queue->init();
  if (rc < 0) {
    *why_not = detail::cat("io_setup(", depth, ") failed: ", std::strerror(-rc),
                           rc == -EAGAIN ? " (over the system's AIO limit: raise sysctl fs.aio-max-nr "
                                           "or lower aio.queue_depth / aio.intra_op_parallelism)"
                                         : "");
    return nullptr;
  }
  return queue;
}

#else

std::unique_ptr<AioQueue> make_libaio_queue(int /*depth*/, std::string* why_not) {
  *why_not = "zeroshard was built without libaio (libaio-dev was not found when it was configured; "
             "install it and rebuild)";
  return nullptr;
}

#endif

}  // namespace zeroshard
