// The ZeRO optimizer (stages 0-2); see optimizer.h.
#include "zero/optimizer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "kernels/ops.h"
#include "runtime/error.h"

namespace zeroshard {

namespace {
// Shard starts aligned to 16 elements: 64 bytes of fp32, so vector kernels start on a cache line.
constexpr int64_t kAlignmentNumel = 16;
// reduce_bucket_size is an upper bound. Stages 0-1 reduce gradients in place in slices of the flat
// buffer, so a bucket costs no memory, but DeepSpeed's default (5e8) would make one bucket that can
// only start after backward ends: capped at 25M elements, so reduction overlaps backward. (DDP's
// cap is 25 MiB, 6.5M fp32 elements; that cap measured no faster here, 19 buckets instead of 4.)
// Stages 2-3 stage each bucket in buffers of its size, so their cap also bounds that memory: 8M
// elements in all, about one transformer layer of a 100M model, in one buffer, or with
// overlap_comm in two of 4M (a larger parameter gets a bucket of its own size). On the 100M GPT
// of bench/zero_step.py, two of 8M put stage 3's peak heap rise level with FSDP2's (1.00), two of
// 4M at 0.97 (bench/RESULTS.md).
constexpr int64_t kInPlaceBucketNumel = 25000000;
constexpr int64_t kStagedBucketNumel = 8000000;

LossScalerOptions scaler_options(const Fp16Config& f) {
  LossScalerOptions o;
  o.dynamic = f.enabled && f.loss_scale == 0.0;
  o.static_scale = f.enabled ? f.loss_scale : 1.0;
  o.initial_scale = std::ldexp(1.0, int(f.initial_scale_power));
  o.window = f.loss_scale_window;
  o.hysteresis = f.hysteresis;
  o.consecutive_hysteresis = f.consecutive_hysteresis;
  o.min_scale = f.min_loss_scale;
  return o;
}

at::ScalarType comm_dtype(const std::string& name) {
  if (name.empty()) return at::ScalarType::Undefined;
  if (name == "fp32") return at::kFloat;
  if (name == "fp16") return at::kHalf;
  if (name == "bf16") return at::kBFloat16;
  throw ConfigError(detail::cat("communication_data_type: got \"", name,
                                "\", expected one of fp32, fp16, bf16"));
}
}  // namespace

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<Comm> comm, const Config& config,
                             const OptimizerConfig& optimizer,
                             const std::vector<std::vector<at::Tensor>>& groups,
                             at::ScalarType model_dtype,
                             const std::vector<std::vector<ChunkedShape>>& prechunked_shapes,
                             const std::vector<at::Tensor>& frozen,
                             const std::vector<ChunkedShape>& frozen_shapes)
    : comm_(std::move(comm)),
      config_(config),
      optimizer_(optimizer),
      strategy_(make_strategy(config.zero_optimization)),
      state_(scaler_options(config.fp16), int64_t(groups.size())),
      kind_(optimizer_kind(optimizer.type)) {
  ZS_CHECK(comm_, "ZeroOptimizer: no communicator");
  ZS_REQUIRE(!groups.empty(), "ZeroOptimizer: no parameter groups with trainable parameters");
  GroupSpec spec;
  spec.model_dtype = model_dtype;
  spec.world_size = comm_->world_size();
  spec.rank = comm_->rank();
  spec.alignment_numel = kAlignmentNumel;
  spec.shard_state = strategy_->shards_optimizer_state();
  spec.full_grads = strategy_->keeps_full_grads();
  spec.partition_params = strategy_->partitions_params();
  spec.kind = kind_;
  spec.initial_accumulator_value = optimizer_.initial_accumulator_value;
  ZS_CHECK(prechunked_shapes.empty() || prechunked_shapes.size() == groups.size(),
           "ZeroOptimizer: ", prechunked_shapes.size(), " shape lists for ", groups.size(), " groups");
  std::vector<FlatGroup*> raw;
  for (size_t g = 0; g < groups.size(); ++g) {
    GroupSpec group_spec = spec;
    if (!prechunked_shapes.empty()) group_spec.prechunked_shapes = prechunked_shapes[g];
    // zero.Init already took rank 0's values when it partitioned a parameter.
    broadcast_from_rank0(groups[g], group_spec.prechunked_shapes);
    groups_.push_back(std::make_unique<FlatGroup>(groups[g], group_spec, memory_));
    raw.push_back(groups_.back().get());
  }
  ReduceOptions ro;
  // Full-gradient stages reduce in place, so overlapping costs no memory and is always on.
  ro.overlap_comm = config.zero_optimization.overlap_comm || strategy_->keeps_full_grads();
  const int64_t cap = strategy_->keeps_full_grads() ? kInPlaceBucketNumel
                      : ro.overlap_comm ? kStagedBucketNumel / 2
                                        : kStagedBucketNumel;
  ro.bucket_numel = std::min(config.zero_optimization.reduce_bucket_size, cap);
  ro.prescale_gradients = config.prescale_gradients;
  ro.gradient_predivide_factor = config.gradient_predivide_factor;
  // A single rank communicates nothing: a copy in another dtype would only round its gradients.
  if (comm_->world_size() > 1) ro.comm_dtype = comm_dtype(config.communication_data_type);
  reducer_ = strategy_->make_reducer(raw, comm_, ro, memory_);
  if (strategy_->partitions_params()) {
    std::vector<FlatGroup*> gathered = raw;
    if (!frozen.empty()) {
      // After the trainable groups, so the coordinator's indices of the trainable tensors are
      // the reducer's.
      GroupSpec frozen_spec = spec;
      frozen_spec.trainable = false;
      frozen_spec.prechunked_shapes = frozen_shapes;
      frozen_ = std::make_unique<FlatGroup>(frozen, frozen_spec, memory_);
      gathered.push_back(frozen_.get());
    }
    coordinator_ =
        std::make_unique<ParamCoordinator>(gathered, comm_, config.zero_optimization, memory_);
  }
}

void ZeroOptimizer::broadcast_from_rank0(const std::vector<at::Tensor>& all,
                                         const std::vector<ChunkedShape>& chunked) {
  if (comm_->world_size() == 1) return;
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < all.size(); ++i) {
    if (chunked.empty() || !chunked[i].has_value()) params.push_back(all[i]);
  }
  // Every rank starts from rank 0's fp32 values (as DeepSpeed broadcasts the model at start), so
  // master weights seeded locally agree everywhere. The values are overwritten in place, a bucket
  // of tensors at a time: a flat copy of the whole model would raise the set-up peak by its size.
  for (const auto& p : params) {
    ZS_CHECK(p.scalar_type() == at::kFloat, "ZeroOptimizer: parameter values must be fp32, got ",
             p.scalar_type());
  }
  size_t first = 0;
  int64_t bucket = 0;
  while (first < params.size()) {
    size_t end = first;
    int64_t numel = 0;
    while (end < params.size() && (end == first || numel + params[end].numel() <= kInPlaceBucketNumel)) {
      numel += params[end++].numel();
    }
    const std::string what = detail::cat("initial parameters, bucket ", bucket++);
    if (end == first + 1 && params[first].is_contiguous()) {
      comm_->broadcast(params[first], 0, what).wait();
    } else {
      std::vector<at::Tensor> pieces;
      for (size_t i = first; i < end; ++i) pieces.push_back(params[i].reshape(-1));
      at::Tensor flat = at::cat(pieces);
      comm_->broadcast(flat, 0, what).wait();
      int64_t offset = 0;
      for (size_t i = first; i < end; ++i) {
        params[i].view(-1).copy_(flat.narrow(0, offset, params[i].numel()));
        offset += params[i].numel();
      }
    }
    first = end;
  }
}

std::vector<std::vector<at::Tensor>> ZeroOptimizer::param_views() const {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& g : groups_) out.push_back(g->param_views());
  return out;
}

std::vector<std::vector<at::Tensor>> ZeroOptimizer::grad_views() const {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& g : groups_) out.push_back(g->grad_views());
  return out;
}

std::pair<bool, double> ZeroOptimizer::inspect_gradients() {
  // One read of the owned gradients (in their own 16-bit or fp32 dtype) gives both the sum of
  // squares and the inf/nan flag; nothing is converted or allocated.
  double sum_sq = 0.0;
  bool finite = true;
  for (const auto& g : groups_) {
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

double ZeroOptimizer::global_sum_sq(double local_sum_sq) {
  if (!strategy_->shards_optimizer_state() || comm_->world_size() == 1) return local_sum_sq;
  // One small all-reduce: an overflow on any rank arrives as +inf in the sum.
  // On the gradients' device: an NCCL group carries CUDA tensors only.
  at::Tensor t = at::full({1}, local_sum_sq, groups_[0]->params().options().dtype(at::kDouble));
  comm_->all_reduce(t, "gradient norm").wait();
  return t.item<double>();
}

void ZeroOptimizer::apply(FlatGroup& g, int64_t gi, const GroupHyper& h, double grad_scale,
                          double* sum_sq) {
  const int64_t step = state_.count_group_step(gi);
  const ShardRange own = g.owned();
  // Mixed precision: the kernels write the updated 16-bit parameters in the same pass.
  const at::Tensor p16_all =
      g.mixed_precision() ? g.params().narrow(0, own.begin, own.numel()) : at::Tensor();
  const at::Tensor master = g.master();
  // As torch.optim: a state created by this step starts from the gradient (SGD's momentum), one
  // that safe_set_full_optimizer_state created before the first step is continued from.
  const bool fresh_state = !g.has_state();
  auto& st = g.state();
  const auto& oc = optimizer_;
  // Piece by piece over the owned range: one piece, or stage 3's gradient segments.
  for (const auto& [offset, grad] : g.grad_pieces()) {
    const int64_t n = grad.numel();
    const auto part = [&](const at::Tensor& t) { return t.defined() ? t.narrow(0, offset, n) : t; };
    const at::Tensor p = part(master), p16 = part(p16_all);
    if (kind_ == OptimizerKind::adam) {
      // The fused step: reads 16-bit (or fp32) gradients, unscales and clips through grad_scale.
      kernels::AdamParams ap{float(h.lr), float(h.beta1), float(h.beta2), float(h.eps),
                             float(h.weight_decay),
                             // DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
                             oc.type == "AdamW" || oc.adam_w_mode, oc.bias_correction, step};
      ap.grad_scale = float(grad_scale);
      kernels::GradStats stats;
      ops::adam_step(p, grad, part(st[0]), part(st[1]), ap, p16, sum_sq ? &stats : nullptr);
      if (sum_sq) *sum_sq += stats.finite ? stats.sum_sq : INFINITY;
      continue;
    }
    const at::Tensor g32 = grad.scalar_type() == at::kFloat && grad_scale == 1.0
                               ? grad
                               : grad.to(at::kFloat).mul_(grad_scale);
    switch (kind_) {
      case OptimizerKind::sgd:
        ops::sgd_step(p, g32, part(st[0]),
                      {float(h.lr), float(h.momentum), float(h.dampening), float(h.weight_decay),
                       h.nesterov, fresh_state}, p16);
        break;
      case OptimizerKind::adagrad:
        ops::adagrad_step(p, g32, part(st[0]),
                          {float(h.lr), float(h.lr_decay), float(h.eps), float(h.weight_decay), step},
                          p16);
        break;
      case OptimizerKind::lion:
        ops::lion_step(p, g32, part(st[0]),
                       {float(h.lr), float(h.beta1), float(h.beta2), float(h.weight_decay)}, p16);
        break;
      case OptimizerKind::adam:
        break;
    }
  }
}

StepResult ZeroOptimizer::step(const std::vector<GroupHyper>& hypers, int64_t samples) {
  ZS_CHECK(hypers.size() == groups_.size(), "ZeroOptimizer::step: got ", hypers.size(),
           " hyperparameter sets for ", groups_.size(), " parameter groups");
  StepResult r;
  LossScaler& scaler = state_.scaler();
  r.loss_scale = scaler.scale();
  // The norm is needed before the update only to clip and to find fp16 overflows. Otherwise the
  // CPU Adam kernel computes it in its own pass, and the gradients are read once instead of twice.
  // (On CUDA the separate pass stays: per-piece statistics would sync between the updates.)
  const bool norm_in_update = kind_ == OptimizerKind::adam && !config_.fp16.enabled &&
                              config_.gradient_clipping <= 0.0 && groups_[0]->master().is_cpu();
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
      zero_grad();
      return r;
    }
    r.grad_norm = std::sqrt(sum_sq) / r.loss_scale;
    if (config_.gradient_clipping > 0.0) {
      // The same coefficient as torch.nn.utils.clip_grad_norm_.
      clip = std::min(1.0, config_.gradient_clipping / (r.grad_norm + 1e-6));
    }
  }
  const double grad_scale = clip / r.loss_scale;
  double local_sum_sq = 0.0;
  for (size_t i = 0; i < groups_.size(); ++i) {
    apply(*groups_[i], int64_t(i), hypers[i], grad_scale, norm_in_update ? &local_sum_sq : nullptr);
    strategy_->sync_params(*groups_[i], *comm_);
  }
  if (norm_in_update) r.grad_norm = std::sqrt(global_sum_sq(local_sum_sq)) / r.loss_scale;
  if (coordinator_) coordinator_->refresh_persistent();
  zero_grad();
  state_.count_step(samples, true);
  r.applied = true;
  return r;
}

void ZeroOptimizer::after_backward(bool accumulation_boundary) {
  if (accumulation_boundary || !strategy_->keeps_full_grads()) reducer_->finish();
  if (coordinator_) coordinator_->release_all();
}

void ZeroOptimizer::abort_backward() {
  reducer_->abort();
  if (coordinator_) coordinator_->abandon_iteration();
}

void ZeroOptimizer::abort_forward() {
  if (coordinator_) coordinator_->abandon_forward();
}

ParamCoordinator& ZeroOptimizer::coordinator() {
  ZS_CHECK(coordinator_, "ZeroOptimizer::coordinator: only stage 3 partitions parameters");
  return *coordinator_;
}

void ZeroOptimizer::zero_grad() {
  reducer_->zero_grad();
  grads_written_ = false;
}

std::pair<FlatGroup*, int64_t> ZeroOptimizer::locate(int64_t index) const {
  int64_t i = index;
  for (const auto& g : groups_) {
    if (i >= 0 && i < g->num_tensors()) return {g.get(), i};
    i -= g->num_tensors();
  }
  if (frozen_ && i >= 0 && i < frozen_->num_tensors()) return {frozen_.get(), i};
  throw Error(detail::cat("parameter index ", index, " is not one of this engine's parameters"));
}

int64_t ZeroOptimizer::state_slot(const std::string& what) const {
  if (what == "fp32_param") return -1;
  const auto names = optimizer_state_names(kind_);
  const auto it = std::find(names.begin(), names.end(), what);
  if (it == names.end()) {
    std::string allowed;
    for (const auto& n : names) allowed += (allowed.empty() ? "" : ", ") + n;
    throw ConfigError(detail::cat("optim_state_key: got \"", what, "\", expected one of ", allowed,
                                  " (the state of ", optimizer_.type, ")"));
  }
  return it - names.begin();
}

at::Tensor ZeroOptimizer::full_value(int64_t index, const std::string& what) {
  const auto [g, t] = locate(index);
  const bool grad = what == "grad";
  const int64_t state = grad ? -1 : state_slot(what);
  if ((!g->trainable() && what != "fp32_param") || (state >= 0 && !g->has_state()) ||
      (grad && !grads_written_)) {
    return {};
  }
  const int64_t numel = g->layout().numels[size_t(t)];
  at::Tensor full = at::zeros({numel}, g->params().options().dtype(at::kFloat));
  if (grad && g->full_grads()) {  // stages 0/1: every rank holds the whole gradient
    full.copy_(g->grads().narrow(0, g->layout().offsets[size_t(t)], numel));
  } else {
    if (const auto piece = g->owned_piece(t)) {
      at::Tensor dst = full.narrow(0, piece->tensor_begin, piece->numel);
      if (grad) {
        g->copy_owned_grads(piece->buffer_begin, piece->numel, dst);
      } else {
        const at::Tensor& src = state >= 0 ? g->state()[size_t(state)] : g->master();
        dst.copy_(src.narrow(0, piece->buffer_begin, piece->numel));
      }
    }
    // Each element is owned by one rank and zero elsewhere, so the sum is the whole tensor.
    if ((g->partitioned() || strategy_->shards_optimizer_state()) && comm_->world_size() > 1) {
      comm_->all_reduce(full, detail::cat("safe_get_full ", what, " of parameter ", index)).wait();
    }
  }
  if (grad) ops::scale_(full, 1.0 / state_.scaler().scale());
  return full.view(g->shape(t));
}

void ZeroOptimizer::set_full_value(int64_t index, const std::string& what, const at::Tensor& value,
                                   int src_rank) {
  const auto [g, t] = locate(index);
  const int64_t state = state_slot(what);
  if (state >= 0 && !g->trainable()) {
    throw ConfigError(detail::cat("safe_set_full_optimizer_state: parameter ", index,
                                  " is frozen; it has no optimizer state"));
  }
  const at::IntArrayRef shape(g->shape(t));
  if (value.sizes() != shape) {
    throw ConfigError(detail::cat("safe_set_full ", what, ": the value's shape is ", value.sizes(),
                                  ", parameter ", index, "'s is ", shape));
  }
  // A copy: the broadcast writes into it, and the caller's tensor stays as it was.
  at::Tensor full = value.detach().to(g->params().options().dtype(at::kFloat), false, true)
                        .contiguous().view(-1);
  // One rank's value on every rank: replicas cannot diverge where callers pass different values.
  if (comm_->world_size() > 1) {
    comm_->broadcast(full, src_rank,
                     detail::cat("safe_set_full ", what, " of parameter ", index, " from rank ", src_rank))
        .wait();
  }
  if (state < 0) {
    if (coordinator_) {
      coordinator_->overwrite(index, full);
    } else {
      g->write_tensor(t, full);
    }
    return;
  }
  auto& states = g->state();  // created now when no step has created it yet
  if (const auto piece = g->owned_piece(t)) {
    states[size_t(state)].narrow(0, piece->buffer_begin, piece->numel)
        .copy_(full.narrow(0, piece->tensor_begin, piece->numel));
  }
}

}  // namespace zeroshard
