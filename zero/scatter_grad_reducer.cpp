// Chunked reduce-scatter of gradients for stage 3; see scatter_grad_reducer.h.
#include "zero/scatter_grad_reducer.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "runtime/error.h"

namespace zeroshard {

ScatterGradReducer::ScatterGradReducer(const std::vector<FlatGroup*>& groups,
                                       std::shared_ptr<Comm> comm, const ReduceOptions& options,
                                       MemoryAccount& memory)
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
  for (const BucketSpec& spec : plan_.buckets) {
    const ChunkLayout& L = groups_[size_t(spec.group)]->chunk_layout();
    Bucket b;
    b.spec = spec;
    b.local_begin = L.local_offsets[size_t(spec.first_param)];
    const size_t last = size_t(spec.end_param - 1);
    b.shard_numel = L.local_offsets[last] + L.chunks[last] - b.local_begin;
    max_shard_numel_ = std::max(max_shard_numel_, b.shard_numel);
    buckets_.push_back(std::move(b));
  }
}

ScatterGradReducer::~ScatterGradReducer() {
  memory_.release(MemoryCategory::comm_buffers, accounted_bytes_);
}

int ScatterGradReducer::acquire_buffer() {
  for (size_t i = 0; i < staging_.size(); ++i) {
    if (!busy_[i]) {
      busy_[i] = true;
      return int(i);
    }
  }
  if (staging_.size() >= pool_size_ && !in_flight_.empty()) {
    // Pool exhausted: finishing the oldest reduction frees its buffer (why: bounded memory).
    complete(buckets_[size_t(in_flight_.front())]);
    return acquire_buffer();
  }
  const auto& grads = groups_[0]->grads();
  const auto dtype = opt_.comm_dtype != at::ScalarType::Undefined ? opt_.comm_dtype : grads.scalar_type();
  staging_.push_back(at::empty({max_shard_numel_ * comm_->world_size()}, grads.options().dtype(dtype)));
  received_.push_back(at::empty({max_shard_numel_}, grads.options().dtype(dtype)));
  busy_.push_back(true);
  const int64_t bytes = staging_.back().nbytes() + received_.back().nbytes();
  memory_.add(MemoryCategory::comm_buffers, bytes);
  accounted_bytes_ += bytes;
  return int(staging_.size() - 1);
}

void ScatterGradReducer::grad_ready(int64_t index, const at::Tensor& grad) {
  ZS_CHECK(index >= 0 && index < num_params(), "ScatterGradReducer::grad_ready: parameter index ",
           index, " is outside 0..", num_params() - 1);
  Bucket& b = buckets_[size_t(plan_.bucket_of_param[size_t(index)])];
  ZS_CHECK(b.state != Bucket::State::in_flight, "gradient of parameter ", index,
           " arrived twice in one backward (its bucket is already being reduced)");
  const int64_t world = comm_->world_size();
  if (b.state == Bucket::State::idle) {
    b.buffer = acquire_buffer();
    // Zeroed: chunk padding and parameters without a gradient contribute zeros.
    staging_[size_t(b.buffer)].narrow(0, 0, b.shard_numel * world).zero_();
    b.state = Bucket::State::filling;
  }
  if (grad.defined()) {
    const ChunkLayout& L = groups_[size_t(b.spec.group)]->chunk_layout();
    const int64_t t = index - group_base_[size_t(b.spec.group)];
    const at::Tensor flat = grad.reshape(-1);
    const int64_t into = L.local_offsets[size_t(t)] - b.local_begin;
    for (int64_t r = 0; r < world; ++r) {
      const int64_t held = L.held_numel(t, r);
      if (held > 0) {
        staging_[size_t(b.buffer)].narrow(0, r * b.shard_numel + into, held)
            .copy_(flat.narrow(0, r * L.chunks[size_t(t)], held));
      }
    }
  }
  if (++b.ready == b.spec.num_params()) start(b);
}

void ScatterGradReducer::start(Bucket& b) {
  const int64_t world = comm_->world_size();
  if (b.state == Bucket::State::idle) {
    // Started by finish() with no gradient at all: every rank still takes part, with zeros.
    b.buffer = acquire_buffer();
    staging_[size_t(b.buffer)].narrow(0, 0, b.shard_numel * world).zero_();
  }
  b.state = Bucket::State::in_flight;
  at::Tensor in = staging_[size_t(b.buffer)].narrow(0, 0, b.shard_numel * world);
  at::Tensor out = received_[size_t(b.buffer)].narrow(0, 0, b.shard_numel);
  const double pre = opt_.pre_factor(world);
  if (pre != 1.0) in.mul_(pre);
  const int64_t id = int64_t(&b - buckets_.data());
  if (world > 1) {
    b.work = comm_->reduce_scatter(out, in, detail::cat("gradient bucket ", id));
  } else {
    out.copy_(in);
  }
  in_flight_.push_back(id);
  // Without overlap_comm the reduction finishes before backward continues.
  if (!opt_.overlap_comm) complete(b);
}

void ScatterGradReducer::complete(Bucket& b) {
  if (b.state != Bucket::State::in_flight) return;
  b.work.wait();
  const int64_t id = int64_t(&b - buckets_.data());
  in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), id));
  FlatGroup& g = *groups_[size_t(b.spec.group)];
  at::Tensor shard = g.owned_grads().narrow(0, b.local_begin, b.shard_numel);
  at::Tensor mine = received_[size_t(b.buffer)].narrow(0, 0, b.shard_numel);
  // Accumulates across micro-steps: the shard holds the running mean-over-ranks sum.
  shard.add_(mine.to(shard.scalar_type()), opt_.post_factor(comm_->world_size()));
  busy_[size_t(b.buffer)] = false;
  b.buffer = -1;
  b.ready = 0;
  b.state = Bucket::State::idle;
}

void ScatterGradReducer::finish() {
  for (auto& b : buckets_) {
    if (b.state != Bucket::State::in_flight) start(b);
  }
  while (!in_flight_.empty()) complete(buckets_[size_t(in_flight_.front())]);
}

}  // namespace zeroshard
