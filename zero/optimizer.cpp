// The ZeRO optimizer (stages 0-3); see optimizer.h.
#include "zero/optimizer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "runtime/initial_sync.h"
#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/trace.h"
#include "zero/buckets.h"  // bucket caps

namespace zeroshard {

namespace {
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
      state_(scaler_options(config.fp16), int64_t(groups.size())) {
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
  ZS_CHECK(prechunked_shapes.empty() || prechunked_shapes.size() == groups.size(),
           "ZeroOptimizer: ", prechunked_shapes.size(), " shape lists for ", groups.size(), " groups");
  const ZeroConfig& zc = config.zero_optimization;
  const bool nvme = zc.offload_optimizer.device == "nvme";
  const bool offload = zc.offload_optimizer.device == "cpu" || nvme;
  const bool nvme_param = zc.offload_param.device == "nvme";
  const bool offload_param = zc.offload_param.device == "cpu" || nvme_param;
  ZS_REQUIRE(!groups.front().empty(), "ZeroOptimizer: the first parameter group has no parameters");
  const c10::Device device = groups.front().front().device();
  // One host pool for the run, so either offload block's pin_memory pins all of it.
  const bool pin = (zc.offload_optimizer.pin_memory || zc.offload_param.pin_memory) && device.is_cuda();
  spec.params_on_host = offload_param;
  spec.params_on_nvme = nvme_param;
  spec.pin_host = pin;
  if ((offload || offload_param) && optimizer_row(optimizer_.type).tensor_norms) {
    throw ConfigError(detail::cat(
        "zero_optimization.", offload ? "offload_optimizer" : "offload_param", ".device: \"",
        offload ? zc.offload_optimizer.device : zc.offload_param.device, "\" with optimizer ",
        optimizer_.type, offload ? ", whose per-tensor trust ratio has no host-staged form"
                                 : ", whose per-tensor step writes the parameters in place, where "
                                   "offload_param keeps only host chunks",
        "; offload supports Adam, AdamW, Adagrad, Lion and SGD"));
  }
  pool_ = std::make_unique<HostPool>(pin, device, memory_);
  copies_ = std::make_unique<CopyStream>(device);
  if (nvme) swap_ = std::make_unique<SwapSpace>(config, comm_->rank(), *pool_);
  if (nvme_param) param_swap_ = std::make_unique<ParamSwap>(config, comm_->rank(), *pool_, memory_);
  std::vector<FlatGroup*> raw;
  for (size_t g = 0; g < groups.size(); ++g) {
    GroupSpec group_spec = spec;
    if (!prechunked_shapes.empty()) group_spec.prechunked_shapes = prechunked_shapes[g];
    // zero.Init already took rank 0's values when it partitioned a parameter.
    broadcast_from_rank0(groups[g], group_spec.prechunked_shapes);
    groups_.push_back(std::make_unique<FlatGroup>(groups[g], group_spec, memory_));
    raw.push_back(groups_.back().get());
  }
  // Sub-groups over every group, so offload_optimizer.ratio counts them all (as DeepSpeed).
  std::vector<std::vector<int64_t>> piece_begins;
  std::vector<int64_t> owned_numels;
  for (FlatGroup* g : raw) {
    piece_begins.push_back(owned_piece_begins(*g));
    owned_numels.push_back(g->owned().numel());
  }
  auto sub_groups = plan_sub_groups(piece_begins, owned_numels, zc.sub_group_size,
                                    offload ? zc.offload_optimizer.ratio : 0.0,
                                    nvme ? Residency::nvme : Residency::host);
  for (size_t g = 0; g < groups.size(); ++g) {
    shards_.push_back(make_shard(*groups_[g], groups[g],
                                 prechunked_shapes.empty() ? std::vector<ChunkedShape>{} : prechunked_shapes[g],
                                 optimizer_, std::move(sub_groups[g]), *pool_, memory_, swap_.get(),
                                 detail::cat("optimizer_group", g, ".swp")));
  }
  if (swap_) write_out_swapped();
  std::vector<OptimizerShard*> shards;
  for (const auto& s : shards_) shards.push_back(s.get());
  runner_ = std::make_unique<SubGroupRunner>(raw, shards, *pool_, *copies_, swap_.get(), param_swap_.get());
  ReduceOptions ro;
  // Full-gradient stages reduce in place, so overlapping costs no memory and is always on.
  ro.overlap_comm = config.zero_optimization.overlap_comm || strategy_->keeps_full_grads();
  ro.bucket_numel = effective_bucket_numel(config.zero_optimization.reduce_bucket_size,
                                          strategy_->keeps_full_grads(), ro.overlap_comm);
  ro.prescale_gradients = config.prescale_gradients;
  ro.gradient_predivide_factor = config.gradient_predivide_factor;
  // A single rank communicates nothing: a copy in another dtype would only round its gradients.
  if (comm_->world_size() > 1) ro.comm_dtype = comm_dtype(config.communication_data_type);
  reducer_ = strategy_->make_reducer(raw, comm_, ro, memory_);
  // Offloaded gradients start down to host memory as backward finalizes them.
  if (offload) {
    reducer_->on_final_gradients([this](int64_t g, int64_t begin, int64_t numel) {
      runner_->gradients_final(g, begin, numel);
    });
  }
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
    // Values written through the gatherer (GatheredParameters) reach the master copy too; the
    // frozen group has no shard.
    std::vector<OptimizerShard*> gathered_shards = shards;
    if (frozen_) gathered_shards.push_back(nullptr);
    coordinator_ = std::make_unique<ParamCoordinator>(gathered, comm_, config.zero_optimization,
                                                      memory_, gathered_shards, param_swap_.get());
    if (param_swap_) start_param_swap(gathered);
  }
  step_ = std::make_unique<ShardedStep>(raw, shards, *strategy_, *comm_, config_, optimizer_, state_, *runner_);
  full_values_ = std::make_unique<FullValues>(raw, shards, frozen_.get(), *strategy_, comm_, state_,
                                              coordinator_ ? &coordinator_->gatherer() : nullptr);
}

void ZeroOptimizer::write_out_swapped() {
  // Space for every file first, so a full disk is one error with the total, before any write.
  int64_t bytes = 0;
  for (const auto& shard : shards_) {
    for (const ShardPart& p : shard->parts()) bytes += p.swapped ? p.swapped->file_bytes() : 0;
  }
  swap_->dir().require_space(bytes);
  int64_t done = 0;
  for (const auto& shard : shards_) {
    for (const ShardPart& p : shard->parts()) {
      if (p.swapped) p.swapped->preallocate();
    }
    shard->end_resident(true);  // the seeded masters go to disk; host memory keeps none of them
    progress("NVMe: writing the optimizer state", ++done, int64_t(shards_.size()));
  }
}

void ZeroOptimizer::start_param_swap(const std::vector<FlatGroup*>& gathered) {
  std::vector<std::vector<bool>> persistent;
  int64_t index = 0;
  for (const FlatGroup* g : gathered) {
    persistent.emplace_back();
    for (int64_t t = 0; t < g->num_tensors(); ++t) {
      persistent.back().push_back(coordinator_->gatherer().param(index++).persistent);
    }
  }
  param_swap_->start(gathered, persistent);
}

void ZeroOptimizer::broadcast_from_rank0(const std::vector<at::Tensor>& all,
                                         const std::vector<ChunkedShape>& chunked) {
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < all.size(); ++i) {
    if (chunked.empty() || !chunked[i].has_value()) {
      ZS_CHECK(all[i].scalar_type() == at::kFloat, "ZeroOptimizer: parameter values must be fp32, got ",
               all[i].scalar_type());
      params.push_back(all[i]);
    }
  }
  // Master weights are seeded locally from these values: they must be rank 0's first.
  zeroshard::broadcast_from_rank0(*comm_, params, {}, "initial parameters", kInPlaceBucketNumel);
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

void ZeroOptimizer::require_not_failed(const std::string& what) const {
  if (failed_.empty()) return;
  throw Error(detail::cat(what, ": refused, ", failed_));
}

StepResult ZeroOptimizer::step(const std::vector<GroupHyper>& hypers, int64_t samples,
                                double duplicate_sum_sq) {
  require_not_failed("optimizer step");
  trace::Scope traced("optimizer", [] { return std::string("optimizer step"); });
  StepResult r;
  try {
    r = step_->run(hypers, samples, duplicate_sum_sq);
  } catch (const IoError& e) {
    // Some sub-groups may be updated and others not, and the step counters have moved: nothing
    // this rank holds is a consistent state any more (a checkpoint of it would be one).
    failed_ = detail::cat("an earlier optimizer step (", state_.global_steps() + 1, ") failed on rank ",
                          comm_->rank(), " with an I/O error, so the optimizer state is partly "
                          "updated; restart from the last checkpoint. The error: ", e.what());
    throw;
  }
  if (r.applied && coordinator_) coordinator_->gatherer().refresh_persistent();
  zero_grad();
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
  runner_->forget_early_gradients();
  reducer_->zero_grad();
  full_values_->note_zero_grad();
}

std::vector<ShardEntry> ZeroOptimizer::shard_entries(bool with_state) {
  std::vector<FlatGroup*> groups;
  std::vector<OptimizerShard*> shards;
  require_not_failed("reading the optimizer state");
  for (size_t g = 0; g < groups_.size(); ++g) {
    groups.push_back(groups_[g].get());
    shards.push_back(shards_[g].get());
    try {
      shards_[g]->make_resident();  // NVMe state read into host memory until end_entries
    } catch (...) {
      for (size_t h = 0; h < g; ++h) shards_[h]->end_resident(false);  // all or none
      throw;
    }
  }
  if (param_swap_ && !param_swap_->all_held()) {
    try {
      param_swap_->hold_all();  // parameter chunks too, until end_entries
    } catch (...) {
      for (auto& shard : shards_) shard->end_resident(false);
      throw;
    }
  }
  return zeroshard::shard_entries(groups, shards, frozen_.get(), *strategy_, with_state);
}

void ZeroOptimizer::drop_optimizer_state() {
  for (auto& shard : shards_) shard->drop_state();
}

void ZeroOptimizer::inject_swap_fault(const std::string& spec, const std::string& engine) {
  ZS_REQUIRE(engine == "optimizer" || engine == "param", "inject_nvme_fault: engine \"", engine,
             "\"; expected \"optimizer\" or \"param\"");
  const bool param = engine == "param";
  ZS_REQUIRE(param ? bool(param_swap_) : bool(swap_), "inject_nvme_fault: this run has no ",
             param ? "offload_param" : "offload_optimizer", " device \"nvme\"");
  (param ? param_swap_->engine() : swap_->engine()).inject_fault(parse_aio_fault(spec, "inject_nvme_fault"));
}

std::string ZeroOptimizer::swap_backend() const {
  return swap_ ? swap_->backend() : param_swap_ ? param_swap_->backend() : std::string();
}

void ZeroOptimizer::end_entries(bool written) {
  for (auto& shard : shards_) {
    if (shard->resident()) shard->end_resident(written);
  }
  if (param_swap_ && param_swap_->all_held()) {
    param_swap_->unhold_all(written);
    param_swap_->trim();
  }
}

void ZeroOptimizer::after_load() {
  end_entries(true);
  if (!coordinator_) return;
  coordinator_->release_gathered();
  coordinator_->gatherer().refresh_persistent(/*include_frozen=*/true);
}

}  // namespace zeroshard
