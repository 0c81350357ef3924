// The ZeRO optimizer (stages 0-3): owns the flat groups, the gradient reducer, the loss scaler and
// the per-rank memory account, and runs the sharded step at the accumulation boundary.
// Python's engine forwards gradient-hook events and step() calls here.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/comm.h"
#include "runtime/config/config.h"
#include "runtime/loss_scaler.h"
#include "runtime/training_state.h"
#include "runtime/memory.h"
#include "zero/flat_group.h"
#include "zero/grad_reducer.h"
#include "zero/param_coordinator.h"
#include "zero/reducer.h"
#include "zero/strategy.h"

namespace zeroshard {

// Per-group hyperparameters in force for one step (Python's param_groups, after the scheduler).
struct GroupHyper {
  double lr = 1e-3;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double momentum = 0.0, dampening = 0.0;
  bool nesterov = false;
  double lr_decay = 0.0;
};

struct StepResult {
  bool applied = false;       // false when fp16 overflow skipped the step
  double grad_norm = 0.0;     // global L2 norm of the averaged, unscaled gradients, before clipping
  double loss_scale = 1.0;    // the scale used for this step's backward
};

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
    grads_written_ = true;
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
  bool keeps_full_grads() const { return strategy_->keeps_full_grads(); }
  bool partitions_params() const { return strategy_->partitions_params(); }
  // Stage 3 only: the parameter coordinator the engine's module hooks drive.
  ParamCoordinator& coordinator();
  // The factor backward multiplies the loss by (loss scale; 1 without fp16).
  double loss_scale() const { return state_.scaler().scale(); }
  // The optimizer step at an accumulation boundary over `samples` samples (the global batch),
  // counted in the training state whether applied or skipped.
  StepResult step(const std::vector<GroupHyper>& hypers, int64_t samples);
  // Stages 0/1 forget the full gradients (the engine sets param.grad to None, and the next
  // backward writes them again); stages 2/3 zero the owned gradient shards.
  void zero_grad();

  const MemoryAccount& memory() const { return memory_; }
  int64_t stage() const { return strategy_->stage(); }
  // The run's progress: counters, per-group steps, the loss scaler (checkpoints save it whole).
  TrainingState& training_state() { return state_; }
  int64_t num_buckets() const { return reducer_->num_buckets(); }
  // fp32 values of the owned range of group g (for tests and checkpoints).
  at::Tensor master(int64_t g) const { return groups_.at(g)->master(); }
  // DeepSpeed's safe_get_full_*: one parameter's whole value in fp32, assembled from what each
  // rank owns (an all-reduce where that is a shard: every rank must call it). `index` counts the
  // trainable parameters group by group, then stage 3's frozen ones. `what` is "fp32_param", "grad"
  // (as accumulated so far, divided by the fp16 loss scale) or a torch.optim state name; undefined
  // for a gradient or state a frozen parameter does not have, for a gradient when no backward ran
  // since the last zero_grad (the step's included), and for state before the first step.
  at::Tensor full_value(int64_t index, const std::string& what);
  // DeepSpeed's safe_set_full_*: rank src_rank's `value` (the parameter's shape, any floating
  // dtype) becomes the parameter's value (`what` "fp32_param": the master copy and the
  // model-dtype parameter) or the optimizer state named `what` (created if no step has yet) on
  // every rank. A broadcast: every rank must call it. GatheredParameters(modifier_rank) passes
  // its modifier rank for a parameter that is not partitioned (stages 0-2).
  void set_full_value(int64_t index, const std::string& what, const at::Tensor& value,
                      int src_rank = 0);

 private:
  // Overflow flag and sum of squares of the owned gradient slices, reduced across ranks when the
  // state is sharded.
  std::pair<bool, double> inspect_gradients();
  // The group holding parameter `index` (numbered as in full_value) and its index there.
  std::pair<FlatGroup*, int64_t> locate(int64_t index) const;
  // -1 for "fp32_param", else the index in FlatGroup::state() of torch.optim's state name `what`;
  // a ConfigError that lists the optimizer's names for any other.
  int64_t state_slot(const std::string& what) const;
  // The owned slices' sum of squares summed over ranks when the state is sharded (+inf stays +inf).
  double global_sum_sq(double local_sum_sq);
  // Overwrites each rank's fp32 parameter values with rank 0's (the tensors must be fp32), except
  // those that `chunked` marks as already partitioned from rank 0's values.
  void broadcast_from_rank0(const std::vector<at::Tensor>& params,
                            const std::vector<ChunkedShape>& chunked);
  // sum_sq, when not null, has the owned gradients' sum of squares added (+inf for inf/nan); only
  // Adam computes it in its own pass.
  void apply(FlatGroup& g, int64_t group_index, const GroupHyper& h, double grad_scale,
             double* sum_sq = nullptr);

  std::shared_ptr<Comm> comm_;
  Config config_;
  OptimizerConfig optimizer_;
  MemoryAccount memory_;
  std::unique_ptr<ZeroStrategy> strategy_;
  std::vector<std::unique_ptr<FlatGroup>> groups_;
  std::unique_ptr<FlatGroup> frozen_;  // stage 3 with frozen parameters
  std::unique_ptr<Reducer> reducer_;
  std::unique_ptr<ParamCoordinator> coordinator_;  // stage 3
  TrainingState state_;
  OptimizerKind kind_;
  bool grads_written_ = false;  // a backward ran since the last zero_grad
};

}  // namespace zeroshard
