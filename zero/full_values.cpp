// Whole values of one parameter; see full_values.h.
#include "zero/full_values.h"

#include <ATen/ATen.h>

#include "kernels/ops.h"
#include "runtime/error.h"

namespace zeroshard {

FullValues::FullValues(std::vector<FlatGroup*> groups, std::vector<OptimizerShard*> shards,
                       FlatGroup* frozen, const ZeroStrategy& strategy, std::shared_ptr<Comm> comm,
                       const TrainingState& state, ParamGatherer* gatherer)
    : groups_(std::move(groups)),
      shards_(std::move(shards)),
      frozen_(frozen),
      strategy_(strategy),
      comm_(std::move(comm)),
      state_(state),
      gatherer_(gatherer) {}

FullValues::Located FullValues::locate(int64_t index) const {
  int64_t i = index;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (i >= 0 && i < groups_[g]->num_tensors()) return {groups_[g], shards_[g], i};
    i -= groups_[g]->num_tensors();
  }
  if (frozen_ && i >= 0 && i < frozen_->num_tensors()) return {frozen_, nullptr, i};
  throw Error(detail::cat("parameter index ", index, " is not one of this engine's parameters"));
}

int64_t FullValues::slot(const Located& at, const std::string& what) const {
  // A frozen parameter has no shard; any optimizer state name is still checked against the row.
  const OptimizerShard* shard = at.shard ? at.shard : shards_.front();
  return shard->slot(what);
}

at::Tensor FullValues::get(int64_t index, const std::string& what) {
  const Located at = locate(index);
  FlatGroup* g = at.group;
  const bool grad = what == "grad";
  const int64_t state = grad ? -1 : slot(at, what);
  if ((!at.shard && what != "fp32_param") || (state >= 0 && !at.shard->has_state()) ||
      (grad && !grads_written_)) {
    return {};
  }
  const int64_t t = at.tensor;
  const int64_t numel = g->layout().numels[size_t(t)];
  at::Tensor full = at::zeros({numel}, g->device_options().dtype(at::kFloat));
  if (grad && g->full_grads()) {  // stages 0/1: every rank holds the whole gradient
    full.copy_(g->grads().narrow(0, g->layout().offsets[size_t(t)], numel));
  } else {
    if (const auto piece = g->owned_piece(t)) {
      at::Tensor dst = full.narrow(0, piece->tensor_begin, piece->numel);
      if (grad) {
        g->copy_owned_grads(piece->buffer_begin, piece->numel, dst);
      } else {
        // A frozen parameter's values are its model copy (stage 3 chunks).
        const int64_t b = piece->buffer_begin, n = piece->numel;
        if (at.shard) {
          dst.copy_(at.shard->read_values(state, b, n));
        } else if (gatherer_) {  // stage 3: the chunk may be on NVMe
          gatherer_->with_chunk(index, [&] { dst.copy_(g->owned_params().narrow(0, b, n)); });
        } else {
          dst.copy_(g->owned_params().narrow(0, b, n));
        }
      }
    }
    // Each element is owned by one rank and zero elsewhere, so the sum is the whole tensor.
    if ((g->partitioned() || strategy_.shards_optimizer_state()) && comm_->world_size() > 1) {
      comm_->all_reduce(full, detail::cat("safe_get_full ", what, " of parameter ", index)).wait();
    }
  }
  if (grad) ops::scale_(full, 1.0 / state_.scaler().scale());
  return full.view(g->shape(t));
}

void FullValues::set(int64_t index, const std::string& what, const at::Tensor& value, int src_rank) {
  const Located at = locate(index);
  FlatGroup* g = at.group;
  const int64_t state = slot(at, what);
  if (state >= 0 && !at.shard) {
    throw UsageError(detail::cat("safe_set_full_optimizer_state: parameter ", index,
                                 " is frozen; it has no optimizer state"));
  }
  const int64_t t = at.tensor;
  const at::IntArrayRef shape(g->shape(t));
  if (value.sizes() != shape) {
    throw UsageError(detail::cat("safe_set_full ", what, ": the value's shape is ", value.sizes(),
                                 ", parameter ", index, "'s is ", shape));
  }
  // A copy: the broadcast writes into it, and the caller's tensor stays as it was.
  at::Tensor full = value.detach().to(g->device_options().dtype(at::kFloat), false, true)
                        .contiguous().view(-1);
  // One rank's value on every rank: replicas cannot diverge where callers pass different values.
  if (comm_->world_size() > 1) {
    comm_->broadcast(full, src_rank,
                     detail::cat("safe_set_full ", what, " of parameter ", index, " from rank ", src_rank))
        .wait();
  }
  if (state < 0) {
    if (gatherer_) {
      gatherer_->overwrite(index, full);
    } else {
      write_tensor_values(*g, at.shard, t, full);
    }
    return;
  }
  at.shard->create_state();  // now when no step has created it yet, on every rank
  if (const auto piece = g->owned_piece(t)) {
    at.shard->write_values(state, piece->buffer_begin, piece->numel,
                           full.narrow(0, piece->tensor_begin, piece->numel));
  }
}

}  // namespace zeroshard
