// AioQueue over io_uring (liburing): one ring per worker, sized to its queue depth.
#include "offload/aio_backend.h"

#include <cerrno>
#include <cstring>

#include "runtime/error.h"

#ifdef ZEROSHARD_HAVE_URING
#include <liburing.h>
#endif

namespace zeroshard {

#ifdef ZEROSHARD_HAVE_URING
namespace {

// The usual reasons a ring cannot be made, so the fallback message says what to change.
std::string init_hint(int err) {
  switch (err) {
    case EPERM:
      return " (io_uring is disabled here: sysctl kernel.io_uring_disabled, or a seccomp policy "
             "such as a container runtime's default)";
    case ENOSYS:
      return " (the kernel has no io_uring: Linux 5.1 or newer is needed)";
    case ENOMEM:
      return " (the ring did not fit in RLIMIT_MEMLOCK: raise `ulimit -l` or lower aio.queue_depth)";
    default:
      return "";
  }
}

class UringQueue final : public AioQueue {
 public:
  // The ring stays where it was initialised: liburing's calls take its address.
  UringQueue() = default;
  ~UringQueue() override {
    if (initialised_) io_uring_queue_exit(&ring_);
  }
  // 0 or -errno.
  int init(int depth) {
    const int rc = io_uring_queue_init(static_cast<unsigned>(depth), &ring_, 0);
    initialised_ = rc == 0;
    return rc;
  }

  void prepare(const BlockIo& io) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    // The ring has depth entries and the worker never holds more than depth requests.
    ZS_CHECK(sqe != nullptr, "io_uring submission queue full with ", staged_, " staged requests");
    if (io.is_write) {
      io_uring_prep_write(sqe, io.fd, io.buffer, static_cast<unsigned>(io.bytes), static_cast<__u64>(io.offset));
    } else {
      io_uring_prep_read(sqe, io.fd, io.buffer, static_cast<unsigned>(io.bytes), static_cast<__u64>(io.offset));
    }
    io_uring_sqe_set_data64(sqe, io.tag);
    ++staged_;
  }

  int submit(std::vector<BlockDone>& /*refused: io_uring reports bad requests as completions*/) override {
    if (staged_ == 0) return 0;
    int rc;
    do {
      rc = io_uring_submit(&ring_);
    } while (rc == -EINTR);
    if (rc >= 0) {
      staged_ -= rc;  // what the kernel did not take stays in the submission queue for next time
      return rc;
    }
    // Out of kernel memory or completion queue full: retried once a completion frees some.
    if (rc == -EAGAIN || rc == -EBUSY) return 0;
    throw Error(detail::cat("io_uring_submit failed: ", std::strerror(-rc)));
  }

  int staged() const override { return staged_; }

  void reap(int min_done, std::vector<BlockDone>& done) override {
    io_uring_cqe* cqe = nullptr;
    if (min_done > 0) {
      int rc;
      do {
        rc = io_uring_wait_cqe_nr(&ring_, &cqe, static_cast<unsigned>(min_done));
      } while (rc == -EINTR);
      if (rc < 0) throw Error(detail::cat("io_uring_wait_cqe failed: ", std::strerror(-rc)));
    }
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      done.push_back(BlockDone{static_cast<uint32_t>(io_uring_cqe_get_data64(cqe)), cqe->res});
      ++seen;
    }
    io_uring_cq_advance(&ring_, seen);
  }

 private:
  io_uring ring_{};
  bool initialised_ = false;
  int staged_ = 0;
};

}  // namespace

std::unique_ptr<AioQueue> make_uring_queue(int depth, std::string* why_not) {
  auto queue = std::make_unique<UringQueue>();
  const int rc = queue->init(depth);
  if (rc < 0) {
    *why_not = detail::cat("io_uring_queue_init failed: ", std::strerror(-rc), init_hint(-rc));
    return nullptr;
  }
  return queue;
}

#else

std::unique_ptr<AioQueue> make_uring_queue(int /*depth*/, std::string* why_not) {
  *why_not = "zeroshard was built without io_uring (liburing-dev was not found when it was configured; "
             "install it and rebuild)";
  return nullptr;
}

#endif

}  // namespace zeroshard
