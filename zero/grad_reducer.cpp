// In-place bucketed all-reduce for stages 0 and 1; see grad_reducer.h.
#include "zero/grad_reducer.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "kernels/ops.h"
#include "runtime/error.h"

namespace zeroshard {

// DeepSpeed's arithmetic: prescale_gradients divides by the world size before the sum; otherwise
// gradient_predivide_factor f divides before the sum and f / world_size scales after it (so fp16
// sums stay in range with f > 1). Either way the result is the mean over ranks. A single rank
// sums nothing: its gradient is the mean, and 1/f then f would only round a 16-bit one twice.
double ReduceOptions::pre_factor(int64_t world_size) const {
  if (world_size == 1) return 1.0;
  return prescale_gradients ? 1.0 / double(world_size) : 1.0 / gradient_predivide_factor;
}

double ReduceOptions::post_factor(int64_t world_size) const {
  if (world_size == 1) return 1.0;
  return prescale_gradients ? 1.0 : gradient_predivide_factor / double(world_size);
}

GradReducer::GradReducer(const std::vector<FlatGroup*>& groups, std::shared_ptr<Comm> comm,
                         const ReduceOptions& options, MemoryAccount& memory)
    : comm_(std::move(comm)), opt_(options), memory_(memory) {
  std::vector<const FlatLayout*> layouts;
  std::vector<int64_t> group_base;
  for (FlatGroup* g : groups) {
    layouts.push_back(&g->layout());
    group_base.push_back(int64_t(views_.size()));
    for (size_t i = 0; i < g->layout().numels.size(); ++i) {
      views_.push_back(g->grads().narrow(0, g->layout().offsets[i], g->layout().numels[i]));
    }
  }
  written_.assign(views_.size(), 0);
  scaled_.assign(views_.size(), 0);
  plan_ = plan_buckets(layouts, opt_.bucket_numel);
  const int64_t world = comm_->world_size();
  for (const BucketSpec& spec : plan_.buckets) {
    Bucket b;
    b.index = int64_t(buckets_.size());
    b.grads = groups[size_t(spec.group)]->grads().narrow(0, spec.offset, spec.numel);
    b.first_param = group_base[size_t(spec.group)] + spec.first_param;
    b.num_params = spec.num_params();
    if (opt_.comm_dtype != at::ScalarType::Undefined && opt_.comm_dtype != b.grads.scalar_type()) {
      b.comm_buffer = at::empty_like(b.grads, b.grads.options().dtype(opt_.comm_dtype));
      accounted_bytes_ += b.comm_buffer.nbytes();
    }
    // Only DeepSpeed's default arithmetic (nothing before the sum, 1/world after it) moves the
    // factor before the sum, where it is exact for power-of-two worlds and costs nothing in a copy
    // that happens anyway; a comm-dtype copy keeps its own scaling after the sum.
    b.folds_mean = !b.comm_buffer.defined() && opt_.pre_factor(world) == 1.0 &&
                   opt_.post_factor(world) != 1.0;
    buckets_.push_back(std::move(b));
  }
  memory_.add(MemoryCategory::comm_buffers, accounted_bytes_);
}

GradReducer::~GradReducer() { memory_.release(MemoryCategory::comm_buffers, accounted_bytes_); }

void GradReducer::adopt(int64_t index, const at::Tensor& grad) {
  at::Tensor& view = views_[size_t(index)];
  ZS_REQUIRE(grad.numel() == view.numel(), "gradient of parameter ", index, " has ", grad.numel(),
           " elements, expected ", view.numel());
  if (grad.data_ptr() == view.data_ptr()) {  // already in place (a script re-set param.grad)
    written_[size_t(index)] = 1;
    return;
  }
  const Bucket& b = buckets_[size_t(plan_.bucket_of_param[size_t(index)])];
  // The first gradient in the boundary backward is the whole window's gradient. One streaming
  // pass (kernels::scale_copy): the view is written without being read first.
  if (boundary_ && !written_[size_t(index)] && b.folds_mean) {
    ops::scale_copy(view, grad, opt_.post_factor(comm_->world_size()));
    scaled_[size_t(index)] = 1;
  } else {
    ops::scale_copy(view, grad, 1.0);
    scaled_[size_t(index)] = 0;
  }
  written_[size_t(index)] = 1;
}

void GradReducer::grad_ready(int64_t index, const at::Tensor& grad) {
  ZS_CHECK(index >= 0 && index < num_params(), "GradReducer::grad_ready: parameter index ", index,
           " is outside 0..", num_params() - 1);
  Bucket& b = buckets_[size_t(plan_.bucket_of_param[size_t(index)])];
  // A parameter reported again after its bucket started (re-entrant backward) changes nothing.
  if (b.state != Bucket::State::idle) return;
  if (grad.defined()) adopt(index, grad);
  if (!boundary_) return;
  if (++b.ready == b.num_params) start(b);
}

void GradReducer::start(Bucket& b) {
  b.state = Bucket::State::in_flight;
  // Parameters that got no gradient in this window: their views still hold an old window's values.
  for (int64_t i = b.first_param; i < b.first_param + b.num_params; ++i) {
    if (!written_[size_t(i)]) {
      views_[size_t(i)].zero_();
      written_[size_t(i)] = 1;
      scaled_[size_t(i)] = 1;
    }
  }
  at::Tensor buf = b.grads;
  if (b.comm_buffer.defined()) {
    b.comm_buffer.copy_(b.grads);
    buf = b.comm_buffer;
  }
  const double pre = opt_.pre_factor(comm_->world_size());
  ops::scale_(buf, pre);
  if (comm_->world_size() > 1) b.work = comm_->all_reduce(buf, detail::cat("gradient bucket ", b.index));
  // Without overlap_comm the reduction finishes before backward continues.
  if (!opt_.overlap_comm) complete(b);
}

void GradReducer::complete(Bucket& b) {
  if (b.state != Bucket::State::in_flight) return;
  b.work.wait();
  const double post = opt_.post_factor(comm_->world_size());
  if (b.comm_buffer.defined()) {
    // The factor applies in the wider of the two dtypes, so the mean is rounded once, into the
    // gradients' dtype: widened first (a bf16 sum into fp32 gradients), or scaled in place
    // before the narrowing copy (an fp32 sum into bf16 gradients).
    if (b.grads.element_size() > b.comm_buffer.element_size()) {
      ops::scale_copy(b.grads, b.comm_buffer, post);
    } else {
      ops::scale_(b.comm_buffer, post);
      b.grads.copy_(b.comm_buffer);
    }
  } else if (post != 1.0) {
    // Only the gradients that did not get the factor in their copy (accumulated windows).
    const auto first = scaled_.begin() + b.first_param, last = first + b.num_params;
    const auto num_scaled = std::count(first, last, uint8_t(1));
    if (num_scaled == 0) {
      ops::scale_(b.grads, post);
    } else if (num_scaled < b.num_params) {
      for (int64_t i = b.first_param; i < b.first_param + b.num_params; ++i) {
        if (!scaled_[size_t(i)]) ops::scale_(views_[size_t(i)], post);
      }
    }
  }
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

void GradReducer::abort() {
  // Reset first, so a wait that throws leaves no half-reset state behind.
  std::vector<Bucket*> started;
  for (auto& b : buckets_) {
    if (b.state == Bucket::State::in_flight) started.push_back(&b);
    b.ready = 0;
    b.state = Bucket::State::idle;
  }
  for (Bucket* b : started) b->work.wait();
}

void GradReducer::zero_grad() {
  std::fill(written_.begin(), written_.end(), 0);
  std::fill(scaled_.begin(), scaled_.end(), 0);
}

}  // namespace zeroshard
