// ZeRO-3 parameter gathering and release; see param_coordinator.h.
#include "zero/param_coordinator.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <map>

#include "runtime/error.h"

namespace zeroshard {

ParamCoordinator::ParamCoordinator(std::vector<FlatGroup*> groups, std::shared_ptr<Comm> comm,
                                   int64_t persistence_threshold, MemoryAccount& memory)
    : groups_(std::move(groups)), comm_(std::move(comm)),
      persistence_threshold_(persistence_threshold), memory_(memory) {
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (int64_t i = 0; i < groups_[g]->num_tensors(); ++i) {
      Param p;
      p.group = int64_t(g);
      p.index = i;
      p.persistent = groups_[g]->chunk_layout().numels[size_t(i)] < persistence_threshold_;
      params_.push_back(std::move(p));
    }
  }
}

ParamCoordinator::~ParamCoordinator() {
  for (auto& p : params_) {
    if (p.gathered) {
      const int64_t bytes = p.tensor.defined() ? int64_t(p.tensor.nbytes()) : 0;
      memory_.release(p.persistent ? MemoryCategory::parameters : MemoryCategory::gathered_parameters,
                      bytes);
    }
  }
}

void ParamCoordinator::attach(const std::vector<at::Tensor>& params) {
  ZS_CHECK(params.size() == params_.size(), "ParamCoordinator::attach: got ", params.size(),
           " parameters, expected ", params_.size());
  for (size_t i = 0; i < params.size(); ++i) params_[i].tensor = params[i];
  std::vector<int64_t> persistent;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].persistent) {
      persistent.push_back(int64_t(i));
    } else {
      params_[i].gathered = true;  // holds the caller's full values until released here
      memory_.add(MemoryCategory::gathered_parameters, int64_t(params_[i].tensor.nbytes()));
      drop(params_[i]);
    }
  }
  gather(persistent);
}

void ParamCoordinator::register_module(int64_t module_id, const std::vector<int64_t>& param_indices) {
  ZS_CHECK(module_id >= 0, "ParamCoordinator::register_module: negative module id");
  if (size_t(module_id) >= modules_.size()) modules_.resize(size_t(module_id) + 1);
  for (int64_t p : param_indices) {
    ZS_CHECK(p >= 0 && size_t(p) < params_.size(), "ParamCoordinator::register_module: parameter ",
             p, " is outside 0..", params_.size() - 1);
    modules_[size_t(module_id)].params.push_back(p);
    params_[size_t(p)].modules.push_back(module_id);
  }
}

void ParamCoordinator::check_module(int64_t module_id) const {
  ZS_CHECK(module_id >= 0 && size_t(module_id) < modules_.size(), "ParamCoordinator: module id ",
           module_id, " was never registered");
}

void ParamCoordinator::fetch(int64_t module_id, bool for_backward) {
  check_module(module_id);
  Module& m = modules_[size_t(module_id)];
  std::vector<int64_t> missing;
  for (int64_t i : m.params) {
    Param& p = params_[size_t(i)];
    if (!p.gathered && std::find(missing.begin(), missing.end(), i) == missing.end()) missing.push_back(i);
    ++p.refs;
  }
  gather(missing);
  if (for_backward) ++m.backward_fetches;
}

void ParamCoordinator::release(int64_t module_id) {
  check_module(module_id);
  for (int64_t i : modules_[size_t(module_id)].params) {
    Param& p = params_[size_t(i)];
    if (p.refs > 0 && --p.refs == 0 && !p.persistent) drop(p);
  }
}

void ParamCoordinator::fetch_params(const std::vector<int64_t>& indices) {
  std::vector<int64_t> missing;
  for (int64_t i : indices) {
    Param& p = params_.at(size_t(i));
    if (!p.gathered && std::find(missing.begin(), missing.end(), i) == missing.end()) missing.push_back(i);
    ++p.refs;
  }
  gather(missing);
}

void ParamCoordinator::release_params(const std::vector<int64_t>& indices) {
  for (int64_t i : indices) {
    Param& p = params_.at(size_t(i));
    if (p.refs > 0 && --p.refs == 0 && !p.persistent) drop(p);
  }
}

void ParamCoordinator::write_back(int64_t param_index) {
  Param& p = params_.at(size_t(param_index));
  ZS_CHECK(p.gathered, "write_back: parameter ", param_index, " is not gathered");
  groups_[size_t(p.group)]->write_chunk(p.index, p.tensor, comm_->rank());
}

void ParamCoordinator::grad_done(int64_t param_index) {
  Param& done = params_.at(size_t(param_index));
  done.grad_done = true;
  // A module gathered for backward is released once all its parameters have their gradients:
  // autograd accumulates a parameter's gradient only after every use of it ran backward.
  for (int64_t mid : done.modules) {
    Module& m = modules_[size_t(mid)];
    if (m.backward_fetches == 0) continue;
    const bool all = std::all_of(m.params.begin(), m.params.end(),
                                 [&](int64_t i) { return params_[size_t(i)].grad_done; });
    if (!all) continue;
    for (; m.backward_fetches > 0; --m.backward_fetches) release(mid);
  }
}

void ParamCoordinator::release_all() {
  for (auto& m : modules_) m.backward_fetches = 0;
  for (auto& p : params_) {
    p.refs = 0;
    p.grad_done = false;
    if (p.gathered && !p.persistent) drop(p);
  }
}

void ParamCoordinator::refresh_persistent() {
  std::vector<int64_t> persistent;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].persistent) {
      persistent.push_back(int64_t(i));
      if (params_[i].gathered) drop(params_[i]);
    }
  }
  gather(persistent);
}

int64_t ParamCoordinator::live_gathered_bytes() const {
  return memory_.bytes(MemoryCategory::gathered_parameters);
}

void ParamCoordinator::drop(Param& p) {
  const int64_t bytes = int64_t(p.tensor.nbytes());
  memory_.release(p.persistent ? MemoryCategory::parameters : MemoryCategory::gathered_parameters,
                  bytes);
  // An empty storage in place of the full values; autograd's saved references keep whatever
  // they still need alive until backward has used it.
  p.tensor.set_data(at::empty({0}, p.tensor.options()));
  p.gathered = false;
}

void ParamCoordinator::gather(std::vector<int64_t> indices) {
  if (indices.empty()) return;
  // One all-gather per group: every rank sends its chunks of these parameters back to back.
  std::map<int64_t, std::vector<int64_t>> by_group;
  for (int64_t i : indices) by_group[params_[size_t(i)].group].push_back(i);
  const int64_t world = comm_->world_size();
  for (auto& [g, members] : by_group) {
    FlatGroup& group = *groups_[size_t(g)];
    const ChunkLayout& L = group.chunk_layout();
    std::vector<at::Tensor> mine;
    std::vector<int64_t> offset_in_send;
    int64_t send_numel = 0;
    for (int64_t i : members) {
      const int64_t t = params_[size_t(i)].index;
      mine.push_back(group.params().narrow(0, L.local_offsets[size_t(t)], L.chunks[size_t(t)]));
      offset_in_send.push_back(send_numel);
      send_numel += L.chunks[size_t(t)];
    }
    at::Tensor send = mine.size() == 1 ? mine[0].contiguous() : at::cat(mine);
    at::Tensor recv = at::empty({send_numel * world}, send.options());
    // Waited here: the module about to run reads these parameters.
    comm_->all_gather(recv, send, detail::cat("parameters of ", members.size(), " tensors")).wait();
    for (size_t k = 0; k < members.size(); ++k) {
      Param& p = params_[size_t(members[k])];
      const int64_t t = p.index;
      at::Tensor full = at::empty({L.numels[size_t(t)]}, send.options());
      for (int64_t r = 0; r < world; ++r) {
        const int64_t held = L.held_numel(t, r);
        if (held > 0) {
          full.narrow(0, r * L.chunks[size_t(t)], held)
              .copy_(recv.narrow(0, r * send_numel + offset_in_send[k], held));
        }
      }
      p.tensor.set_data(full.view(group.shape(t)));
      p.gathered = true;
      memory_.add(p.persistent ? MemoryCategory::parameters : MemoryCategory::gathered_parameters,
                  int64_t(full.nbytes()));
    }
  }
}

}  // namespace zeroshard
