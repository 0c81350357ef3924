// A rank's share of the optimizer: the fp32 master values of its owned range and the optimizer
// state (the table row's tensors), in parts by residency: [0, split) on the parameters' device,
// [split, numel) offloaded (offload_optimizer: host memory, or files on NVMe), either possibly
// empty. The optimizer step reads the gradients and writes the model copy, but updates nothing
// else: offload moves this object, not the step.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

#include "runtime/host_pool.h"
#include "runtime/memory.h"
#include "runtime/optim/table.h"
#include "zero/flat_group.h"
#include "zero/sub_groups.h"
#include "zero/swap_space.h"

namespace zeroshard {

// One residency's slice [begin, begin + numel) of the owned range.
struct ShardPart {
  int64_t begin = 0, numel = 0;
  Residency residency = Residency::device;
  // The master is the fp32 model copy's own slice (fp32 training, device part), so the step
  // updates the model in place and no second copy exists.
  bool shares_model_copy = false;
  at::Tensor master;
  std::vector<at::Tensor> state;  // empty until created
  // An NVMe part: its sub-groups live in this file, and `master` and `state` exist only while
  // the shard is resident (OptimizerShard::make_resident); the step stages sub-groups itself.
  std::unique_ptr<SwappedPart> swapped;
};

class OptimizerShard {
 public:
  // `parts` tile the owned range with their masters set; `sub_groups` (plan_sub_groups) tile it
  // too, each inside one part. State is created on first use. A shard with an NVMe part starts
  // resident (make_resident), so its masters can be seeded; end_resident(true) writes them out.
  OptimizerShard(std::vector<ShardPart> parts, std::vector<SubGroup> sub_groups, const OptimizerRow& row,
                 double state_init, MemoryAccount& memory);
  ~OptimizerShard();
  OptimizerShard(const OptimizerShard&) = delete;
  OptimizerShard& operator=(const OptimizerShard&) = delete;

  int64_t numel() const { return numel_; }
  const std::vector<ShardPart>& parts() const { return parts_; }
  const std::vector<SubGroup>& sub_groups() const { return sub_groups_; }
  const OptimizerRow& row() const { return row_; }
  // The part that holds [begin, begin + numel) (checked: a range never spans two).
  const ShardPart& part(int64_t begin, int64_t numel) const;
  bool shares_model_copy(int64_t begin, int64_t numel) const { return part(begin, numel).shares_model_copy; }
  // Views of the master values and of state slot `slot` over [begin, begin + numel); a range of
  // an NVMe part only while resident.
  at::Tensor master(int64_t begin, int64_t numel) const;
  at::Tensor state(size_t slot, int64_t begin, int64_t numel);
  // The whole owned range's master values, copied into one fp32 CPU tensor (for tests).
  at::Tensor master_values();
  // The values of state slot `slot` (-1: the master) over [begin, begin + numel), as a new
  // tensor; or `values` written there. Where the part is in memory (or resident) through its
  // views; an NVMe part's through the sub-groups the range meets, and only those (one tensor's
  // safe_get/set reads and writes its own sub-group, not the rank's whole state).
  at::Tensor read_values(int64_t slot, int64_t begin, int64_t numel);
  void write_values(int64_t slot, int64_t begin, int64_t numel, const at::Tensor& values);
  // NVMe parts: their master and state read into host tensors (accounted as host memory), for
  // checkpoints, which read and write all of it. Counted: each make_resident() has one end_resident(); the last end
  // writes them back if any of them `written`, and frees them. No-ops without an NVMe part. A
  // make_resident whose read fails raises with the shard as it was (not resident).
  void make_resident();
  void end_resident(bool written);
  bool resident() const { return resident_ > 0; }
  bool swapped_anywhere() const;
  SwappedPart* swapped(int64_t begin, int64_t numel) const { return part(begin, numel).swapped.get(); }
  double state_init() const { return state_init_; }
  // The state, created (and accounted) on first use, that is at the first optimizer step, as
  // torch.optim does: until then the caller's original parameter tensors are usually still
  // alive, and creating the state with them would raise the set-up peak above the steady state.
  void create_state();
  bool has_state() const { return has_state_; }
  // Back to before the first step (a checkpoint saved before its first step was loaded): the
  // state is freed and the next step creates it again.
  void drop_state();
  // -1 for "fp32_param", else the state slot of torch.optim's name `what`; a ConfigError that
  // lists the row's names for any other.
  int64_t slot(const std::string& what) const;

 private:
  ShardPart& part_mut(int64_t begin, int64_t numel);
  MemoryCategory category(const ShardPart& p, MemoryCategory device_category) const;
  void add_state(ShardPart& p);
  // For each sub-group of an NVMe part that [begin, begin + numel) meets: its master and state
  // read into host tensors, `visit(sub-group, master, state)`, then written back if `write`.
  void through_sub_groups(const ShardPart& p, int64_t begin, int64_t numel, bool write,
                          const std::function<void(const SubGroup&, at::Tensor&, std::vector<at::Tensor>&)>& visit);
  void free_resident(ShardPart& p);

  std::vector<ShardPart> parts_;
  std::vector<SubGroup> sub_groups_;
  int64_t numel_ = 0;
  const OptimizerRow& row_;
  double state_init_;
  bool has_state_ = false;
  int64_t resident_ = 0;
  bool resident_written_ = false;
  MemoryAccount& memory_;
};

// Tensor i of `storage` takes `full` (its whole value, fp32): the model copy, and the owned
// piece of `shard`'s master when it has one of its own. The one way values enter a group.
void write_tensor_values(FlatGroup& storage, OptimizerShard* shard, int64_t i, const at::Tensor& full);

// The owned pieces' starts of `storage`'s tensors, ascending (what plan_sub_groups splits at).
std::vector<int64_t> owned_piece_begins(const FlatGroup& storage);

// Group `storage`'s shard over `sub_groups`. A device part's master is the model copy's owned
// slice when the model is fp32, else a new fp32 tensor; a host part's is allocated by `pool`; an
// NVMe part's file is `swap_name` in `swap` (which is then not null), its file not yet allocated.
// New masters are seeded from the caller's fp32 `values` (one per tensor: whole, or this rank's
// chunk where `prechunked` gives a full shape), not from the rounded 16-bit copy.
std::unique_ptr<OptimizerShard> make_shard(const FlatGroup& storage, const std::vector<at::Tensor>& values,
                                           const std::vector<ChunkedShape>& prechunked,
                                           const OptimizerConfig& config, std::vector<SubGroup> sub_groups,
                                           const HostPool& pool, MemoryAccount& memory,
                                           SwapSpace* swap = nullptr, const std::string& swap_name = {});

}  // namespace zeroshard
