// In-place bucketed all-reduce for stages 0 and 1; see grad_reducer.h.
#include "zero/grad_reducer.h"

#include <ATen/ATen.h>

#include "runtime/error.h"

namespace zeroshard {

// DeepSpeed's arithmetic: prescale_gradients divides by the world size before the sum; otherwise
// gradient_predivide_factor f divides before the sum and f / world_size scales after it (so fp16
// sums stay in range with f > 1). Either way the result is the mean over ranks.
double ReduceOptions::pre_factor(int64_t world_size) const {
  return prescale_gradients ? 1.0 / double(world_size) : 1.0 / gradient_predivide_factor;
}

double ReduceOptions::post_factor(int64_t world_size) const {
  return prescale_gradients ? 1.0 : gradient_predivide_factor / double(world_size);
}

GradReducer::GradReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
                         const ReduceOptions& options)
    : comm_(std::move(comm)), opt_(options) {
  std::vector<const FlatLayout*> layouts;
  for (FlatGroup* g : groups) layouts.push_back(&g->layout());
  plan_ = plan_buckets(layouts, opt_.bucket_numel);
  for (const BucketSpec& spec : plan_.buckets) {
    Bucket b;
    b.index = int64_t(buckets_.size());
    b.grads = groups[size_t(spec.group)]->grads().narrow(0, spec.offset, spec.numel);
    b.num_params = spec.num_params();
    if (opt_.comm_dtype != at::ScalarType::Undefined && opt_.comm_dtype != b.grads.scalar_type()) {
      b.comm_buffer = at::empty_like(b.grads, b.grads.options().dtype(opt_.comm_dtype));
    }
    buckets_.push_back(std::move(b));
  }
}

void GradReducer::grad_ready(int64_t index, const at::Tensor&) {
  ZS_CHECK(index >= 0 && index < num_params(), "GradReducer::grad_ready: parameter index ", index,
           " is outside 0..", num_params() - 1);
  Bucket& b = buckets_[size_t(plan_.bucket_of_param[size_t(index)])];
  // A parameter reported again after its bucket started (re-entrant backward) changes nothing.
  if (b.state != Bucket::State::idle) return;
  if (++b.ready == b.num_params) start(b);
}

void GradReducer::start(Bucket& b) {
  b.state = Bucket::State::in_flight;
  at::Tensor buf = b.grads;
  if (b.comm_buffer.defined()) {
    b.comm_buffer.copy_(b.grads);
    buf = b.comm_buffer;
  }
  const double pre = opt_.pre_factor(comm_->world_size());
  if (pre != 1.0) buf.mul_(pre);
  if (comm_->world_size() > 1) b.work = comm_->all_reduce(buf, detail::cat("gradient bucket ", b.index));
  // Without overlap_comm the reduction finishes before backward continues.
  if (!opt_.overlap_comm) complete(b);
}

void GradReducer::complete(Bucket& b) {
  if (b.state != Bucket::State::in_flight) return;
  b.work.wait();
  at::Tensor buf = b.comm_buffer.defined() ? b.comm_buffer : b.grads;
  const double post = opt_.post_factor(comm_->world_size());
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
