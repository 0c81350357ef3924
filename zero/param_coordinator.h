// ZeRO-3 parameter lifecycle: every rank stores only its chunks of each parameter (FlatGroup in
// partitioned mode); a module's parameters are all-gathered just before it runs and released after,
// in forward and again in backward. Parameters under stage3_param_persistence_threshold elements
// stay whole on every rank. The Python engine's module hooks call fetch/release; gradient hooks
// report grad_done so a module gathered for backward is released once its gradients exist.
// Frozen parameters (a group that is not trainable) are partitioned and gathered the same way,
// but no gradient says when backward is done with them: a module's input gradients do not cover a
// weight applied to anything else, and reference counts see neither tensors saved through Python
// objects nor agree across ranks (a backend's thread may still hold a buffer). The engine instead
// reports when every autograd node one forward of the module created has run in this backward
// (backward_nodes_done); it can do so only when each of those nodes is reachable from the
// module's outputs. A module gathered for backward that holds frozen parameters is released once
// that report came for each of its backward gathers (and its trainable gradients exist); without
// it, it is held until backward ends, the same point on every rank. One whose forward runs again
// during backward (activation checkpointing's recomputation) is held too when that forward ends:
// the tensors it saves are read by nodes that run after it. Reentrant checkpointing runs a
// backward over the recomputed graph, whose report then covers the hold. Non-reentrant
// checkpointing reads them from the first forward's nodes, so the report of that forward covers
// the hold, when it is the module's only forward of the iteration (otherwise nothing says which
// forward a recomputation repeats, and the hold lasts until backward ends).
//
// From the second iteration on, the recorded fetch order (FetchTrace) drives three policies:
// prefetch (async all-gathers of the next modules' parameters; at most stage3_prefetch_bucket_size
// elements prefetched and not yet fetched by their module at any time), reuse (a released
// parameter used again within stage3_max_reuse_distance elements stays gathered), and the cap
// (prefetched and kept parameters never push the gathered total over stage3_max_live_parameters;
// only a module that needs more than that alone exceeds it).
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "runtime/comm.h"
#include "runtime/config/config.h"
#include "runtime/memory.h"
#include "zero/fetch_trace.h"
#include "zero/flat_group.h"

namespace zeroshard {

class ParamCoordinator {
 public:
  // Writes a parameter's full value (global index) into its group's storage and wherever else it
  // is kept (the optimizer shard's master); null: the storage only.
  using WriteValues = std::function<void(int64_t param_index, const at::Tensor& full)>;
  ParamCoordinator(std::vector<FlatGroup*> groups, std::shared_ptr<Comm> comm,
                   const ZeroConfig& config, MemoryAccount& memory, WriteValues write_values = nullptr);
  ~ParamCoordinator();
  ParamCoordinator(const ParamCoordinator&) = delete;
  ParamCoordinator& operator=(const ParamCoordinator&) = delete;

  // The model's trainable Parameters in global index order (groups in order). Persistent ones
  // get their full values; the rest are released (their storage becomes empty).
  void attach(const std::vector<at::Tensor>& params);
  void register_module(int64_t module_id, const std::vector<int64_t>& param_indices);
  // Gathers the module's parameters that are not already available, then prefetches ahead.
  void fetch(int64_t module_id, bool for_backward);
  // The end of a module's forward. One that runs during backward (activation checkpointing's
  // recomputation) and holds frozen parameters is not released but held as a backward gather
  // (see above); returns whether it was.
  bool release(int64_t module_id, bool during_backward = false);
  void grad_done(int64_t param_index);
  // Every autograd node that one forward of the module created has run in this backward, which
  // gathered the module for it: its frozen parameters are no longer read (see above). `gathers`
  // is 2 for a recomputation's forward, whose release was a hold (release returned true), 1 for
  // a forward outside backward.
  void backward_nodes_done(int64_t module_id, int64_t gathers = 1);
  // Whether the module holds partitioned frozen parameters (only those need the report above).
  bool holds_frozen(int64_t module_id) const;
  // Parameters used outside their own module's forward (DeepSpeed gathers them the same way).
  // A read of a parameter in module_id's forward, which is under way (module_id -1: a module not
  // registered yet): nothing happens when it is whole and some module whose forward is running
  // holds it (its own module, an enclosing one), or it is persistent; otherwise module_id takes
  // it as an external parameter, gathered now and from then on with module_id, in forward and
  // backward. Returns the id of a module that joined the coordinator or took the parameter, -1
  // when none did.
  int64_t read_in_forward(int64_t module_id, int64_t param_index);
  // register_external_parameter outside the module's forward: gathered with it from its next
  // forward. Returns the module's id (a new one for -1) when the parameter joined it, else -1.
  int64_t add_external(int64_t module_id, int64_t param_index);
  // GatheredParameters: the same refcounted gather and release for a list of parameters, and
  // taking a gathered parameter's (edited) full values back into this rank's chunks; with a
  // modifier_rank (>= 0), that rank's values, broadcast, are what every rank keeps.
  void fetch_params(const std::vector<int64_t>& param_indices);
  void release_params(const std::vector<int64_t>& param_indices);
  void write_back(int64_t param_index, int modifier_rank = -1);
  // safe_set_full_fp32_param: `full` (fp32, the same on every rank) becomes the parameter's value
  // in this rank's chunk and master copy, and in its gathered tensor where it is gathered now.
  void overwrite(int64_t param_index, const at::Tensor& full);
  // The root module's forward starts and ends. A forward without autograd (evaluation under
  // torch.no_grad, generation) has no backward to end its iteration and does not run in the
  // training order, so it follows a trace of its own and ends at end_forward, which releases
  // what it gathered. A training forward ends with its backward (release_all).
  void begin_forward(bool grad_enabled);
  void end_forward();
  // End of backward: finishes prefetches, releases everything not persistent, closes the trace.
  void release_all();
  // The same after a backward that raised, except that the unfinished iteration's order is not
  // taken as the model's (FetchTrace::abandon_iteration).
  void abandon_iteration();
  // After a forward that raised: releases the modules whose forward began and did not end (a
  // GatheredParameters block around it keeps its parameters) and abandons the iteration's order.
  void abandon_forward();
  // After a step: persistent parameters take their updated values from every rank's chunks.
  void refresh_persistent();
  int64_t live_gathered_numel() const { return live_numel_; }
  // Highest live_gathered_numel since the last reset, and how many parameters were prefetched.
  int64_t peak_gathered_numel() const { return peak_live_numel_; }
  void reset_peak() { peak_live_numel_ = live_numel_; }
  int64_t prefetched_params() const { return prefetched_params_; }
  int64_t trace_invalidations() const {
    return train_trace_.invalidations() + eval_trace_.invalidations();
  }

 private:
  // A parameter's full value into its storage (write_values_, or the group alone).
  void write(int64_t param_index, const at::Tensor& full);
  // Finishes prefetches and releases everything not persistent (release_all, abandon_iteration).
  void release_gathered();
  // Finishes prefetches and drops what nothing references (end_forward, abandon_forward).
  void drop_unreferenced();
  // Adds the parameter to the module's (-1: a new module, given the next id), which it returns. A
  // module new to the coordinator joins the fetch order, which is then recorded again (running:
  // the iteration under way is dropped too).
  int64_t join(int64_t module_id, int64_t param_index, bool running);
  bool member(int64_t module_id, int64_t param_index) const;
  struct Param {
    int64_t group = 0, index = 0;   // position in its FlatGroup
    int64_t numel = 0;
    at::Tensor tensor;              // the module's Parameter (its storage is swapped)
    // The gathered values' storage, kept across releases with its memory freed (0 bytes) while
    // released, as FSDP2 does: autograd's saved views of a parameter (linear saves weight.t())
    // then see the values gathered again for backward instead of pinning forward's copy.
    c10::Storage storage;
    int64_t refs = 0;
    bool persistent = false;
    bool frozen = false;            // no gradient: grad_done never comes
    bool gathered = false;
    int64_t in_flight = -1;         // id of the async gather bringing it, or -1
    bool prefetched = false;        // gathered ahead by prefetch(), its module not yet fetched
    bool grad_done = false;
    std::vector<int64_t> modules;
  };
  struct Module {
    std::vector<int64_t> params;
    int64_t numel = 0;
    int64_t backward_fetches = 0;
    int64_t backward_nodes_done = 0;  // of those gathers, how many backward_nodes_done covered
    int64_t recompute_holds = 0;    // of those gathers, recomputations' holds not yet covered
    // Its forwards ended outside backward since release_gathered (counted for every module,
    // read only for those holding frozen parameters).
    int64_t training_forwards = 0;
    int64_t forward_fetches = 0;    // forwards of it begun and not ended
    bool holds_frozen = false;      // frozen parameters that are not persistent
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
  };
  void gather(const std::vector<int64_t>& params);
  int64_t start_gather(int64_t group, const std::vector<int64_t>& members);
  void complete_gather(int64_t id);
  void prefetch();
  void make_room(int64_t numel);
  bool reused_soon(int64_t param) const;
  void unused(Param& p);
  // Releases the module's backward gathers once its backward has no more use for them.
  void maybe_release_after_backward(int64_t module_id);
  void drop(Param& p);
  // Where a gathered (or in-flight) parameter's bytes are accounted, and how many.
  static MemoryCategory category(const Param& p);
  int64_t gathered_bytes(const Param& p) const;
  // p's gathered storage, (re)allocated to hold numel elements, as a flat tensor.
  at::Tensor gathered_buffer(Param& p, int64_t numel, const at::TensorOptions& options);
  void check_module(int64_t module_id) const;

  std::vector<FlatGroup*> groups_;
  WriteValues write_values_;
  std::shared_ptr<Comm> comm_;
  int64_t persistence_threshold_, prefetch_numel_, max_live_numel_, reuse_distance_numel_;
  MemoryAccount& memory_;
  std::vector<Param> params_;
  std::vector<Module> modules_;
  FetchTrace& trace() { return inference_ ? eval_trace_ : train_trace_; }
  const FetchTrace& trace() const { return inference_ ? eval_trace_ : train_trace_; }
  FetchTrace train_trace_, eval_trace_;
  bool inference_ = false;  // between begin_forward(false) and end_forward
  std::map<int64_t, Gather> gathers_;
  int64_t next_gather_id_ = 0;
  int64_t live_numel_ = 0;          // gathered or in flight, persistent parameters excluded
  int64_t peak_live_numel_ = 0;
  int64_t prefetched_params_ = 0;
  int64_t prefetched_ahead_numel_ = 0;  // of those marked prefetched: what the bucket bounds
};

}  // namespace zeroshard
