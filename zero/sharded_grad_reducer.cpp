// Staged bucket reduction into owned gradient shards (stage 2); see sharded_grad_reducer.h.
#include "zero/sharded_grad_reducer.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "runtime/error.h"

namespace zeroshard {

ShardedGradReducer::ShardedGradReducer(const std::vector<FlatGroup*>& groups,
                                       std::shared_ptr<Comm> comm, const ReduceOptions& options,
                                       MemoryAccount& memory)
    : groups_(groups), comm_(std::move(comm)), opt_(options),
      pool_size_(options.overlap_comm ? 2 : 1), memory_(memory) {
  std::vector<const FlatLayout*> layouts;
  for (FlatGroup* g : groups) layouts.push_back(&g->layout());
  plan_ = plan_buckets(layouts, opt_.bucket_numel);
  for (const BucketSpec& spec : plan_.buckets) {
    Bucket b;
    b.spec = spec;
    buckets_.push_back(std::move(b));
  }
}

ShardedGradReducer::~ShardedGradReducer() {
  memory_.release(MemoryCategory::comm_buffers, accounted_bytes_);
}

int ShardedGradReducer::acquire_buffer() {
  for (size_t i = 0; i < buffers_.size(); ++i) {
    if (!buffer_busy_[i]) {
      buffer_busy_[i] = true;
      return int(i);
    }
  }
  if (buffers_.size() >= pool_size_ && !in_flight_.empty()) {
    // Pool exhausted: finishing the oldest reduction frees its buffer (why: bounded memory).
    Bucket& oldest = buckets_[size_t(in_flight_.front())];
    complete(oldest);
    return acquire_buffer();
  }
  // Every buffer holds a bucket still filling (gradients arrived out of bucket order): grow.
  const auto& grads = groups_[0]->grads();
  const auto dtype = opt_.comm_dtype != at::ScalarType::Undefined ? opt_.comm_dtype : grads.scalar_type();
  buffers_.push_back(at::empty({plan_.max_bucket_numel}, grads.options().dtype(dtype)));
  buffer_busy_.push_back(true);
  const int64_t bytes = buffers_.back().nbytes();
  memory_.add(MemoryCategory::comm_buffers, bytes);
  accounted_bytes_ += bytes;
  return int(buffers_.size() - 1);
}

void ShardedGradReducer::grad_ready(int64_t index, const at::Tensor& grad) {
  ZS_CHECK(index >= 0 && index < num_params(), "ShardedGradReducer::grad_ready: parameter index ",
           index, " is outside 0..", num_params() - 1);
  Bucket& b = buckets_[size_t(plan_.bucket_of_param[size_t(index)])];
  ZS_CHECK(b.state != Bucket::State::in_flight, "gradient of parameter ", index,
           " arrived twice in one backward (its bucket is already being reduced)");
  if (b.state == Bucket::State::idle) {
    b.buffer = acquire_buffer();
    // Zeroed: parameters that get no gradient this backward contribute zeros.
    buffers_[size_t(b.buffer)].narrow(0, 0, b.spec.numel).zero_();
    b.state = Bucket::State::filling;
  }
  if (grad.defined()) {
    const int64_t at_ = plan_.param_offset[size_t(index)] - b.spec.offset;
    buffers_[size_t(b.buffer)].narrow(0, at_, grad.numel()).copy_(grad.reshape(-1));
  }
  if (++b.ready == b.spec.num_params()) start(b);
}

void ShardedGradReducer::start(Bucket& b) {
  if (b.state == Bucket::State::idle) {
    // Started by finish() with no gradient at all: every rank still takes part, with zeros.
    b.buffer = acquire_buffer();
    buffers_[size_t(b.buffer)].narrow(0, 0, b.spec.numel).zero_();
  }
  b.state = Bucket::State::in_flight;
  at::Tensor buf = buffers_[size_t(b.buffer)].narrow(0, 0, b.spec.numel);
  const double pre = opt_.pre_factor(comm_->world_size());
  if (pre != 1.0) buf.mul_(pre);
  const int64_t id = int64_t(&b - buckets_.data());
  if (comm_->world_size() > 1) b.work = comm_->all_reduce(buf, detail::cat("gradient bucket ", id));
  in_flight_.push_back(id);
  // Without overlap_comm the reduction finishes before backward continues.
  if (!opt_.overlap_comm) complete(b);
}

void ShardedGradReducer::complete(Bucket& b) {
  if (b.state != Bucket::State::in_flight) return;
  b.work.wait();
  const int64_t id = int64_t(&b - buckets_.data());
  in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), id));
  FlatGroup& g = *groups_[size_t(b.spec.group)];
  const ShardRange own = g.owned();
  const int64_t begin = std::max(own.begin, b.spec.offset);
  const int64_t end = std::min(own.end, b.spec.offset + b.spec.numel);
  if (end > begin) {
    at::Tensor mine = buffers_[size_t(b.buffer)].narrow(0, begin - b.spec.offset, end - begin);
    at::Tensor shard = g.owned_grads().narrow(0, begin - own.begin, end - begin);
    // Accumulates across micro-steps: the shard holds the running mean-over-ranks sum.
    shard.add_(mine.to(shard.scalar_type()), opt_.post_factor(comm_->world_size()));
  }
  buffer_busy_[size_t(b.buffer)] = false;
  b.buffer = -1;
  b.ready = 0;
  b.state = Bucket::State::idle;
}

void ShardedGradReducer::finish() {
  for (auto& b : buckets_) {
    if (b.state != Bucket::State::in_flight) start(b);
  }
  while (!in_flight_.empty()) complete(buckets_[size_t(in_flight_.front())]);
}

}  // namespace zeroshard
