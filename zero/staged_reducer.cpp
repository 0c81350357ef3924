// Staged bucket reduction shared by stages 2 and 3; see staged_reducer.h.
#include "zero/staged_reducer.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "kernels/ops.h"
#include "runtime/error.h"

namespace zeroshard {

StagedReducer::StagedReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
                             const ReduceOptions& options, MemoryAccount& memory)
    : groups_(groups), comm_(std::move(comm)), opt_(options),
      pool_size_(options.overlap_comm ? 2 : 1), memory_(memory) {
  std::vector<const FlatLayout*> layouts;
  int64_t base = 0;
  for (FlatGroup* g : groups) {
    layouts.push_back(&g->layout());
    group_base_.push_back(base);
    base += g->num_tensors();
  }
  plan_ = plan_buckets(layouts, opt_.bucket_numel);
  param_buckets_.assign(plan_.bucket_of_param.size(), {-1, 0});
  arrived_.assign(plan_.bucket_of_param.size(), false);
}

void StagedReducer::add_bucket(Bucket b) {
  const int64_t id = int64_t(buckets_.size());
  for (int64_t i = b.spec.first_param; i < b.spec.end_param; ++i) {
    auto& [first, count] = param_buckets_[size_t(group_base_[size_t(b.spec.group)] + i)];
    if (count++ == 0) first = id;
  }
  buckets_.push_back(std::move(b));
}

StagedReducer::~StagedReducer() {
  memory_.release(MemoryCategory::comm_buffers, accounted_bytes_);
}

int StagedReducer::acquire_buffer(const Bucket& b) {
  for (size_t i = 0; i < staging_.size(); ++i) {
    if (!busy_[i]) {
      busy_[i] = true;
      return int(i);
    }
  }
  if (staging_.size() >= pool_size_ && !in_flight_.empty()) {
    // Pool exhausted: finishing the oldest reduction frees its buffer (why: bounded memory).
    complete(buckets_[size_t(in_flight_.front())]);
    return acquire_buffer(b);
  }
  // Every buffer holds a bucket still filling (gradients arrived out of bucket order): grow.
  int64_t staged = 0;
  for (const auto& x : buckets_) staged = std::max(staged, x.staged_numel);
  staging_.push_back(at::empty({staged}, comm_options()));
  busy_.push_back(true);
  memory_.add(MemoryCategory::comm_buffers, staging_.back().nbytes());
  accounted_bytes_ += staging_.back().nbytes();
  return int(staging_.size() - 1);
}

at::TensorOptions StagedReducer::comm_options() const {
  const auto grads = groups_[0]->device_options();
  return opt_.comm_dtype != at::ScalarType::Undefined ? grads.dtype(opt_.comm_dtype) : grads;
}

void StagedReducer::grad_ready(int64_t index, const at::Tensor& grad) {
  ZS_CHECK(index >= 0 && index < num_params(), "gradient reducer: parameter index ", index,
           " is outside 0..", num_params() - 1);
  if (arrived_[size_t(index)]) {
    throw Error(detail::cat(
        "gradient of parameter ", index, " arrived twice in one backward: ZeRO stages 2 and 3 ",
        "reduce each gradient once per backward, and a parameter used inside a reentrant ",
        "activation-checkpointing region (torch.utils.checkpoint with use_reentrant=True) and ",
        "outside it, or in two such regions (layers shared across blocks), gets one gradient from ",
        "each autograd pass (DeepSpeed has the same limit); use use_reentrant=False, put every use ",
        "of it in one region, or ZeRO stage 0 or 1"));
  }
  arrived_[size_t(index)] = true;
  const auto [first, count] = param_buckets_[size_t(index)];
  for (int64_t id = first; id < first + count; ++id) {
    Bucket& b = buckets_[size_t(id)];
    ZS_CHECK(b.state == Bucket::State::idle || b.state == Bucket::State::filling,
             "gradient reducer: bucket ", id, " of parameter ", index,
             " is already being reduced");
    if (b.state == Bucket::State::idle) {
      b.buffer = acquire_buffer(b);
      // Zeroed: padding and parameters without a gradient contribute zeros.
      staging_[size_t(b.buffer)].narrow(0, 0, b.staged_numel).zero_();
      b.state = Bucket::State::filling;
    }
    if (grad.defined()) stage(b, staging_[size_t(b.buffer)], index, grad);
    if (++b.ready == b.spec.num_params()) start(b);
  }
}

void StagedReducer::start(Bucket& b) {
  if (b.state == Bucket::State::idle) {
    // Started by finish() with no gradient at all: every rank still takes part, with zeros.
    b.buffer = acquire_buffer(b);
    staging_[size_t(b.buffer)].narrow(0, 0, b.staged_numel).zero_();
  }
  b.state = Bucket::State::in_flight;
  at::Tensor staging = staging_[size_t(b.buffer)].narrow(0, 0, b.staged_numel);
  const int64_t world = comm_->world_size();
  const double pre = opt_.pre_factor(world);
  ops::scale_(staging, pre);
  const int64_t id = int64_t(&b - buckets_.data());
  if (world > 1) b.work = reduce(b, staging, detail::cat("gradient bucket ", id));
  in_flight_.push_back(id);
  // Without overlap_comm the reduction finishes before backward continues.
  if (!opt_.overlap_comm) complete(b);
}

void StagedReducer::complete(Bucket& b) {
  if (b.state != Bucket::State::in_flight) return;
  b.work.wait();
  const int64_t id = int64_t(&b - buckets_.data());
  in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), id));
  const auto [begin, numel] = accumulate(b, staging_[size_t(b.buffer)].narrow(0, 0, b.staged_numel),
                                         opt_.post_factor(comm_->world_size()));
  if (boundary_ && numel > 0 && on_final_) on_final_(b.spec.group, begin, numel);
  busy_[size_t(b.buffer)] = false;
  b.buffer = -1;
  b.ready = 0;
  b.state = Bucket::State::done;
}

void StagedReducer::finish() {
  // Buckets not reduced yet in this backward (some parameter got no gradient): every rank still
  // takes part, with zeros where gradients are missing. Those already done are not reduced again.
  for (auto& b : buckets_) {
    if (b.state == Bucket::State::idle || b.state == Bucket::State::filling) start(b);
  }
  while (!in_flight_.empty()) complete(buckets_[size_t(in_flight_.front())]);
  for (auto& b : buckets_) b.state = Bucket::State::idle;
  std::fill(arrived_.begin(), arrived_.end(), false);
}

void StagedReducer::abort() {
  // Reset first, so a wait that throws leaves no half-reset state behind.
  std::vector<int64_t> started;
  started.swap(in_flight_);
  std::fill(arrived_.begin(), arrived_.end(), false);
  for (auto& b : buckets_) {
    b.state = Bucket::State::idle;
    b.buffer = -1;
    b.ready = 0;
  }
  std::fill(busy_.begin(), busy_.end(), false);
  for (int64_t id : started) buckets_[size_t(id)].work.wait();
}

void StagedReducer::zero_grad() {
  for (FlatGroup* g : groups_) g->zero_grads();  // the owned shards, where gradients accumulate
}

}  // namespace zeroshard
