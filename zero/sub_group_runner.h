// Runs the optimizer's update sub-group by sub-group wherever each one's state lives. A
// device-resident sub-group updates in place. A host-resident one (offload_optimizer) is a
// pipeline: its gradients come down into a host buffer (as backward finalizes them, or while
// the sub-group before it updates), the host kernel updates the master and writes the new
// model-dtype values into a host buffer in the same pass, and that buffer is copied up while
// the next one updates. An NVMe-resident one is the host pipeline with its master and state read
// from disk before the update and written back after (SwapPipeline). The same update in every
// case: only where it runs differs.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/copy_stream.h"
#include "runtime/host_pool.h"
#include "runtime/optim/table.h"
#include "zero/flat_group.h"
#include "zero/optimizer_shard.h"
#include "zero/param_swap.h"
#include "zero/swap_pipeline.h"

namespace zeroshard {

// Where a step's host time went with offload (bench/offload.py reads it; the step-phase
// reporting of the observability work will too).
struct StagedStepTimes {
  double transfer_ms = 0.0;   // copying and waiting for copies, down and up, in the step
  double host_step_ms = 0.0;  // the kernels' updates of host-resident sub-groups
  int64_t early_sub_groups = 0;  // host sub-groups whose gradients came down during backward
  double nvme_wait_ms = 0.0;  // waiting for NVMe reads and writes of master and state (in transfer_ms too)
};

class SubGroupRunner {
 public:
  // `groups[g]`'s optimizer state is `shards[g]`; all outlive this. The update writes each
  // group's parameters where they live (FlatGroup::params_on_host: ZeRO-3 chunks under
  // offload_param), through a copy when that is not where the sub-group steps. `swap` (NVMe
  // sub-groups' space, outlives this) is null without offload_optimizer.device "nvme";
  // `params` (null without offload_param.device "nvme"; alive whenever run() is) takes the new
  // values of the groups whose chunks it swaps instead (ParamSwap::store).
  SubGroupRunner(std::vector<FlatGroup*> groups, std::vector<OptimizerShard*> shards, HostPool& pool,
                 CopyStream& copies, SwapSpace* swap = nullptr, ParamSwap* params = nullptr);
  ~SubGroupRunner();
  SubGroupRunner(const SubGroupRunner&) = delete;
  SubGroupRunner& operator=(const SubGroupRunner&) = delete;

  // The update of group g's sub-group, given its piece.
  using Update = std::function<void(size_t g, const UpdatePiece& piece)>;
  // Every sub-group of every group, in order.
  void run(const Update& update);
  // Group g's owned gradients [begin, begin + numel) are final for this window (the reducer's
  // on_final_gradients): their copy to the host buffers of the sub-groups they meet starts now.
  void gradients_final(int64_t g, int64_t begin, int64_t numel);
  // The copies gradients_final started are dropped (a new window starts, or its gradients were
  // zeroed without a step).
  void forget_early_gradients();
  const StagedStepTimes& last_times() const { return times_; }

 private:
  struct Job {
    size_t g = 0;
    SubGroup sg;
  };
  // A host-resident sub-group's gradients in a host pool buffer, with the fence of the last copy
  // into it (the copies run in order on one stream) and how many elements were copied.
  struct Staged {
    at::Tensor grad_buffer;
    CopyFence grad_fence;
    int64_t copied = 0;
  };
  struct Upload {
    at::Tensor buffer;  // a pool buffer to give back, or undefined
    CopyFence fence;
  };
  using Pieces = std::vector<std::pair<int64_t, at::Tensor>>;  // a group's grad_pieces()
  // A host sub-group's gradients: those gradients_final brought when they are complete, else a
  // copy of all of them started now.
  Staged prepare(const Pieces& pieces, const Job& job);
  void update_in_place(const Pieces& pieces, const Job& job, const Update& update);
  // `stage`: an NVMe sub-group's staging buffer (swaps->take()), written back by swaps->put().
  void update_on_host(Staged staged, const Job& job, const Update& update, std::vector<Upload>& uploads,
                      SwapPipeline* swaps, const at::Tensor& stage);
  void finish_upload(Upload& u);
  // The host-resident (and NVMe) sub-groups `host` of one step, in order.
  void run_host(const std::vector<Job>& host, const std::vector<Pieces>& pieces, const Update& update,
                SwapPipeline* swaps);

  std::vector<FlatGroup*> groups_;
  std::vector<OptimizerShard*> shards_;
  HostPool& pool_;
  CopyStream& copies_;
  std::unique_ptr<SwapPipeline> swaps_;  // offload_optimizer.device "nvme"
  ParamSwap* params_;                    // offload_param.device "nvme"
  bool backwards_ = false;               // this step's NVMe sub-groups in reverse order
  std::map<std::pair<size_t, int64_t>, Staged> early_;  // (group, sub-group begin)
  StagedStepTimes times_;
};

}  // namespace zeroshard
