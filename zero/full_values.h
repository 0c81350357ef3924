// DeepSpeed's safe_get_full_* / safe_set_full_*: one parameter's whole value (fp32 master, gradient
// or an optimizer state), assembled from what each rank owns, and the reverse. Reads the groups'
// storage and shards; writes through write_tensor_values so the model copy and master agree.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/comm.h"
#include "runtime/training_state.h"
#include "zero/flat_group.h"
#include "zero/optimizer_shard.h"
#include "zero/param_gatherer.h"
#include "zero/strategy.h"

namespace zeroshard {

class FullValues {
 public:
  // groups[i]'s shard is shards[i]; `frozen` (stage 3, may be null) comes after them in the
  // parameter numbering. `gatherer` (stage 3) updates gathered copies. All are owned by the
  // caller and outlive this.
  FullValues(std::vector<FlatGroup*> groups, std::vector<OptimizerShard*> shards, FlatGroup* frozen,
             const ZeroStrategy& strategy, std::shared_ptr<Comm> comm, const TrainingState& state,
             ParamGatherer* gatherer);
  // Whether gradients exist to read: a backward ran since the last zero_grad (the step's too).
  void note_backward() { grads_written_ = true; }
  void note_zero_grad() { grads_written_ = false; }

  // One parameter's whole value in fp32 (an all-reduce where that is a shard: every rank must
  // call it). `index` counts the trainable parameters group by group, then stage 3's frozen ones.
  // `what` is "fp32_param", "grad" (as accumulated so far, divided by the fp16 loss scale) or a
  // torch.optim state name; undefined for a gradient or state a frozen parameter does not have,
  // for a gradient when no backward ran since the last zero_grad (the step's included), and for
  // state before the first step.
  at::Tensor get(int64_t index, const std::string& what);
  // Rank src_rank's `value` (the parameter's shape, any floating dtype) becomes the parameter's
  // value ("fp32_param": the master copy and the model-dtype parameter) or the optimizer state
  // named `what` (created if no step has yet) on every rank. A broadcast: every rank must call it.
  void set(int64_t index, const std::string& what, const at::Tensor& value, int src_rank = 0);

 private:
  struct Located {
    FlatGroup* group;
    OptimizerShard* shard;  // null for a frozen parameter
    int64_t tensor;
  };
  Located locate(int64_t index) const;
  int64_t slot(const Located& at, const std::string& what) const;

  std::vector<FlatGroup*> groups_;
  std::vector<OptimizerShard*> shards_;
  FlatGroup* frozen_;
  const ZeroStrategy& strategy_;
  std::shared_ptr<Comm> comm_;
  const TrainingState& state_;
  ParamGatherer* gatherer_;
  bool grads_written_ = false;
};

}  // namespace zeroshard
