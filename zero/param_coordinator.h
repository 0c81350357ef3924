// ZeRO-3 parameter schedule by module: a module's parameters are gathered (ParamGatherer, which
// this owns) just before it runs and released after, in forward and again in backward. The
// Python engine's module hooks call fetch/release; gradient hooks report grad_done so a module
// gathered for backward is released once its gradients exist.
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
// only a module that needs more than that alone exceeds it). The gatherer applies the cap and
// asks this whether a parameter is reused soon; this chooses what to prefetch. With parameters
// on NVMe, the chunks of the parameters the order needs after those are read ahead from disk
// (as many as offload_param.buffer_count staging buffers take).
#pragma once
#include <memory>
#include <vector>

#include "runtime/comm.h"
#include "runtime/config/config.h"
#include "runtime/memory.h"
#include "zero/fetch_trace.h"
#include "zero/flat_group.h"
#include "zero/param_gatherer.h"

namespace zeroshard {

class ParamCoordinator {
 public:
  // The gatherer's groups, communicator, memory account, shards and parameter swap (see
  // ParamGatherer).
  ParamCoordinator(std::vector<FlatGroup*> groups, std::shared_ptr<Comm> comm,
                   const ZeroConfig& config, MemoryAccount& memory,
                   std::vector<OptimizerShard*> shards = {}, ParamSwap* swap = nullptr);
  ParamCoordinator(const ParamCoordinator&) = delete;
  ParamCoordinator& operator=(const ParamCoordinator&) = delete;

  // The parameters' gather state: attach, GatheredParameters, write-back, counters.
  ParamGatherer& gatherer() { return gatherer_; }
  const ParamGatherer& gatherer() const { return gatherer_; }

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
  int64_t trace_invalidations() const {
    return train_trace_.invalidations() + eval_trace_.invalidations();
  }
  // Finishes prefetches, releases everything not persistent and resets every module's and
  // parameter's backward state (release_all, abandon_iteration); alone, between iterations (a
  // checkpoint load), it leaves the recorded order as it is.
  void release_gathered();

 private:
  // Adds the parameter to the module's (-1: a new module, given the next id), which it returns. A
  // module new to the coordinator joins the fetch order, which is then recorded again (running:
  // the iteration under way is dropped too).
  int64_t join(int64_t module_id, int64_t param_index, bool running);
  bool member(int64_t module_id, int64_t param_index) const;
  // What the gatherer asks before releasing a parameter nothing references: whether the trace
  // uses it again within stage3_max_reuse_distance elements.
  bool reused_soon(int64_t param) const;
  void prefetch();
  // Releases the module's backward gathers once its backward has no more use for them.
  void maybe_release_after_backward(int64_t module_id);
  void check_module(int64_t module_id) const;

  // A parameter's place in the schedule (its gather state is the gatherer's).
  struct ParamUse {
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

  // Built first and destroyed last: its reuse rule calls back into this object.
  ParamGatherer gatherer_;
  int rank_;  // for warnings
  int64_t prefetch_numel_, reuse_distance_numel_;
  std::vector<ParamUse> uses_;  // by parameter index
  std::vector<Module> modules_;
  FetchTrace& trace() { return inference_ ? eval_trace_ : train_trace_; }
  const FetchTrace& trace() const { return inference_ ? eval_trace_ : train_trace_; }
  FetchTrace train_trace_, eval_trace_;
  bool inference_ = false;  // between begin_forward(false) and end_forward
};

}  // namespace zeroshard
