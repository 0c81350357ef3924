// The in-process world: see in_process_world.h.
#include "runtime/in_process_world.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "runtime/error.h"

namespace zeroshard {
namespace {

using Clock = std::chrono::steady_clock;

// What the ranks share: each collective's inputs, deposited by every rank when it issues the
// collective (a copy: the caller may write its tensor before the others read it), and
// point-to-point messages.
struct Shared {
  explicit Shared(int world) : world_size(world) {}
  struct Round {
    std::vector<at::Tensor> inputs;
    int deposited = 0;
    int finished = 0;
  };
  const int world_size;
  std::mutex mu;
  std::condition_variable changed;
  std::map<uint64_t, Round> rounds;  // by collective number (the same on every rank)
  std::map<std::tuple<int, int, int>, std::deque<at::Tensor>> mailbox;  // (src, dst, tag)
};

// Waits on the shared state until `ready`; c10d's timeout 0 means none. Running out is c10d's
// "Operation timed out!", after which CommWork polls again or reports the timeout.
template <typename Ready>
void wait_for(Shared& shared, std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout,
              Ready ready) {
  const auto limit = timeout.count() > 0 ? timeout : std::chrono::hours(24 * 365);
  TORCH_CHECK(shared.changed.wait_for(lock, limit, ready), "Operation timed out!");
}

// One rank's side of one collective: `finish_op` runs once every rank has deposited.
class RoundWork : public c10d::Work {
 public:
  using Finish = std::function<void(const std::vector<at::Tensor>&)>;
  RoundWork(std::shared_ptr<Shared> shared, uint64_t round, Finish finish_op)
      : shared_(std::move(shared)), round_(round), finish_(std::move(finish_op)) {}

  bool wait(std::chrono::milliseconds timeout) override {
    if (isCompleted()) return true;
    std::unique_lock<std::mutex> lock(shared_->mu);
    auto& round = shared_->rounds[round_];
    wait_for(*shared_, lock, timeout, [&] { return round.deposited == shared_->world_size; });
    std::exception_ptr error;
    try {
      finish_(round.inputs);  // reads only the deposited copies: safe under the shared lock
    } catch (...) {
      error = std::current_exception();  // ranks that disagree on sizes, say: their own error
    }
    if (++round.finished == shared_->world_size) shared_->rounds.erase(round_);
    lock.unlock();
    finish(error);  // completed either way, so CommWork reports the cause, not a timeout
    if (error) std::rethrow_exception(error);
    return true;
  }

 private:
  std::shared_ptr<Shared> shared_;
  uint64_t round_;
  Finish finish_;
};

// A receive: completes when the matching send's message is there.
class RecvWork : public c10d::Work {
 public:
  RecvWork(std::shared_ptr<Shared> shared, std::tuple<int, int, int> key, at::Tensor out)
      : shared_(std::move(shared)), key_(key), out_(std::move(out)) {}

  bool wait(std::chrono::milliseconds timeout) override {
    if (isCompleted()) return true;
    std::unique_lock<std::mutex> lock(shared_->mu);
    auto& box = shared_->mailbox[key_];
    wait_for(*shared_, lock, timeout, [&] { return !box.empty(); });
    out_.copy_(box.front());
    box.pop_front();
    lock.unlock();
    finish();
    return true;
  }

 private:
  std::shared_ptr<Shared> shared_;
  std::tuple<int, int, int> key_;
  at::Tensor out_;
};

class DoneWork : public c10d::Work {
 public:
  DoneWork() { finish(); }
};

class InProcessBackend : public c10d::Backend {
 public:
  InProcessBackend(std::shared_ptr<Shared> shared, int rank)
      : c10d::Backend(rank, shared->world_size), shared_(std::move(shared)) {}

  const std::string getBackendName() const override { return "in_process"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    at::Tensor t = single(tensors, "allreduce");
    const bool max = opts.reduceOp == c10d::ReduceOp::MAX;
    ZS_CHECK(max || opts.reduceOp == c10d::ReduceOp::SUM, "in-process world: allreduce supports SUM and MAX, got reduce op ",
             int(opts.reduceOp.op_));
    return deposit(t, [t, max](const std::vector<at::Tensor>& in) {
      at::Tensor acc = in[0].clone();
      for (size_t r = 1; r < in.size(); ++r) max ? acc = at::maximum(acc, in[r]) : acc.add_(in[r]);
      t.copy_(acc);
    });
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    at::Tensor t = single(tensors, "broadcast");
    const int64_t root = opts.rootRank;
    return deposit(t, [t, root](const std::vector<at::Tensor>& in) { t.copy_(in[size_t(root)]); });
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions&) override {
    at::Tensor out = output;
    return deposit(input, [out](const std::vector<at::Tensor>& in) {
      const int64_t n = in[0].numel();
      for (size_t r = 0; r < in.size(); ++r) out.narrow(0, int64_t(r) * n, n).copy_(in[r]);
    });
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    ZS_CHECK(opts.reduceOp == c10d::ReduceOp::SUM, "in-process world: reduce_scatter supports SUM, got reduce op ",
             int(opts.reduceOp.op_));
    at::Tensor out = output;
    const int64_t rank = getRank();
    return deposit(input, [out, rank](const std::vector<at::Tensor>& in) {
      const int64_t n = out.numel();
      at::Tensor acc = in[0].narrow(0, rank * n, n).clone();
      for (size_t r = 1; r < in.size(); ++r) acc.add_(in[r].narrow(0, rank * n, n));
      out.copy_(acc);
    });
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return deposit(at::Tensor(), [](const std::vector<at::Tensor>&) {});
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    at::Tensor t = single(tensors, "send");
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->mailbox[{getRank(), dst, tag}].push_back(t.clone());
    }
    shared_->changed.notify_all();
    return c10::make_intrusive<DoneWork>();
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return c10::make_intrusive<RecvWork>(shared_, std::make_tuple(src, getRank(), tag),
                                         single(tensors, "recv"));
  }

 private:
  static at::Tensor single(const std::vector<at::Tensor>& tensors, const char* op) {
    ZS_CHECK(tensors.size() == 1 && !tensors[0].is_cuda(), "in-process world: ", op,
             " takes one CPU tensor");
    return tensors[0];
  }

  c10::intrusive_ptr<c10d::Work> deposit(const at::Tensor& input, RoundWork::Finish finish_op) {
    const uint64_t round = next_round_++;
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      auto& r = shared_->rounds[round];
      if (r.inputs.empty()) r.inputs.resize(size_t(shared_->world_size));
      r.inputs[size_t(getRank())] = input.defined() ? input.clone() : input;
      ++r.deposited;
    }
    shared_->changed.notify_all();
    return c10::make_intrusive<RoundWork>(shared_, round, std::move(finish_op));
  }

  std::shared_ptr<Shared> shared_;
  uint64_t next_round_ = 0;
};

}  // namespace

std::vector<std::shared_ptr<Comm>> make_in_process_world(int world_size,
                                                         std::chrono::milliseconds timeout) {
  ZS_REQUIRE(world_size >= 1, "in-process world: world_size must be at least 1, got ", world_size);
  auto shared = std::make_shared<Shared>(world_size);
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::shared_ptr<Comm>> comms;
  for (int r = 0; r < world_size; ++r) {
    auto group = c10::make_intrusive<c10d::ProcessGroup>(store, r, world_size);
    auto backend = c10::make_intrusive<InProcessBackend>(shared, r);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
    group->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
    comms.push_back(std::make_shared<Comm>(group, timeout, store, false));
  }
  return comms;
}

void run_ranks(int world_size, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  // A rank's own error first: the others' are then the timeouts of waiting for it.
  for (bool comm_errors : {false, true}) {
    for (auto& e : errors) {
      if (!e) continue;
      try {
        std::rethrow_exception(e);
      } catch (const CommError&) {
        if (comm_errors) throw;
      } catch (...) {
        throw;
      }
    }
  }
}

}  // namespace zeroshard
