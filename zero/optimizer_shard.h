// A rank's share of the optimizer: the fp32 master values of its owned range and the optimizer
// state (the table row's tensors), with where they live. The optimizer step reads the gradients
// and writes the model copy, but updates nothing else: offload moves this object, not the step.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "runtime/memory.h"
#include "runtime/optim/table.h"
#include "zero/flat_group.h"

namespace zeroshard {

// Where a shard's master values and state live: the parameters' device. Host memory and NVMe
// come with the offload work.
enum class Residency { device };

class OptimizerShard {
 public:
  // `master` holds the owned range's fp32 values. `shares_model_copy`: it is the fp32 model
  // copy's own slice (fp32 training on the device), so the step updates the model in place and
  // no second copy exists; otherwise it is this shard's own tensor, accounted here.
  OptimizerShard(at::Tensor master, bool shares_model_copy, const OptimizerRow& row,
                 double state_init, MemoryAccount& memory);
  ~OptimizerShard();
  OptimizerShard(const OptimizerShard&) = delete;
  OptimizerShard& operator=(const OptimizerShard&) = delete;

  Residency residency() const { return Residency::device; }
  int64_t numel() const { return master_.numel(); }
  at::Tensor master() const { return master_; }
  bool shares_model_copy() const { return shares_model_copy_; }
  const OptimizerRow& row() const { return row_; }
  // The state, created (and accounted) on first use, that is at the first optimizer step, as
  // torch.optim does: until then the caller's original parameter tensors are usually still
  // alive, and creating the state with them would raise the set-up peak above the steady state.
  std::vector<at::Tensor>& state();
  bool has_state() const { return !state_.empty(); }
  // Back to before the first step (a checkpoint saved before its first step was loaded): the
  // state is freed and the next step creates it again.
  void drop_state();
  // -1 for "fp32_param", else the state slot of torch.optim's name `what`; a ConfigError that
  // lists the row's names for any other.
  int64_t slot(const std::string& what) const;

 private:
  at::Tensor master_;
  bool shares_model_copy_;
  const OptimizerRow& row_;
  double state_init_;
  std::vector<at::Tensor> state_;
  MemoryAccount& memory_;
  int64_t master_bytes_ = 0, state_bytes_ = 0;
};

// Tensor i of `storage` takes `full` (its whole value, fp32): the model copy, and the owned
// piece of `shard`'s master when it has one of its own. The one way values enter a group.
void write_tensor_values(FlatGroup& storage, OptimizerShard* shard, int64_t i, const at::Tensor& full);

// Group `storage`'s shard. Its master is the model copy's owned slice when the model is fp32,
// else a new fp32 tensor seeded from the caller's fp32 `values` (one per tensor: whole, or this
// rank's chunk where `prechunked` gives a full shape), not from the rounded 16-bit copy.
std::unique_ptr<OptimizerShard> make_shard(const FlatGroup& storage, const std::vector<at::Tensor>& values,
                                           const std::vector<ChunkedShape>& prechunked,
                                           const OptimizerConfig& config, MemoryAccount& memory);

}  // namespace zeroshard
