// The optimizer step at an accumulation boundary, over every group's shard: the gradients'
// statistics (global norm, fp16 overflow), the loss scaler's decision, the clipping coefficient,
// the optimizer table row's update of each shard (with the 16-bit model copy written in the same
// pass), and the stage strategy's parameter sync. Per-tensor optimizers (Lamb) run in two phases
// with one collective between them for the whole tensors' norms.
#pragma once
#include <memory>
#include <utility>
#include <vector>

#include "runtime/comm.h"
#include "runtime/config/config.h"
#include "runtime/training_state.h"
#include "zero/flat_group.h"
#include "zero/optimizer_shard.h"
#include "zero/strategy.h"
#include "zero/sub_group_runner.h"

namespace zeroshard {

struct StepResult {
  bool applied = false;       // false when fp16 overflow skipped the step
  double grad_norm = 0.0;     // global L2 norm of the averaged, unscaled gradients, before clipping
  double loss_scale = 1.0;    // the scale used for this step's backward
};

class ShardedStep {
 public:
  // groups[i]'s optimizer state is shards[i]; `runner` steps their sub-groups. Everything is
  // owned by the caller and outlives this.
  ShardedStep(std::vector<FlatGroup*> groups, std::vector<OptimizerShard*> shards,
              ZeroStrategy& strategy, Comm& comm, const Config& config,
              const OptimizerConfig& optimizer, TrainingState& state, SubGroupRunner& runner);

  // Updates every shard with its group's hyperparameters, or skips the step (fp16 overflow);
  // counts it in the training state either way. The caller zeroes the gradients afterwards.
  // duplicate_sum_sq: the sum of squares of gradients this rank holds that another stage of
  // the pipeline holds too (a tied weight's copy on a later owner), left out of the norm.
  StepResult run(const std::vector<GroupHyper>& hypers, int64_t samples, double duplicate_sum_sq = 0.0);
  // A pipeline's other stages hold the rest of the model: the gradient norm (clipping, fp16
  // overflow) is summed over `across` too, the ranks with this rank's data index in every stage.
  void set_model_parallel(Comm* across) { across_ = across; }

 private:
  // Overflow flag and global sum of squares of the owned gradients.
  std::pair<bool, double> inspect_gradients();
  // The owned slices' sum of squares summed over ranks when the state is sharded, less the
  // duplicates, then over the pipeline's stages (+inf stays +inf).
  double global_sum_sq(double local_sum_sq);
  // The piece [begin, begin + numel) of group g's owned range.
  UpdatePiece piece(size_t g, int64_t begin, int64_t numel, const at::Tensor& grad);
  // Elementwise rows: sub-group by sub-group over every group's owned range, where each one's
  // state lives. sum_sq, when not null, gets the gradients' sum of squares (rows that fuse it).
  void apply(const std::vector<GroupHyper>& hypers, const std::vector<UpdateScalars>& scalars,
             double* sum_sq);
  // Per-tensor rows: every tensor's owned piece, norms summed over ranks, then the update.
  void apply_per_tensor(const std::vector<GroupHyper>& hypers, const std::vector<UpdateScalars>& scalars);

  std::vector<FlatGroup*> groups_;
  std::vector<OptimizerShard*> shards_;
  ZeroStrategy& strategy_;
  Comm& comm_;
  const Config& config_;
  const OptimizerConfig& optimizer_;
  const OptimizerRow& row_;
  TrainingState& state_;
  SubGroupRunner& runner_;
  Comm* across_ = nullptr;        // set_model_parallel's
  double duplicate_sum_sq_ = 0.0;  // this run's
};

}  // namespace zeroshard
