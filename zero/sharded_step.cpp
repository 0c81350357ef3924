// The sharded optimizer step; see sharded_step.h.
#include "zero/sharded_step.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "kernels/ops.h"
#include "runtime/error.h"

namespace zeroshard {

ShardedStep::ShardedStep(std::vector<FlatGroup*> groups, std::vector<OptimizerShard*> shards,
                         ZeroStrategy& strategy, Comm& comm, const Config& config,
                         const OptimizerConfig& optimizer, TrainingState& state,
                         SubGroupRunner& runner)
    : groups_(std::move(groups)),
      shards_(std::move(shards)),
      strategy_(strategy),
      comm_(comm),
      config_(config),
      optimizer_(optimizer),
      row_(optimizer_row(optimizer.type)),
      state_(state),
      runner_(runner) {
  ZS_CHECK(!groups_.empty() && groups_.size() == shards_.size(), "ShardedStep: ", groups_.size(),
           " groups and ", shards_.size(), " shards");
}

std::pair<bool, double> ShardedStep::inspect_gradients() {
  // One read of the owned gradients (in their own 16-bit or fp32 dtype) gives both the sum of
  // squares and the inf/nan flag; nothing is converted or allocated.
  double sum_sq = 0.0;
  bool finite = true;
  for (FlatGroup* g : groups_) {
    for (const auto& piece : g->grad_pieces()) {
      const auto stats = ops::grad_stats(piece.second);
      sum_sq += stats.sum_sq;
      finite = finite && stats.finite;
    }
  }
  if (!finite) sum_sq = INFINITY;
  sum_sq = global_sum_sq(sum_sq);
  // Only fp16 skips steps; bf16 and fp32 apply them as DeepSpeed does.
  const bool overflow = config_.fp16.enabled && !std::isfinite(sum_sq);
  return {overflow, sum_sq};
}

double ShardedStep::global_sum_sq(double local_sum_sq) {
  double sum_sq = local_sum_sq;
  // On the gradients' device: an NCCL group carries CUDA tensors only.
  const auto options = groups_[0]->device_options().dtype(at::kDouble);
  if (strategy_.shards_optimizer_state() && comm_.world_size() > 1) {
    // One small all-reduce: an overflow on any rank arrives as +inf in the sum.
    at::Tensor t = at::full({1}, sum_sq, options);
    comm_.all_reduce(t, "gradient norm").wait();
    sum_sq = t.item<double>();
  }
  // The stage's whole sum now (equal on its data-parallel ranks), so whole duplicates come off.
  if (std::isfinite(sum_sq) && std::isfinite(duplicate_sum_sq_)) sum_sq = std::max(0.0, sum_sq - duplicate_sum_sq_);
  else sum_sq = INFINITY;
  if (across_ != nullptr && across_->world_size() > 1) {
    at::Tensor t = at::full({1}, sum_sq, options);
    across_->all_reduce(t, "gradient norm across pipeline stages").wait();
    sum_sq = t.item<double>();
  }
  return sum_sq;
}

UpdatePiece ShardedStep::piece(size_t g, int64_t begin, int64_t numel, const at::Tensor& grad) {
  OptimizerShard& shard = *shards_[g];
  UpdatePiece p;
  p.master = shard.master(begin, numel);
  p.grad = grad;
  for (size_t s = 0; s < row_.state_names.size(); ++s) p.state.push_back(shard.state(s, begin, numel));
  // A master of its own: the kernels write the updated 16-bit parameters in the same pass.
  if (!shard.shares_model_copy(begin, numel)) p.param16 = groups_[g]->owned_params().narrow(0, begin, numel);
  return p;
}

void ShardedStep::apply(const std::vector<GroupHyper>& hypers, const std::vector<UpdateScalars>& scalars,
                        double* sum_sq) {
  runner_.run([&](size_t g, const UpdatePiece& p) {
    kernels::GradStats stats;
    row_.update(p, hypers[g], optimizer_, scalars[g], sum_sq ? &stats : nullptr);
    if (sum_sq) *sum_sq += stats.finite ? stats.sum_sq : INFINITY;
  });
}

namespace {
// The owned gradients [begin, begin + numel) from `pieces` (a group's grad_pieces()): a view where
// one piece holds them, else a copy (a stage-3 tensor chunk that spans gradient segments).
at::Tensor grad_range(const FlatGroup& g, const std::vector<std::pair<int64_t, at::Tensor>>& pieces,
                      int64_t begin, int64_t numel) {
  for (const auto& [offset, grad] : pieces) {
    if (offset <= begin && begin + numel <= offset + grad.numel()) return grad.narrow(0, begin - offset, numel);
  }
  at::Tensor out = at::empty({numel}, g.device_options());
  g.copy_owned_grads(begin, numel, out);
  return out;
}
}  // namespace

void ShardedStep::apply_per_tensor(const std::vector<GroupHyper>& hypers,
                                   const std::vector<UpdateScalars>& scalars) {
  // Two sums (weights, update) per tensor, numbered over the groups, on the parameters' device:
  // the first phase adds to them without waiting for the device.
  std::vector<int64_t> first(groups_.size() + 1, 0);
  for (size_t g = 0; g < groups_.size(); ++g) first[g + 1] = first[g] + groups_[g]->num_tensors();
  at::Tensor sums = at::zeros({2 * first.back()}, groups_[0]->device_options().dtype(at::kDouble));
  // Phase 1: moments, and each tensor's sums of squares over the pieces this rank owns.
  std::vector<std::vector<std::pair<int64_t, UpdatePiece>>> pieces(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    const auto grads = groups_[g]->grad_pieces();
    for (int64_t t = 0; t < groups_[g]->num_tensors(); ++t) {
      const auto own = groups_[g]->owned_piece(t);
      if (!own) continue;  // its sums stay 0 here; the ranks that own it add theirs
      UpdatePiece p = piece(g, own->buffer_begin, own->numel,
                            grad_range(*groups_[g], grads, own->buffer_begin, own->numel));
      row_.tensor_norms(p, hypers[g], optimizer_, scalars[g], sums.narrow(0, 2 * (first[g] + t), 2));
      pieces[g].emplace_back(first[g] + t, std::move(p));
    }
  }
  // One collective for every tensor's norms: each element is owned by one rank.
  if (strategy_.shards_optimizer_state() && comm_.world_size() > 1) {
    comm_.all_reduce(sums, "Lamb per-tensor norms").wait();
  }
  const at::Tensor host = sums.cpu();
  const double* n = host.data_ptr<double>();
  // Phase 2: each piece steps with its whole tensor's trust ratio.
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (const auto& [tensor, p] : pieces[g]) {
      UpdateScalars s = scalars[g];
      s.w_sq = n[2 * tensor];
      s.u_sq = n[2 * tensor + 1];
      row_.update(p, hypers[g], optimizer_, s, nullptr);
    }
  }
}

StepResult ShardedStep::run(const std::vector<GroupHyper>& hypers, int64_t samples, double duplicate_sum_sq) {
  duplicate_sum_sq_ = duplicate_sum_sq;
  ZS_REQUIRE(hypers.size() == groups_.size(), "optimizer step: got ", hypers.size(),
             " parameter groups, the engine was initialized with ", groups_.size(),
             " (groups cannot be added after initialize)");
  StepResult r;
  LossScaler& scaler = state_.scaler();
  r.loss_scale = scaler.scale();
  // The norm is needed before the update only to clip and to find fp16 overflows. Otherwise a
  // kernel that fuses it computes it in its own pass, and the gradients are read once, not twice.
  // (On CUDA the separate pass stays: per-piece statistics would sync between the updates.)
  bool masters_on_cpu = true;
  for (const OptimizerShard* shard : shards_) {
    for (const ShardPart& p : shard->parts()) masters_on_cpu = masters_on_cpu && p.master.is_cpu();
  }
  const bool norm_in_update = row_.fuses_grad_stats && !config_.fp16.enabled &&
                              config_.gradient_clipping <= 0.0 && masters_on_cpu;
  double clip = 1.0;
  if (norm_in_update) {
    scaler.update(false);
  } else {
    auto [overflow, sum_sq] = inspect_gradients();
    const bool skip = scaler.update(overflow);
    if (skip) {
      // DeepSpeed's default: an overflow at the minimum scale ends the run rather than skipping forever.
      if (overflow && scaler.at_minimum_after_overflow()) {
        throw Error(detail::cat("fp16: gradient overflow with the loss scale already at "
                                "fp16.min_loss_scale (", scaler.scale(), "), so no step can be "
                                "applied; lower the learning rate or fp16.min_loss_scale, or use bf16"));
      }
      state_.count_step(samples, false);
      r.grad_norm = -1.0;  // DeepSpeed reports no norm for a skipped step
      return r;
    }
    r.grad_norm = std::sqrt(sum_sq) / r.loss_scale;
    if (config_.gradient_clipping > 0.0) {
      // The same coefficient as torch.nn.utils.clip_grad_norm_.
      clip = std::min(1.0, config_.gradient_clipping / (r.grad_norm + 1e-6));
    }
  }
  std::vector<UpdateScalars> scalars(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    scalars[g].step = state_.count_group_step(int64_t(g));
    scalars[g].grad_scale = clip / r.loss_scale;
    // As torch.optim: a state created by this step starts from the gradient (SGD's momentum), one
    // that safe_set_full_optimizer_state created before the first step is continued from.
    scalars[g].fresh_state = !shards_[g]->has_state();
  }
  // Every rank holds state after a step, also one whose owned range of a group is padding only
  // (the per-tensor path creates it only for owned pieces), so collectives over it line up.
  for (OptimizerShard* shard : shards_) shard->create_state();
  double local_sum_sq = 0.0;
  if (row_.tensor_norms) {
    apply_per_tensor(hypers, scalars);
  } else {
    apply(hypers, scalars, norm_in_update ? &local_sum_sq : nullptr);
  }
  for (FlatGroup* g : groups_) strategy_.sync_params(*g, comm_);
  if (norm_in_update) r.grad_norm = std::sqrt(global_sum_sq(local_sum_sq)) / r.loss_scale;
  state_.count_step(samples, true);
  r.applied = true;
  return r;
}

}  // namespace zeroshard
