// Sub-group updates, staged through host memory where the state lives there; see
// sub_group_runner.h.
#include "zero/sub_group_runner.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <memory>

#include "runtime/error.h"
#include "runtime/trace.h"

namespace zeroshard {

namespace {
using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}
// Uploads in flight at once: the one just issued and the one before it, so a copy up overlaps
// the next update while the pool holds two parameter buffers, not one per sub-group.
constexpr size_t kUploadsInFlight = 2;
}  // namespace

SubGroupRunner::SubGroupRunner(std::vector<FlatGroup*> groups, std::vector<OptimizerShard*> shards,
                               HostPool& pool, CopyStream& copies, SwapSpace* swap, ParamSwap* params)
    : groups_(std::move(groups)),
      shards_(std::move(shards)),
      pool_(pool),
      copies_(copies),
      swaps_(swap ? std::make_unique<SwapPipeline>(*swap) : nullptr),
      params_(params) {}

SubGroupRunner::~SubGroupRunner() { forget_early_gradients(); }

void SubGroupRunner::gradients_final(int64_t g, int64_t begin, int64_t numel) {
  const FlatGroup& group = *groups_[size_t(g)];
  for (const SubGroup& sg : shards_[size_t(g)]->sub_groups()) {
    const int64_t lo = std::max(begin, sg.begin), hi = std::min(begin + numel, sg.begin + sg.numel);
    if (sg.residency == Residency::device || lo >= hi) continue;
    Staged& s = early_[{size_t(g), sg.begin}];
    const at::Tensor grads = group.owned_grad_view(lo, hi - lo);
    if (!s.grad_buffer.defined()) s.grad_buffer = pool_.acquire(sg.numel, grads.scalar_type());
    s.grad_fence = copies_.copy(s.grad_buffer.narrow(0, lo - sg.begin, hi - lo), grads);
    s.copied += hi - lo;
  }
}

void SubGroupRunner::forget_early_gradients() {
  for (auto& [key, s] : early_) {
    CopyStream::wait_host(s.grad_fence);  // why: the buffer goes back to the pool
    pool_.release(s.grad_buffer);
  }
  early_.clear();
}

SubGroupRunner::Staged SubGroupRunner::prepare(const Pieces& pieces, const Job& job) {
  const auto t = Clock::now();
  const int64_t b = job.sg.begin, n = job.sg.numel;
  Staged s;
  const auto it = early_.find({job.g, b});
  if (it != early_.end()) {
    s = std::move(it->second);
    early_.erase(it);
    // Each bucket is final once per window, so `copied` counts distinct elements; a sub-group
    // that meets a bucket which got no gradient (stage 3 zeros) is copied again whole.
    if (s.copied == n) {
      ++times_.early_sub_groups;
      times_.transfer_ms += ms_since(t);
      return s;
    }
    CopyStream::wait_host(s.grad_fence);  // why: its buffer is written again below
  } else {
    s.grad_buffer = pool_.acquire(n, pieces.front().second.scalar_type());
  }
  // The gradient pieces it meets (stage 3's segments; one piece otherwise), in order on one
  // stream, so the last copy's fence covers them all.
  for (const auto& [offset, grad] : pieces) {
    const int64_t lo = std::max(b, offset), hi = std::min(b + n, offset + grad.numel());
    if (lo < hi) s.grad_fence = copies_.copy(s.grad_buffer.narrow(0, lo - b, hi - lo), grad.narrow(0, lo - offset, hi - lo));
  }
  s.copied = n;
  times_.transfer_ms += ms_since(t);
  return s;
}

void SubGroupRunner::finish_upload(Upload& u) {
  const auto t = Clock::now();
  // The compute stream waits for the new values before the next forward reads them, and the
  // host before the source (a pool buffer, or the host master an fp32 model's values come
  // from) is written again.
  copies_.wait_device(u.fence);
  CopyStream::wait_host(u.fence);
  if (u.buffer.defined()) pool_.release(u.buffer);
  times_.transfer_ms += ms_since(t);
}

void SubGroupRunner::update_in_place(const Pieces& pieces, const Job& job, const Update& update) {
  trace::Scope traced("optimizer", [&] {
    return std::make_pair(detail::cat("update sub-group of group ", job.g, " on the device"),
                          detail::cat("\"numel\": ", job.sg.numel));
  });
  FlatGroup& group = *groups_[job.g];
  OptimizerShard& shard = *shards_[job.g];
  // One update per gradient piece the sub-group meets: views only, nothing copied, unless the
  // parameters live in host memory (offload_param without optimizer offload): then the new
  // values are written into a device buffer and copied down.
  const int64_t b = job.sg.begin, n = job.sg.numel;
  for (const auto& [offset, grad] : pieces) {
    const int64_t lo = std::max(b, offset), hi = std::min(b + n, offset + grad.numel());
    if (lo >= hi) continue;
    UpdatePiece p;
    p.master = shard.master(lo, hi - lo);
    p.grad = grad.narrow(0, lo - offset, hi - lo);
    for (size_t s = 0; s < shard.row().state_names.size(); ++s) p.state.push_back(shard.state(s, lo, hi - lo));
    at::Tensor target;
    if (!shard.shares_model_copy(lo, hi - lo)) {
      target = group.owned_params().narrow(0, lo, hi - lo);
      if (target.scalar_type() != at::kFloat) {
        p.param16 = !group.params_on_host() ? target : at::empty_like(p.grad, target.options().device(p.grad.device()));
      }
    }
    update(job.g, p);
    if (target.defined() && group.params_on_host()) {
      const auto t = Clock::now();
      const at::Tensor& source = p.param16.defined() ? p.param16 : p.master;
      if (params_ && params_->swapped(int64_t(job.g))) {
        params_->store(int64_t(job.g), lo, source.to(at::kCPU));
      } else {
        // why: the next gather reads these chunks, and p.param16 is freed when this returns.
        CopyStream::wait_host(copies_.copy(target, source));
      }
      times_.transfer_ms += ms_since(t);
    }
  }
}

void SubGroupRunner::update_on_host(Staged staged, const Job& job, const Update& update,
                                    std::vector<Upload>& uploads, SwapPipeline* swaps, const at::Tensor& stage) {
  trace::Scope traced("optimizer", [&] {
    return std::make_pair(detail::cat("update sub-group of group ", job.g, " on the host"),
                          detail::cat("\"numel\": ", job.sg.numel));
  });
  FlatGroup& group = *groups_[job.g];
  OptimizerShard& shard = *shards_[job.g];
  const auto t_wait = Clock::now();
  CopyStream::wait_host(staged.grad_fence);  // why: the host kernel reads them next
  times_.transfer_ms += ms_since(t_wait);
  const int64_t b = job.sg.begin, n = job.sg.numel;
  UpdatePiece p;
  p.grad = staged.grad_buffer;
  // An NVMe sub-group's master and state are views of its staging buffer, read from disk.
  SwappedPart* swapped = shard.swapped(b, n);
  if (swapped) {
    p.master = swapped->view(stage, b, -1);
    for (size_t s = 0; s < swapped->slots(); ++s) p.state.push_back(swapped->view(stage, b, int64_t(s)));
  } else {
    p.master = shard.master(b, n);
    for (size_t s = 0; s < shard.row().state_names.size(); ++s) p.state.push_back(shard.state(s, b, n));
  }
  const at::Tensor target = group.owned_params().narrow(0, b, n);
  const bool fp32_model = target.scalar_type() == at::kFloat;
  // The parameters live on the device, or in host memory beside this state (ZeRO-3 chunks
  // under offload_param): then the kernel writes them where they are, unless they are on NVMe.
  const bool upload = !group.params_on_host();
  const bool to_disk = params_ && params_->swapped(int64_t(job.g));
  Upload u;
  if (!fp32_model) {
    // Either way the kernel writes the 16-bit values on the host, in the same pass.
    if (upload || to_disk) u.buffer = pool_.acquire(n, target.scalar_type());
    p.param16 = upload || to_disk ? u.buffer : target;
  }
  const auto t_update = Clock::now();
  update(job.g, p);
  times_.host_step_ms += ms_since(t_update);
  pool_.release(staged.grad_buffer);
  if (to_disk) {
    const auto t = Clock::now();
    // Copied out before this returns: the master may be a staging buffer about to go to disk.
    params_->store(int64_t(job.g), b, fp32_model ? p.master : p.param16);
    if (u.buffer.defined()) pool_.release(u.buffer);
    times_.transfer_ms += ms_since(t);
  } else if (upload || fp32_model) {
    const auto t = Clock::now();
    // An fp32 model's new values are the master's own, copied (a host master is never shared);
    // an NVMe master's through a pool buffer, as its staging buffer goes to disk next.
    at::Tensor source = fp32_model ? p.master : p.param16;
    if (fp32_model && swapped) {
      u.buffer = pool_.acquire(n, at::kFloat);
      u.buffer.copy_(p.master);
      source = u.buffer;
    }
    u.fence = copies_.copy(target, source);
    times_.transfer_ms += ms_since(t);
    uploads.push_back(std::move(u));
  }
  if (swapped) swaps->put(*swapped, b, stage);
}

void SubGroupRunner::run(const Update& update) {
  times_ = {};
  for (const OptimizerShard* shard : shards_) {
    ZS_CHECK(!shard->resident(), "optimizer step: NVMe optimizer state is still held in host memory "
             "(shard_entries without end_entries or after_load)");
  }
  std::vector<Pieces> pieces;
  std::vector<Job> host;
  for (size_t g = 0; g < groups_.size(); ++g) pieces.push_back(groups_[g]->grad_pieces());
  // Device-resident sub-groups update first (they never wait for a copy), then the host ones
  // in order, each one's gradients coming down while the one before it updates.
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (const SubGroup& sg : shards_[g]->sub_groups()) {
      if (sg.residency == Residency::device) {
        update_in_place(pieces[g], {g, sg}, update);
      } else {
        host.push_back({g, sg});
      }
    }
  }
  // Host sub-groups of groups whose chunks live in host memory write those chunks in place, and
  // the gathers' copies up read them: every gather was completed (the compute stream waited for
  // it) before the step, so once the compute stream's work so far is done, none is pending.
  for (const Job& job : host) {
    if (groups_[job.g]->params_on_host()) {
      CopyStream::wait_host(copies_.mark_compute());  // why: no copy up may still read a chunk
      break;
    }
  }
  SwapPipeline* swaps = swaps_.get();
  if (swaps) {
    swaps->begin_step();
    // Every other step backwards: the sub-groups whose buffers the last step kept come first.
    if (backwards_) std::reverse(host.begin(), host.end());
    backwards_ = !backwards_;
  }
  try {
    run_host(host, pieces, update, swaps);
  } catch (...) {
    // The step failed part-way (an I/O error): the staging buffers it held go back, so the
    // pipeline is whole for the error's report and the destructors (the optimizer refuses to
    // step again: ZeroOptimizer::step).
    if (swaps) swaps->abandon();
    throw;
  }
  if (swaps) {
    swaps->end_step();
    times_.nvme_wait_ms = swaps->wait_ms();
    times_.transfer_ms += swaps->wait_ms();
  }
  forget_early_gradients();  // any left (a sub-group the step did not reach) are stale now
}

void SubGroupRunner::run_host(const std::vector<Job>& host, const std::vector<Pieces>& pieces,
                              const Update& update, SwapPipeline* swaps) {
  std::vector<Upload> uploads;
  size_t finished = 0;
  // The NVMe read of job j's master and state, started ahead where the pipeline allows.
  const auto prefetch = [&](size_t j) {
    if (!swaps || j >= host.size()) return;
    const SubGroup& sg = host[j].sg;
    if (SwappedPart* part = shards_[host[j].g]->swapped(sg.begin, sg.numel)) swaps->prefetch(*part, sg.begin);
  };
  prefetch(0);
  Staged next = host.empty() ? Staged{} : prepare(pieces[host[0].g], host[0]);
  for (size_t j = 0; j < host.size(); ++j) {
    Staged cur = std::move(next);
    if (j + 1 < host.size()) next = prepare(pieces[host[j + 1].g], host[j + 1]);
    for (; finished + kUploadsInFlight <= uploads.size(); ++finished) finish_upload(uploads[finished]);
    // An NVMe sub-group's master and state are read before its update; the next one's read
    // then starts, to run while this one updates.
    const SubGroup& sg = host[j].sg;
    SwappedPart* part = swaps ? shards_[host[j].g]->swapped(sg.begin, sg.numel) : nullptr;
    const at::Tensor stage = part ? swaps->take(*part, sg.begin, shards_[host[j].g]->state_init()) : at::Tensor();
    prefetch(j + 1);
    update_on_host(std::move(cur), host[j], update, uploads, swaps, stage);
  }
  for (; finished < uploads.size(); ++finished) finish_upload(uploads[finished]);
}

}  // namespace zeroshard
