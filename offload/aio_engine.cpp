// AioEngine: a request is split into blocks spread over worker threads; each worker owns one
// kernel queue (aio_backend.h) and keeps it full while the caller computes. A Ticket completes
// when its last block does. DirectFile is in direct_file.cpp.
#include "offload/aio_engine.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "offload/aio_backend.h"
#include "runtime/trace.h"

namespace zeroshard {

class AioEngine::Ticket {
 public:
  Ticket(bool is_write_, std::string path_, int64_t bytes_, int64_t offset_, int64_t blocks)
      : is_write(is_write_), path(std::move(path_)), bytes(bytes_), offset(offset_), blocks_left_(blocks),
        issued_ns_(trace::on() ? trace::now_ns() : 0) {}

  // A worker reports one block (`error` empty: it succeeded); the last one wakes wait().
  void block_done(std::string error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error.empty()) {
      if (error_.empty()) error_ = std::move(error);
      else ++more_errors_;
    }
    if (--blocks_left_ == 0) {
      // The request on the trace, from its issue to its last block, on the worker that ended it.
      if (issued_ns_ != 0)
        trace::span("io", detail::cat(is_write ? "write " : "read ", path), issued_ns_, trace::now_ns(),
                    detail::cat("\"bytes\": ", bytes, ", \"offset\": ", offset));
      done_.notify_all();
    }
  }

  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return blocks_left_ == 0; });
    if (error_.empty()) return;
    if (more_errors_ == 0) throw IoError(error_);
    throw IoError(detail::cat(error_, " (and ", more_errors_, " more block(s) of this request failed)"));
  }

  const bool is_write;
  const std::string path;  // copied: an error message never reads the caller's DirectFile
  const int64_t bytes;
  const int64_t offset;

 private:
  std::mutex mu_;
  std::condition_variable done_;
  int64_t blocks_left_;
  const int64_t issued_ns_;  // 0: the trace was off at issue
  std::string error_;  // the first failed block's; empty while none failed
  int64_t more_errors_ = 0;
};

namespace {

using Ticket = AioEngine::Ticket;

struct Block {
  std::shared_ptr<Ticket> ticket;  // kept alive by its blocks even if the caller drops the handle
  int fd = -1;
  char* buffer = nullptr;
  int64_t bytes = 0;
  int64_t offset = 0;
  AioFault::Kind fault = AioFault::Kind::none;
};

// The message of a failed block: the operation, the file, the block and the request it is part of.
std::string block_error(const Block& b, const std::string& why) {
  const Ticket& t = *b.ticket;
  return detail::cat(t.is_write ? "write " : "read ", t.path, ": block at offset ", b.offset, " (", b.bytes,
                     " bytes) of the request at offset ", t.offset, " (", t.bytes, " bytes): ", why);
}

// Why a block's result is not its size: the errno, or how short it fell.
std::string result_reason(const Block& b, int64_t result) {
  if (result < 0) return std::strerror(static_cast<int>(-result));
  if (b.ticket->is_write) {
    return detail::cat("short write: wrote ", result, " of ", b.bytes, " bytes, the disk may be full");
  }
  return detail::cat("short read: got ", result, " of ", b.bytes,
                     " bytes, the file may have been truncated or removed");
}

// One thread and its kernel queue. Only `pending_` and `stopping_` are shared with the engine's
// callers; everything else belongs to the worker thread.
class Worker {
 public:
  Worker(std::unique_ptr<AioQueue> queue, const AioOptions& options)
      : queue_(std::move(queue)),
        depth_(static_cast<int>(options.queue_depth)),
        single_submit_(options.single_submit),
        overlap_events_(options.overlap_events),
        slots_(static_cast<size_t>(depth_)) {
    for (int tag = depth_ - 1; tag >= 0; --tag) free_slots_.push_back(static_cast<uint32_t>(tag));
    thread_ = std::thread([this] { run(); });
  }

  // Drains: every queued block still runs (its buffer is the caller's until its wait), then joins.
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  void enqueue(std::vector<Block>& blocks) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Block& b : blocks) pending_.push_back(std::move(b));
    }
    wake_.notify_one();
  }

 private:
  int busy() const { return depth_ - static_cast<int>(free_slots_.size()); }

  void run() {
    std::vector<Block> taken;
    std::vector<BlockDone> done;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        // Sleep here only with nothing in the kernel. Otherwise the next completion wakes this
        // thread and new blocks are taken then: the device never idles meanwhile, so no second
        // wake-up channel into the kernel wait is needed.
        if (busy() == 0) wake_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
        if (stopping_ && pending_.empty() && busy() == 0) return;
        // overlap_events off: a new batch only once the previous one has fully completed.
        if (overlap_events_ || busy() == 0) {
          const size_t room = free_slots_.size();
          while (!pending_.empty() && taken.size() < room) {
            taken.push_back(std::move(pending_.front()));
            pending_.pop_front();
          }
        }
      }
      for (Block& b : taken) {
        stage(std::move(b));
        if (single_submit_) submit_staged();
      }
      taken.clear();
      submit_staged();
      if (in_kernel_ > 0) {
        done.clear();
        try {
          queue_->reap(1, done);
        } catch (const Error& e) {
          break_queue(e.what(), /*in_kernel_too=*/true);
          continue;
        }
        in_kernel_ -= static_cast<int>(done.size());
        for (const BlockDone& d : done) finish(d.tag, d.result);
      } else if (!staged_tags_.empty()) {
        // The kernel took none (EAGAIN) and nothing of ours is in flight to wait for: retry soon.
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

  void stage(Block&& b) {
    if (!broken_.empty()) {
      fail(b, broken_);
      return;
    }
    const uint32_t tag = free_slots_.back();
    free_slots_.pop_back();
    slots_[tag] = std::move(b);
    const Block& s = *slots_[tag];
    try {
      queue_->prepare(BlockIo{s.fd, s.buffer, s.bytes, s.offset, s.ticket->is_write, tag});
    } catch (const std::exception& e) {
      // Only a broken invariant gets here; an exception must not escape this thread.
      broken_ = e.what();
      release_failed(tag);
      break_queue(broken_, /*in_kernel_too=*/false);
      return;
    }
    staged_tags_.push_back(tag);
  }

  void submit_staged() {
    if (staged_tags_.empty()) return;
    refused_.clear();
    int accepted;
    try {
      accepted = queue_->submit(refused_);
    } catch (const Error& e) {
      break_queue(e.what(), /*in_kernel_too=*/false);
      return;
    }
    // Both backends consume staged requests in order: the first accepted + refused are gone.
    staged_tags_.erase(staged_tags_.begin(), staged_tags_.begin() + accepted + static_cast<long>(refused_.size()));
    in_kernel_ += accepted;
    for (const BlockDone& r : refused_) finish(r.tag, r.result);
  }

  // The kernel's answer for one block, through the one path that real and injected faults share.
  void finish(uint32_t tag, int64_t result) {
    Block b = std::move(*slots_[tag]);
    slots_[tag].reset();
    free_slots_.push_back(tag);
    bool injected = false;
    if (b.fault == AioFault::Kind::eio) {
      result = -EIO;
      injected = true;
    } else if (b.fault == AioFault::Kind::short_transfer && result >= 0) {
      result = std::min(result, b.bytes / 2);
      injected = true;
    }
    if (result == b.bytes) {
      b.ticket->block_done(std::string());
    } else {
      b.ticket->block_done(block_error(
          b, result_reason(b, result) +
                 (injected ? " [injected fault: ZEROSHARD_NVME_FAULT or AioEngine::inject_fault]" : "")));
    }
  }

  void fail(const Block& b, const std::string& why) {
    b.ticket->block_done(block_error(b, "not done, the I/O queue failed: " + why));
  }

  // The queue itself failed (a bug or a broken kernel interface, never a bad request): every block
  // it still holds fails with the reason, and so does every later one. Blocks the kernel accepted
  // are failed too only when waiting for them is what broke (nothing could report them again).
  void break_queue(const std::string& why, bool in_kernel_too) {
    broken_ = why;
    for (uint32_t tag : staged_tags_) release_failed(tag);
    staged_tags_.clear();
    if (!in_kernel_too) return;
    for (uint32_t tag = 0; tag < slots_.size(); ++tag) {
      if (slots_[tag]) release_failed(tag);
    }
    in_kernel_ = 0;
  }

  void release_failed(uint32_t tag) {
    Block b = std::move(*slots_[tag]);
    slots_[tag].reset();
    free_slots_.push_back(tag);
    fail(b, broken_);
  }

  std::unique_ptr<AioQueue> queue_;
  const int depth_;
  const bool single_submit_;
  const bool overlap_events_;

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Block> pending_;  // guarded by mu_
  bool stopping_ = false;      // guarded by mu_

  std::vector<std::optional<Block>> slots_;  // by tag: staged or in the kernel
  std::vector<uint32_t> free_slots_;
  std::deque<uint32_t> staged_tags_;  // prepared, not yet accepted, in staging order
  int in_kernel_ = 0;
  std::vector<BlockDone> refused_;
  std::string broken_;

  std::thread thread_;  // last: started once everything above exists
};

constexpr const char* kFaultEnv = "ZEROSHARD_NVME_FAULT";

std::optional<AioFault> fault_from_env() {
  const char* raw = std::getenv(kFaultEnv);
  if (raw == nullptr || *raw == '\0') return std::nullopt;
  return parse_aio_fault(raw, kFaultEnv);
}

using QueueFactory = std::unique_ptr<AioQueue> (*)(int, std::string*);

// One queue per worker, or false with the reason the first one could not be made.
bool make_queues(QueueFactory make, const AioOptions& o, std::vector<std::unique_ptr<AioQueue>>& out,
                 std::string* why_not) {
  out.clear();
  for (int64_t i = 0; i < o.intra_op_parallelism; ++i) {
    auto queue = make(static_cast<int>(o.queue_depth), why_not);
    if (!queue) return false;
    out.push_back(std::move(queue));
  }
  return true;
}

void check_options(const AioOptions& o) {
  ZS_REQUIRE(o.block_size > 0 && o.block_size % kDirectAlignment == 0 && o.block_size <= (int64_t{1} << 30),
             "aio.block_size: got ", o.block_size, ", expected a positive multiple of ", kDirectAlignment,
             " (O_DIRECT alignment) up to 1073741824");
  ZS_REQUIRE(o.queue_depth >= 1 && o.queue_depth <= 32768, "aio.queue_depth: got ", o.queue_depth,
             ", expected 1 to 32768");
  ZS_REQUIRE(o.intra_op_parallelism >= 1, "aio.intra_op_parallelism: got ", o.intra_op_parallelism,
             ", expected >= 1");
  ZS_REQUIRE(o.backend == "auto" || o.backend == "io_uring" || o.backend == "libaio", "AioOptions::backend: got \"",
             o.backend, "\", expected one of auto, io_uring, libaio");
}

}  // namespace

struct AioEngine::Impl {
  AioOptions options;
  std::string backend;
  std::string backend_reason;
  std::vector<std::unique_ptr<Worker>> workers;
  std::atomic<uint64_t> next_worker{0};  // rotates the first block's worker so small requests spread

  std::mutex fault_mu;
  AioFault fault;          // guarded by fault_mu
  int64_t fault_seen = 0;  // blocks of the fault's kind since it was set; guarded by fault_mu

  Handle start(bool is_write, const DirectFile& file, void* buffer, int64_t bytes, int64_t offset);
};

AioEngine::AioEngine(const AioOptions& options) : impl_(std::make_unique<Impl>()) {
  check_options(options);
  impl_->options = options;
  if (auto fault = fault_from_env()) impl_->fault = *fault;

#if !defined(ZEROSHARD_HAVE_URING) && !defined(ZEROSHARD_HAVE_LIBAIO)
  throw Error(
      "NVMe offload: zeroshard was built without io_uring or libaio; install liburing-dev or libaio-dev and "
      "rebuild zeroshard");
#endif
  std::vector<std::unique_ptr<AioQueue>> queues;
  std::string uring_why;
  std::string libaio_why;
  if (options.backend == "io_uring") {
    if (!make_queues(&make_uring_queue, options, queues, &uring_why)) {
      throw Error(detail::cat("AioOptions::backend = \"io_uring\" cannot run here: ", uring_why,
                              "; use \"auto\" to fall back to libaio"));
    }
    impl_->backend = "io_uring";
    impl_->backend_reason = "io_uring: requested";
  } else if (options.backend == "libaio") {
    if (!make_queues(&make_libaio_queue, options, queues, &libaio_why)) {
      throw Error(detail::cat("AioOptions::backend = \"libaio\" cannot run here: ", libaio_why,
                              "; use \"auto\" to try io_uring"));
    }
    impl_->backend = "libaio";
    impl_->backend_reason = "libaio: requested";
  } else if (make_queues(&make_uring_queue, options, queues, &uring_why)) {
    impl_->backend = "io_uring";
    impl_->backend_reason = "io_uring: available";
  } else if (make_queues(&make_libaio_queue, options, queues, &libaio_why)) {
    impl_->backend = "libaio";
    impl_->backend_reason = "libaio: " + uring_why;
  } else {
    throw Error(detail::cat("NVMe offload: neither io_uring nor libaio can run here: io_uring: ", uring_why,
                            "; libaio: ", libaio_why));
  }
  for (auto& queue : queues) impl_->workers.push_back(std::make_unique<Worker>(std::move(queue), options));
}

// Workers drain what is queued and join (Worker::~Worker): no thread outlives the engine.
AioEngine::~AioEngine() = default;

AioEngine::Handle AioEngine::Impl::start(bool is_write, const DirectFile& file, void* buffer, int64_t bytes,
                                         int64_t offset) {
  const char* op = is_write ? "AioEngine::write" : "AioEngine::read";
  ZS_REQUIRE(file.fd() >= 0, op, "(", file.path(), "): the file is not open");
  ZS_REQUIRE(bytes > 0 && bytes % kDirectAlignment == 0, op, "(", file.path(),
             "): bytes must be a positive multiple of ", kDirectAlignment, " (O_DIRECT; pad with align_up), got ",
             bytes);
  ZS_REQUIRE(offset >= 0 && offset % kDirectAlignment == 0, op, "(", file.path(),
             "): offset must be a non-negative multiple of ", kDirectAlignment, " (O_DIRECT), got ", offset);
  ZS_REQUIRE(reinterpret_cast<uintptr_t>(buffer) % kDirectAlignment == 0 && buffer != nullptr, op, "(", file.path(),
             "): buffer ", buffer, " must be aligned to ", kDirectAlignment, " bytes (O_DIRECT)");

  const int64_t block_size = options.block_size;
  const int64_t blocks = (bytes + block_size - 1) / block_size;
  int64_t faulty = -1;  // index of the block that gets the injected fault, if it is in this request
  AioFault::Kind fault_kind = AioFault::Kind::none;
  {
    std::lock_guard<std::mutex> lock(fault_mu);
    if (fault.kind != AioFault::Kind::none && fault.on_write == is_write) {
      if (fault.nth > fault_seen && fault.nth <= fault_seen + blocks) {
        faulty = fault.nth - fault_seen - 1;
        fault_kind = fault.kind;
      }
      fault_seen += blocks;
    }
  }

  auto ticket = std::make_shared<Ticket>(is_write, file.path(), bytes, offset, blocks);
  const size_t worker_count = workers.size();
  std::vector<std::vector<Block>> per_worker(worker_count);
  const uint64_t first = next_worker.fetch_add(1, std::memory_order_relaxed);
  char* base = static_cast<char*>(buffer);
  for (int64_t k = 0; k < blocks; ++k) {
    Block b;
    b.ticket = ticket;
    b.fd = file.fd();
    b.buffer = base + k * block_size;
    b.offset = offset + k * block_size;
    b.bytes = std::min(block_size, bytes - k * block_size);
    b.fault = k == faulty ? fault_kind : AioFault::Kind::none;
    per_worker[(first + static_cast<uint64_t>(k)) % worker_count].push_back(std::move(b));
  }
  for (size_t w = 0; w < worker_count; ++w) {
    if (!per_worker[w].empty()) workers[w]->enqueue(per_worker[w]);
  }
  return ticket;
}

AioEngine::Handle AioEngine::read(const DirectFile& file, void* buffer, int64_t bytes, int64_t offset) {
  return impl_->start(false, file, buffer, bytes, offset);
}

AioEngine::Handle AioEngine::write(const DirectFile& file, const void* buffer, int64_t bytes, int64_t offset) {
  // The kernel only reads a write's buffer; the cast is for the shared block path.
  return impl_->start(true, file, const_cast<void*>(buffer), bytes, offset);
}

void AioEngine::wait(const Handle& h) {
  ZS_REQUIRE(h != nullptr, "AioEngine::wait: got an empty handle");
  h->wait();
}

const std::string& AioEngine::backend() const { return impl_->backend; }
const std::string& AioEngine::backend_reason() const { return impl_->backend_reason; }
const AioOptions& AioEngine::options() const { return impl_->options; }

AioFault parse_aio_fault(const std::string& value, const std::string& source) {
  const std::string expected = detail::cat(source, "=\"", value,
                                           "\": expected \"<eio|short>:<read|write>:<n>\" with n >= 1 (the n-th "
                                           "block request of that kind fails), e.g. \"eio:read:1\"");
  const size_t first = value.find(':');
  const size_t second = first == std::string::npos ? first : value.find(':', first + 1);
  if (second == std::string::npos) throw UsageError(expected);
  const std::string kind = value.substr(0, first);
  const std::string op = value.substr(first + 1, second - first - 1);
  const std::string nth = value.substr(second + 1);
  AioFault fault;
  if (kind == "eio") fault.kind = AioFault::Kind::eio;
  else if (kind == "short") fault.kind = AioFault::Kind::short_transfer;
  else throw UsageError(expected);
  if (op != "read" && op != "write") throw UsageError(expected);
  fault.on_write = op == "write";
  if (nth.empty() || nth.size() > 18 || nth.find_first_not_of("0123456789") != std::string::npos) {
    throw UsageError(expected);
  }
  fault.nth = std::stoll(nth);
  if (fault.nth < 1) throw UsageError(expected);
  return fault;
}

void AioEngine::inject_fault(const AioFault& fault) {
  ZS_REQUIRE(fault.kind == AioFault::Kind::none || fault.nth >= 1, "AioEngine::inject_fault: nth must be >= 1 "
             "(the n-th block request of that kind fails), got ", fault.nth);
  std::lock_guard<std::mutex> lock(impl_->fault_mu);
  impl_->fault = fault;
  impl_->fault_seen = 0;
}

}  // namespace zeroshard
