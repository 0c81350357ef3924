// Bucketed gradient all-reduce; see grad_reducer.h.
#include "zero/grad_reducer.h"

#include <ATen/ATen.h>

#include "runtime/error.h"

namespace zeroshard {

GradReducer::GradReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
                         const ReduceOptions& options)
    : comm_(std::move(comm)), opt_(options) {
  ZS_CHECK(opt_.bucket_numel > 0, "zero_optimization.reduce_bucket_size: got ", opt_.bucket_numel,
           ", expected a positive number of elements");
  int64_t first_index = 0;
  for (FlatGroup* g : groups) {
    const FlatLayout& L = g->layout();
    const int64_t n = int64_t(L.numels.size());
    // Walk backwards, closing a bucket when the next parameter would overflow it; a parameter
    // larger than a bucket gets one of its own.
    int64_t end = n;
    while (end > 0) {
      int64_t begin = end - 1;
      int64_t numel = L.numels[begin];
      while (begin > 0 && numel + L.numels[begin - 1] <= opt_.bucket_numel) {
        --begin;
        numel += L.numels[begin];
      }
      Bucket b;
      b.index = int64_t(buckets_.size());
      const int64_t off = L.offsets[begin];
      b.grads = g->grads().narrow(0, off, L.offsets[end - 1] + L.numels[end - 1] - off);
      b.num_params = end - begin;
      buckets_.push_back(std::move(b));
      end = begin;
    }
    first_index += n;
  }
  bucket_of_.assign(first_index, -1);
  // Second pass: map each parameter to its bucket (buckets hold contiguous parameter runs).
  int64_t param_base = 0;
  size_t bucket = 0;
  for (FlatGroup* g : groups) {
    const int64_t n = int64_t(g->layout().numels.size());
    int64_t end = n;
    while (end > 0) {
      const int64_t begin = end - buckets_[bucket].num_params;
      for (int64_t i = begin; i < end; ++i) bucket_of_[param_base + i] = int64_t(bucket);
      end = begin;
      ++bucket;
    }
    param_base += n;
  }
  for (auto& b : buckets_) {
    if (opt_.comm_dtype != at::ScalarType::Undefined && opt_.comm_dtype != b.grads.scalar_type()) {
      b.comm_buffer = at::empty_like(b.grads, b.grads.options().dtype(opt_.comm_dtype));
    }
  }
}

void GradReducer::grad_ready(int64_t index) {
  ZS_CHECK(index >= 0 && index < num_params(), "GradReducer::grad_ready: parameter index ", index,
           " is outside 0..", num_params() - 1);
  Bucket& b = buckets_[bucket_of_[index]];
  // A parameter reported again after its bucket started (re-entrant backward) changes nothing.
  if (b.state != Bucket::State::idle) return;
  if (++b.ready == b.num_params) start(b);
}

void GradReducer::start(Bucket& b) {
  b.state = Bucket::State::in_flight;
  const int64_t world = comm_->world_size();
  at::Tensor buf = b.grads;
  if (b.comm_buffer.defined()) {
    b.comm_buffer.copy_(b.grads);
    buf = b.comm_buffer;
  }
  if (opt_.prescale_gradients && opt_.gradient_predivide_factor != 1.0) {
    buf.mul_(1.0 / opt_.gradient_predivide_factor);
  }
  if (world > 1) b.work = comm_->all_reduce(buf, detail::cat("gradient bucket ", b.index));
  // Without overlap_comm the reduction finishes before backward continues.
  if (!opt_.overlap_comm) complete(b);
}

void GradReducer::complete(Bucket& b) {
  if (b.state != Bucket::State::in_flight) return;
  b.work.wait();
  at::Tensor buf = b.comm_buffer.defined() ? b.comm_buffer : b.grads;
  const int64_t world = comm_->world_size();
  const double post = opt_.prescale_gradients ? opt_.gradient_predivide_factor / double(world)
                                              : 1.0 / double(world);
  if (post != 1.0) buf.mul_(post);
  if (b.comm_buffer.defined()) b.grads.copy_(b.comm_buffer);
  b.state = Bucket::State::done;
}

void GradReducer::finish() {
  for (auto& b : buckets_) {
    if (b.state == Bucket::State::idle) start(b);
  }
  for (auto& b : buckets_) {
    complete(b);
    b.ready = 0;
    b.state = Bucket::State::idle;
  }
}

}  // namespace zeroshard
