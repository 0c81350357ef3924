// ZeRO-3 parameter storage, one parameter at a time: every rank stores only its chunks of each
// parameter (FlatGroup in partitioned mode); this gathers parameters whole (all-gathers of the
// chunks into each one's own storage), counts the references to them, releases them when none
// is left, and writes edited full values back into the chunks. Parameters under
// stage3_param_persistence_threshold elements stay whole on every rank. Which parameters to
// gather when (modules, the fetch order, prefetch) is ParamCoordinator's (param_coordinator.h),
// which owns this; GatheredParameters calls it directly.
//
// stage3_max_live_parameters caps what is gathered or in flight (persistent parameters aside):
// a parameter that nothing references any longer stays gathered only when the owner's reuse rule
// says it is used again soon and the cap allows it, and such kept parameters are released first
// when a gather would cross the cap. Only what is referenced at once may exceed it.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "runtime/comm.h"
#include "runtime/config/config.h"
#include "runtime/copy_stream.h"
#include "runtime/memory.h"
#include "zero/flat_group.h"
#include "zero/optimizer_shard.h"
#include "zero/param_swap.h"

namespace zeroshard {

// What a parameter is, fixed when the gatherer is built.
struct ParamInfo {
  int64_t numel = 0;
  bool persistent = false;  // under stage3_param_persistence_threshold: whole on every rank
  bool frozen = false;      // in a group that is not trainable: no gradient ever comes
};

// How much is gathered. Live counts gathered and in-flight parameters, persistent ones excluded.
struct GatherCounters {
  int64_t live_numel = 0;
  int64_t peak_live_numel = 0;         // highest live_numel since the last reset_peak
  int64_t prefetched_params = 0;       // parameters ever gathered ahead by prefetch()
  int64_t prefetched_ahead_numel = 0;  // prefetched and not yet fetched: what the bucket bounds
};

class ParamGatherer {
 public:
  // Whether a parameter that nothing references any longer is used again soon (ParamCoordinator's
  // reading of the fetch order); null: never.
  using ReusedSoon = std::function<bool(int64_t param_index)>;
  // `groups`' tensors, group by group, are the parameters' global indices. `shards`: each group's
  // optimizer shard (null for a frozen group; empty for none), whose master takes written values.
  // `swap` (offload_param.device "nvme"; outlives this, else null) brings the chunks of groups on
  // NVMe into host memory for each gather and write.
  ParamGatherer(std::vector<FlatGroup*> groups, std::shared_ptr<Comm> comm, const ZeroConfig& config,
                MemoryAccount& memory, std::vector<OptimizerShard*> shards = {},
                ReusedSoon reused_soon = nullptr, ParamSwap* swap = nullptr);
  ~ParamGatherer();
  ParamGatherer(const ParamGatherer&) = delete;
  ParamGatherer& operator=(const ParamGatherer&) = delete;

  int64_t num_params() const { return int64_t(params_.size()); }
  const ParamInfo& param(int64_t param_index) const { return params_.at(size_t(param_index)); }
  // Whether the parameter is whole or about to be: persistent, gathered, or its gather in flight.
  bool whole(int64_t param_index) const;

  // The model's Parameters in global index order (groups in order). Persistent ones get their
  // full values; the rest are released (their storage becomes empty).
  void attach(const std::vector<at::Tensor>& params);
  // One reference more to each parameter (a parameter listed twice takes two), gathering those
  // not yet whole; a prefetched one is only waited for. Kept parameters make room under the cap.
  void fetch_params(const std::vector<int64_t>& param_indices);
  // One reference less to each; one left with none is released, or kept (see above).
  void release_params(const std::vector<int64_t>& param_indices);
  // Starts async gathers of parameters that are not whole (one per group), without a reference:
  // the fetch_params that follows waits for them. The caller keeps them within the cap.
  void prefetch(const std::vector<int64_t>& param_indices);
  // End of an iteration: finishes the gathers in flight (collectives every rank issued), forgets
  // every reference and releases everything not persistent.
  void release_all();
  // The same, except that what something still references stays (a GatheredParameters block).
  void release_unreferenced();
  // stage3_max_live_parameters less what is live now (negative once a module alone exceeds it).
  int64_t room_numel() const { return max_live_numel_ - counters_.live_numel; }

  // GatheredParameters: a gathered parameter's (edited) full values become this rank's chunk;
  // with a modifier_rank (>= 0), that rank's values, broadcast, are what every rank keeps.
  void write_back(int64_t param_index, int modifier_rank = -1);
  // safe_set_full_fp32_param: `full` (fp32, the same on every rank) becomes the parameter's value
  // in this rank's chunk and master copy, and in its gathered tensor where it is gathered now.
  void overwrite(int64_t param_index, const at::Tensor& full);
  // After a step: persistent parameters take their updated values from every rank's chunks
  // (frozen ones too with include_frozen: after a checkpoint load rewrote every chunk).
  void refresh_persistent(bool include_frozen = false);

  // Parameters on NVMe: starts reading these parameters' chunks ahead of their gathers (the
  // coordinator's fetch order); a no-op for the rest.
  void read_ahead(const std::vector<int64_t>& param_indices);
  bool reads_from_disk() const { return swap_ != nullptr; }
  // Runs `fn` while the parameter's chunk is in host memory (a read of it outside a gather).
  void with_chunk(int64_t param_index, const std::function<void()>& fn);

  const GatherCounters& counters() const { return counters_; }
  void reset_peak() { counters_.peak_live_numel = counters_.live_numel; }

 private:
  struct Param : ParamInfo {
    int64_t group = 0, index = 0;   // position in its FlatGroup
    at::Tensor tensor;              // the module's Parameter (its storage is swapped)
    // The gathered values' storage, kept across releases with its memory freed (0 bytes) while
    // released, as FSDP2 does: autograd's saved views of a parameter (linear saves weight.t())
    // then see the values gathered again for backward instead of pinning forward's copy.
    c10::Storage storage;
    int64_t refs = 0;
    bool gathered = false;
    int64_t in_flight = -1;         // id of the async gather bringing it, or -1
    bool prefetched = false;        // gathered ahead by prefetch(), not yet fetched
  };
  // One async gather of several parameters of one group. A large parameter is all-gathered
  // straight into its own padded full tensor (no staging copy, so a gather never needs more than
  // the gathered bytes); the small ones share one all-gather through a staging buffer.
  struct Gather {
    int64_t group = 0;
    std::vector<int64_t> members;
    std::vector<int64_t> batched;   // members that share the staging all-gather
    std::vector<int64_t> offsets;   // of each batched member's chunk in the send buffer
    int64_t send_numel = 0;
    at::Tensor send, recv;
    CommWork work;                  // the staging all-gather (pending only when batched is not empty)
    std::vector<std::pair<int64_t, at::Tensor>> direct;  // (member, its padded full tensor)
    std::vector<CommWork> direct_works;
    std::vector<at::Tensor> staged;  // chunks copied up from host memory (offload_param)
    int64_t staged_bytes = 0;
  };
  // All-gathers `in` (this rank's chunks) into `out`. Chunks in host memory (offload_param) are
  // first copied up, and copy and collective run on the copy stream.
  CommWork all_gather(const FlatGroup& group, Gather& x, at::Tensor out, const at::Tensor& in,
                      const std::string& what);
  // Runs `fn` while p's chunk is in host memory (parameters on NVMe); `written`: fn changes it.
  void in_host(const Param& p, bool written, const std::function<void()>& fn);
  // A parameter's full value into its group's storage and shard (write_tensor_values).
  void write(int64_t param_index, const at::Tensor& full);
  void gather(const std::vector<int64_t>& params);
  int64_t start_gather(int64_t group, const std::vector<int64_t>& members);
  void complete_gather(int64_t id);
  void complete_all_gathers();
  void make_room(int64_t numel);
  void unused(Param& p);
  void drop(Param& p);
  // Where a gathered (or in-flight) parameter's bytes are accounted, and how many.
  static MemoryCategory category(const Param& p);
  int64_t gathered_bytes(const Param& p) const;
  // p's gathered storage, (re)allocated to hold numel elements, as a flat tensor.
  at::Tensor gathered_buffer(Param& p, int64_t numel, const at::TensorOptions& options);

  std::vector<FlatGroup*> groups_;
  std::shared_ptr<Comm> comm_;
  std::vector<OptimizerShard*> shards_;
  ReusedSoon reused_soon_;
  int64_t max_live_numel_;
  MemoryAccount& memory_;
  std::vector<Param> params_;
  std::map<int64_t, Gather> gathers_;
  int64_t next_gather_id_ = 0;
  GatherCounters counters_;
  std::unique_ptr<CopyStream> up_;  // offload_param: where chunks come up from host memory
  ParamSwap* swap_;                 // offload_param.device "nvme"
};

}  // namespace zeroshard
