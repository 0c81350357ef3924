// ZeRO-3 parameter lifecycle: every rank stores only its chunks of each parameter (FlatGroup in
// partitioned mode); a module's parameters are all-gathered just before it runs and released after,
// in forward and again in backward. Parameters under stage3_param_persistence_threshold elements
// stay whole on every rank. The Python engine's module hooks call fetch/release; gradient hooks
// report grad_done so a module gathered for backward is released once its gradients exist.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "runtime/comm.h"
#include "runtime/memory.h"
#include "zero/flat_group.h"

namespace zeroshard {

class ParamCoordinator {
 public:
  ParamCoordinator(std::vector<FlatGroup*> groups, std::shared_ptr<Comm> comm,
                   int64_t persistence_threshold, MemoryAccount& memory);
  ~ParamCoordinator();
  ParamCoordinator(const ParamCoordinator&) = delete;
  ParamCoordinator& operator=(const ParamCoordinator&) = delete;

  // The model's trainable Parameters in global index order (groups in order). Persistent ones
  // get their full values; the rest are released (their storage becomes empty).
  void attach(const std::vector<at::Tensor>& params);
  void register_module(int64_t module_id, const std::vector<int64_t>& param_indices);
  // Gathers the module's parameters that are not already available (one all-gather per group).
  void fetch(int64_t module_id, bool for_backward);
  void release(int64_t module_id);
  void grad_done(int64_t param_index);
  // GatheredParameters: the same refcounted gather and release for a list of parameters, and
  // taking a gathered parameter's (edited) full values back into this rank's chunks.
  void fetch_params(const std::vector<int64_t>& param_indices);
  void release_params(const std::vector<int64_t>& param_indices);
  void write_back(int64_t param_index);
  // End of backward: releases everything gathered that is not persistent.
  void release_all();
  // After a step: persistent parameters take their updated values from every rank's chunks.
  void refresh_persistent();
  int64_t live_gathered_bytes() const;

 private:
  struct Param {
    int64_t group = 0, index = 0;   // position in its FlatGroup
    at::Tensor tensor;              // the module's Parameter (its storage is swapped)
    int64_t refs = 0;
    bool persistent = false;
    bool gathered = false;
    bool grad_done = false;
    std::vector<int64_t> modules;
  };
  struct Module {
    std::vector<int64_t> params;
    int64_t backward_fetches = 0;
  };
  void gather(std::vector<int64_t> params);
  void drop(Param& p);
  void check_module(int64_t module_id) const;

  std::vector<FlatGroup*> groups_;
  std::shared_ptr<Comm> comm_;
  int64_t persistence_threshold_;
  MemoryAccount& memory_;
  std::vector<Param> params_;
  std::vector<Module> modules_;
};

}  // namespace zeroshard
