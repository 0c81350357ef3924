// The ZeRO optimizer (stages 0-3): builds and owns one run's pieces (the stage strategy, each
// group's storage and optimizer shard, the gradient reducer, stage 3's parameter coordinator, the
// training state, the per-rank memory account) and connects them: Python's engine forwards
// backward events and step() calls here. The step itself is ShardedStep's; safe_get/set of whole
// values is FullValues'.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/comm.h"
#include "runtime/config/config.h"
#include "runtime/copy_stream.h"
#include "runtime/host_pool.h"
#include "runtime/loss_scaler.h"
#include "runtime/training_state.h"
#include "runtime/memory.h"
#include "zero/flat_group.h"
#include "zero/full_values.h"
#include "zero/optimizer_shard.h"
#include "zero/param_coordinator.h"
#include "zero/reducer.h"
#include "zero/shard_entries.h"
#include "zero/sharded_step.h"
#include "zero/strategy.h"
#include "zero/sub_group_runner.h"

namespace zeroshard {

class ZeroOptimizer {
 public:
  // `groups`: each parameter group's trainable tensors with their current (fp32) values.
  // `optimizer`: the config's optimizer block, or the one a client torch optimizer maps to.
  // `prechunked_shapes` (zero.Init): empty when every tensor is whole, else one entry per tensor
  // of each group, the full shape of a tensor held as this rank's ZeRO-3 chunk (nullopt if whole).
  // `frozen`: the model's parameters without gradients, in the model dtype, already equal on
  // every rank, with `frozen_shapes` like prechunked_shapes. Stage 3 partitions them and gathers
  // them with the rest; the other stages leave them where they are.
  ZeroOptimizer(std::shared_ptr<Comm> comm, const Config& config, const OptimizerConfig& optimizer,
                const std::vector<std::vector<at::Tensor>>& groups, at::ScalarType model_dtype,
                const std::vector<std::vector<ChunkedShape>>& prechunked_shapes = {},
                const std::vector<at::Tensor>& frozen = {},
                const std::vector<ChunkedShape>& frozen_shapes = {});
  // Groups and reducers hold a reference to memory_: the object never moves.
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  std::vector<std::vector<at::Tensor>> param_views() const;
  std::vector<std::vector<at::Tensor>> grad_views() const;
  int64_t num_params() const { return reducer_->num_params(); }

  // Before each backward: whether it ends the gradient accumulation window.
  void before_backward(bool accumulation_boundary) {
    full_values_->note_backward();
    // A window's gradients are final only after its last backward; copies from an earlier one
    // (a backward repeated without a step) are stale.
    if (accumulation_boundary) runner_->forget_early_gradients();
    reducer_->begin_backward(accumulation_boundary);
  }
  // Parameter `param_index`'s gradient for this backward is final (hook on the autograd thread).
  void grad_ready(int64_t param_index, const at::Tensor& grad) {
    reducer_->grad_ready(param_index, grad);
    if (coordinator_) coordinator_->grad_done(param_index);
  }
  // Called when backward returns: reduces what this stage reduces after this backward (stages
  // 0/1 at the accumulation boundary only, stage 2 every micro-step) and waits for it.
  void after_backward(bool accumulation_boundary);
  // Instead of after_backward when backward raised: finishes the collectives it started, drops
  // its half-done reduction state and releases gathered parameters. The micro-step's gradients
  // that were already reduced stay until zero_grad.
  void abort_backward();
  // When the model's forward raised: stage 3 releases what the forward gathered.
  void abort_forward();
  const ZeroStrategy& strategy() const { return *strategy_; }
  // The optimizer this run steps with (its table row: optimizer_row(optimizer().type)).
  const OptimizerConfig& optimizer() const { return optimizer_; }
  // Stage 3 only: the parameter coordinator the engine's module hooks drive; its gatherer() holds
  // the parameters' gather state.
  ParamCoordinator& coordinator();
  // The optimizer step at an accumulation boundary over `samples` samples (the global batch),
  // counted in the training state whether applied or skipped; the gradients start from zero after.
  // duplicate_sum_sq: see ShardedStep::run.
  StepResult step(const std::vector<GroupHyper>& hypers, int64_t samples, double duplicate_sum_sq = 0.0);
  // Pipelines: the ranks of the other stages with this rank's data index (ShardedStep's
  // set_model_parallel); the gradient norm is summed over them too.
  void set_model_parallel(std::shared_ptr<Comm> across) {
    across_ = std::move(across);
    step_->set_model_parallel(across_.get());
  }
  // Stages 0/1 forget the full gradients (the engine sets param.grad to None, and the next
  // backward writes them again); stages 2/3 zero the owned gradient shards.
  void zero_grad();

  const MemoryAccount& memory() const { return memory_; }
  // The run's progress: counters, per-group steps, the loss scaler (checkpoints save it whole).
  TrainingState& training_state() { return state_; }
  int64_t num_buckets() const { return reducer_->num_buckets(); }
  // fp32 master values of group g's owned range, copied into one CPU tensor (for tests).
  at::Tensor master(int64_t g) const { return shards_.at(size_t(g))->master_values(); }
  // Group g's sub-groups: (begin, numel, residency name) each.
  const std::vector<SubGroup>& sub_groups(int64_t g) const { return shards_.at(size_t(g))->sub_groups(); }
  // Where the last step's host time went (offload).
  const StagedStepTimes& last_step_times() const { return runner_->last_times(); }
  // DeepSpeed's safe_get_full_* / safe_set_full_*.
  FullValues& full_values() { return *full_values_; }
  // What this rank holds, for checkpoints (shard_entries.h); `with_state` creates the optimizer
  // state where no step has run yet, for a load to fill. NVMe state and parameter chunks are read
  // into host memory for it and stay there until end_entries() (a reader: the optimizer state's
  // views keep their memory after it, the parameter chunks' do not, so read before ending) or
  // after_load() (a writer: written back to disk).
  std::vector<ShardEntry> shard_entries(bool with_state);
  void end_entries(bool written);
  // After a load wrote into shard_entries' views between steps: NVMe state is written back,
  // stage 3 releases what is gathered and gathers the persistent parameters again from the new
  // chunks.
  void after_load();
  // Test hook (fault tests): the `spec` ("eio:read:1": parse_aio_fault) block request from now
  // of one NVMe engine fails: "optimizer" (offload_optimizer's) or "param" (offload_param's). An
  // error where that block is not on NVMe.
  void inject_swap_fault(const std::string& spec, const std::string& engine);
  // NVMe offload (optimizer's, else parameters'): the I/O engine in use and why; empty otherwise.
  std::string swap_backend() const;
  // offload_param.device "nvme": the parameter chunks' swap; null otherwise.
  const ParamSwap* param_swap() const { return param_swap_.get(); }
  // A checkpoint saved before its first step was loaded: every shard's optimizer state is freed
  // and created again by the next step.
  void drop_optimizer_state();

 private:
  // Overwrites each rank's fp32 parameter values with rank 0's (the tensors must be fp32), except
  // those that `chunked` marks as already partitioned from rank 0's values.
  void broadcast_from_rank0(const std::vector<at::Tensor>& params,
                            const std::vector<ChunkedShape>& chunked);
  // NVMe: checks the disk space of every shard's file, allocates them and writes the seeded
  // masters out.
  void write_out_swapped();
  // offload_param.device "nvme": which chunks stay in host memory (persistent parameters), then
  // every other chunk to disk.
  void start_param_swap(const std::vector<FlatGroup*>& gathered);
  // An Error naming `what` once a step has failed part-way (failed_).
  void require_not_failed(const std::string& what) const;

  std::shared_ptr<Comm> comm_;
  Config config_;
  OptimizerConfig optimizer_;
  MemoryAccount memory_;
  std::unique_ptr<HostPool> pool_;       // offload's host buffers (empty without offload)
  std::unique_ptr<CopyStream> copies_;
  std::unique_ptr<SwapSpace> swap_;      // offload_optimizer.device "nvme"; before the shards' files
  std::unique_ptr<ZeroStrategy> strategy_;
  std::vector<std::unique_ptr<FlatGroup>> groups_;
  std::vector<std::unique_ptr<OptimizerShard>> shards_;  // one per group
  // After the groups and shards it steps, so it goes first (its early copies read them).
  std::unique_ptr<SubGroupRunner> runner_;
  std::unique_ptr<FlatGroup> frozen_;  // stage 3 with frozen parameters
  std::unique_ptr<Reducer> reducer_;
  // offload_param.device "nvme": after the groups it swaps, before the coordinator that uses it.
  std::unique_ptr<ParamSwap> param_swap_;
  std::unique_ptr<ParamCoordinator> coordinator_;  // stage 3
  TrainingState state_;
  std::unique_ptr<ShardedStep> step_;
  std::shared_ptr<Comm> across_;  // set_model_parallel's
  std::unique_ptr<FullValues> full_values_;
  // Set when a step failed part-way with an I/O error: every later step and state read refuses.
  std::string failed_;
};

}  // namespace zeroshard
