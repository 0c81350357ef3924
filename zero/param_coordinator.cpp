// ZeRO-3 parameter gathering, prefetch and release; see param_coordinator.h.
#include "zero/param_coordinator.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "runtime/error.h"
#include "runtime/log.h"

namespace zeroshard {
namespace {
// Parameters of at least this many elements (4 MB in fp32) get an all-gather of their own, straight
// into their full tensor; smaller ones are batched, as one collective each costs a round trip.
constexpr int64_t kDirectGatherNumel = int64_t(1) << 20;
}  // namespace

ParamCoordinator::ParamCoordinator(std::vector<FlatGroup*> groups, std::shared_ptr<Comm> comm,
                                   const ZeroConfig& config, MemoryAccount& memory,
                                   WriteValues write_values)
    : groups_(std::move(groups)), write_values_(std::move(write_values)), comm_(std::move(comm)),
      persistence_threshold_(config.stage3_param_persistence_threshold),
      prefetch_numel_(config.stage3_prefetch_bucket_size),
      max_live_numel_(config.stage3_max_live_parameters),
      reuse_distance_numel_(config.stage3_max_reuse_distance),
      memory_(memory) {
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (int64_t i = 0; i < groups_[g]->num_tensors(); ++i) {
      Param p;
      p.group = int64_t(g);
      p.index = i;
      p.numel = groups_[g]->chunk_layout().numels[size_t(i)];
      p.persistent = p.numel < persistence_threshold_;
      p.frozen = !groups_[g]->trainable();
      params_.push_back(std::move(p));
    }
  }
}

ParamCoordinator::~ParamCoordinator() {
  // A collective in flight must finish before its buffers go.
  auto finish = [](CommWork& work) {
    try {
      work.wait();
    } catch (const std::exception&) {
    }
  };
  for (auto& [id, g] : gathers_) {
    finish(g.work);
    for (auto& w : g.direct_works) finish(w);
  }
  for (auto& p : params_) {
    if (p.gathered || p.in_flight >= 0) memory_.release(category(p), gathered_bytes(p));
  }
}

MemoryCategory ParamCoordinator::category(const Param& p) {
  return p.persistent ? MemoryCategory::parameters : MemoryCategory::gathered_parameters;
}

int64_t ParamCoordinator::gathered_bytes(const Param& p) const {
  return p.numel * int64_t(groups_[size_t(p.group)]->params().element_size());
}

void ParamCoordinator::attach(const std::vector<at::Tensor>& params) {
  ZS_CHECK(params.size() == params_.size(), "ParamCoordinator::attach: got ", params.size(),
           " parameters, expected ", params_.size());
  std::vector<int64_t> persistent;
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = params_[i];
    p.tensor = params[i];
    if (p.persistent) {
      persistent.push_back(int64_t(i));
    } else {
      // Held the caller's full values until now; from here on only the chunks remain.
      p.tensor.set_data(at::empty({0}, p.tensor.options()));
    }
  }
  gather(persistent);
}

void ParamCoordinator::register_module(int64_t module_id, const std::vector<int64_t>& param_indices) {
  ZS_CHECK(module_id >= 0, "ParamCoordinator::register_module: negative module id");
  if (size_t(module_id) >= modules_.size()) modules_.resize(size_t(module_id) + 1);
  Module& m = modules_[size_t(module_id)];
  for (int64_t i : param_indices) {
    ZS_CHECK(i >= 0 && size_t(i) < params_.size(), "ParamCoordinator::register_module: parameter ",
             i, " is outside 0..", params_.size() - 1);
    m.params.push_back(i);
    params_[size_t(i)].modules.push_back(module_id);
    const Param& p = params_[size_t(i)];
    if (p.persistent) continue;
    m.numel += p.numel;
    m.holds_frozen = m.holds_frozen || p.frozen;
  }
}

void ParamCoordinator::check_module(int64_t module_id) const {
  ZS_CHECK(module_id >= 0 && size_t(module_id) < modules_.size(), "ParamCoordinator: module id ",
           module_id, " was never registered");
}

void ParamCoordinator::fetch(int64_t module_id, bool for_backward) {
  check_module(module_id);
  if (!trace().on_fetch(module_id)) {
    warn(detail::cat("rank ", comm_->rank(), ": ZeRO-3 module order changed (module ", module_id,
                     " was not next); prefetching stops and the order is recorded again"));
  }
  Module& m = modules_[size_t(module_id)];
  fetch_params(m.params);
  ++(for_backward ? m.backward_fetches : m.forward_fetches);
  if (for_backward) {
    // A gradient that arrived before this module's backward began came from another autograd
    // pass (reentrant checkpointing's) and says nothing about this one: wait for the next.
    for (int64_t i : m.params) params_[size_t(i)].grad_done = false;
  }
  prefetch();
}

void ParamCoordinator::fetch_params(const std::vector<int64_t>& indices) {
  std::vector<int64_t> missing;
  int64_t need = 0;
  for (int64_t i : indices) {
    Param& p = params_.at(size_t(i));
    if (p.in_flight >= 0) complete_gather(p.in_flight);  // prefetched: only wait for it
    if (p.prefetched) {
      p.prefetched = false;
      prefetched_ahead_numel_ -= p.numel;
    }
    if (!p.gathered && std::find(missing.begin(), missing.end(), i) == missing.end()) {
      missing.push_back(i);
      need += p.numel;
    }
    ++p.refs;
  }
  make_room(need);
  gather(missing);
}

bool ParamCoordinator::release(int64_t module_id, bool during_backward) {
  check_module(module_id);
  Module& m = modules_[size_t(module_id)];
  if (m.forward_fetches > 0) --m.forward_fetches;
  if (during_backward && m.holds_frozen) {
    // A recomputation: kept, as if gathered for backward, until a report covers it (see the
    // header) or backward ends.
    ++m.backward_fetches;
    ++m.recompute_holds;
    return true;
  }
  if (!during_backward && !inference_) ++m.training_forwards;
  release_params(m.params);
  return false;
}

void ParamCoordinator::release_params(const std::vector<int64_t>& indices) {
  for (int64_t i : indices) {
    Param& p = params_.at(size_t(i));
    if (p.refs > 0 && --p.refs == 0) unused(p);
  }
}

void ParamCoordinator::unused(Param& p) {
  if (p.persistent || !p.gathered) return;
  // Kept when the trace says it is needed again soon and the cap allows it.
  if (reused_soon(&p - params_.data()) && live_numel_ <= max_live_numel_) return;
  drop(p);
}

bool ParamCoordinator::reused_soon(int64_t param) const {
  if (trace().mode() != FetchTrace::Mode::follow) return false;
  const auto& order = trace().modules();
  int64_t distance = 0;
  for (size_t k = trace().position(); k < order.size(); ++k) {
    const Module& m = modules_[size_t(order[k])];
    if (std::find(m.params.begin(), m.params.end(), param) != m.params.end()) return true;
    distance += m.numel;
    if (distance > reuse_distance_numel_) return false;
  }
  return false;
}

void ParamCoordinator::make_room(int64_t numel) {
  // Kept-for-reuse parameters (gathered, unreferenced) go first when the cap would be crossed.
  for (auto& p : params_) {
    if (live_numel_ + numel <= max_live_numel_) return;
    if (p.gathered && p.refs == 0 && !p.persistent) drop(p);
  }
}

void ParamCoordinator::prefetch() {
  if (trace().mode() != FetchTrace::Mode::follow || prefetch_numel_ <= 0) return;
  const auto& order = trace().modules();
  std::map<int64_t, std::vector<int64_t>> by_group;
  // The bucket bounds everything prefetched and not yet fetched by its module, not each call's
  // additions: otherwise every fetch starts a bucket more and forward ends with backward's
  // parameters all gathered again.
  int64_t budget = prefetch_numel_ - prefetched_ahead_numel_;
  for (size_t k = trace().position(); k < order.size() && budget > 0; ++k) {
    for (int64_t i : modules_[size_t(order[k])].params) {
      Param& p = params_[size_t(i)];
      if (p.gathered || p.in_flight >= 0 || p.persistent) continue;
      auto& pending = by_group[p.group];
      if (std::find(pending.begin(), pending.end(), i) != pending.end()) continue;
      if (p.numel > budget || live_numel_ + p.numel > max_live_numel_) {
        budget = 0;
        break;
      }
      pending.push_back(i);
      budget -= p.numel;
      live_numel_ += p.numel;  // reserved now, so the cap counts what is in flight
    }
  }
  for (auto& [g, members] : by_group) {
    if (members.empty()) continue;
    for (int64_t i : members) {
      Param& p = params_[size_t(i)];
      live_numel_ -= p.numel;  // start_gather re-adds
      p.prefetched = true;
      prefetched_ahead_numel_ += p.numel;
    }
    start_gather(g, members);
    prefetched_params_ += int64_t(members.size());
  }
}

void ParamCoordinator::grad_done(int64_t param_index) {
  Param& done = params_.at(size_t(param_index));
  done.grad_done = true;
  for (int64_t mid : done.modules) maybe_release_after_backward(mid);
}

void ParamCoordinator::backward_nodes_done(int64_t module_id, int64_t gathers) {
  check_module(module_id);
  Module& m = modules_[size_t(module_id)];
  // Each report follows the fetch of its own forward's _PreBackward in the same backward, so
  // the count of covered gathers never passes backward_fetches. After release_gathered (a
  // backward that raised), a late report finds nothing to release.
  if (m.backward_fetches == 0) return;
  ++m.backward_nodes_done;
  if (gathers == 2 && m.recompute_holds > 0) {
    // A recomputation's forward whose graph backward ran (reentrant checkpointing): its hold.
    --m.recompute_holds;
    ++m.backward_nodes_done;
  } else if (gathers == 1 && m.training_forwards == 1) {
    // The module's only forward: what non-reentrant checkpointing recomputed of it is for the
    // nodes that forward created, which have all run now.
    m.backward_nodes_done += m.recompute_holds;
    m.recompute_holds = 0;
  }
  maybe_release_after_backward(module_id);
}

bool ParamCoordinator::holds_frozen(int64_t module_id) const {
  check_module(module_id);
  return modules_[size_t(module_id)].holds_frozen;
}

int64_t ParamCoordinator::join(int64_t module_id, int64_t param_index, bool running) {
  ZS_CHECK(param_index >= 0 && size_t(param_index) < params_.size(), "ParamCoordinator: parameter ",
           param_index, " is outside 0..", params_.size() - 1);
  const int64_t id = module_id >= 0 ? module_id : int64_t(modules_.size());
  const bool joins = size_t(id) >= modules_.size() || modules_[size_t(id)].params.empty();
  register_module(id, {param_index});
  if (joins) {
    // The recorded orders lack the module; one under way is recorded again from its next iteration.
    train_trace_.restart_recording(running && !inference_);
    eval_trace_.restart_recording(running && inference_);
  }
  return id;
}

bool ParamCoordinator::member(int64_t module_id, int64_t param_index) const {
  if (module_id < 0 || size_t(module_id) >= modules_.size()) return false;
  const auto& ps = modules_[size_t(module_id)].params;
  return std::find(ps.begin(), ps.end(), param_index) != ps.end();
}

int64_t ParamCoordinator::read_in_forward(int64_t module_id, int64_t param_index) {
  const Param& p = params_.at(size_t(param_index));
  const bool whole = p.persistent || p.gathered || p.in_flight >= 0;
  const bool held = std::any_of(p.modules.begin(), p.modules.end(), [&](int64_t m) {
    return modules_[size_t(m)].forward_fetches > 0;
  });
  if (whole && (held || p.persistent)) return -1;
  const bool known = member(module_id, param_index);
  const int64_t id = known ? module_id : join(module_id, param_index, true);
  Module& m = modules_[size_t(id)];
  // A module that joined during its own forward never fetched: count that forward as begun.
  if (m.forward_fetches == 0) m.forward_fetches = 1;
  // One reference per forward of it under way (a module may call itself): each one's end
  // releases the module's parameters once. A member that is not whole was dropped by an inner
  // call's end while an outer one still runs.
  for (int64_t k = 0; k < m.forward_fetches; ++k) fetch_params({param_index});
  return known ? -1 : id;
}

int64_t ParamCoordinator::add_external(int64_t module_id, int64_t param_index) {
  return member(module_id, param_index) ? -1 : join(module_id, param_index, false);
}

void ParamCoordinator::maybe_release_after_backward(int64_t mid) {
  Module& m = modules_[size_t(mid)];
  if (m.backward_fetches == 0) return;
  // Autograd accumulates a trainable parameter's gradient only after every use of it ran
  // backward. A frozen one needs the engine's report for each backward gather, since a trainable
  // gradient can be final before a product's backward reads the frozen weight (see the header).
  if (m.holds_frozen && m.backward_nodes_done < m.backward_fetches) return;
  const bool done = std::all_of(m.params.begin(), m.params.end(), [&](int64_t i) {
    const Param& p = params_[size_t(i)];
    return p.persistent || p.frozen || p.grad_done;
  });
  if (!done) return;
  for (; m.backward_fetches > 0; --m.backward_fetches) release_params(m.params);
  m.backward_nodes_done = m.recompute_holds = 0;
}

void ParamCoordinator::write_back(int64_t param_index, int modifier_rank) {
  Param& p = params_.at(size_t(param_index));
  ZS_CHECK(p.gathered, "write_back: parameter ", param_index, " is not gathered");
  // detach(): no autograd history reaches the chunks, and the backend gets a tensor without the
  // Parameter's Python object, which its worker thread must not be the last to drop (see bare() in
  // python/csrc/bind_runtime.cpp).
  const at::Tensor values = p.tensor.detach();
  if (modifier_rank >= 0 && comm_->world_size() > 1) {
    comm_->broadcast(values, modifier_rank,
                     detail::cat("GatheredParameters: parameter ", param_index, " from rank ", modifier_rank))
        .wait();
  }
  write(param_index, values);
}

void ParamCoordinator::write(int64_t param_index, const at::Tensor& full) {
  if (write_values_) {
    write_values_(param_index, full);
  } else {
    const Param& p = params_.at(size_t(param_index));
    groups_[size_t(p.group)]->write_tensor(p.index, full);
  }
}

void ParamCoordinator::overwrite(int64_t param_index, const at::Tensor& full) {
  Param& p = params_.at(size_t(param_index));
  // A gather in flight would publish the old values over the new ones when it lands.
  if (p.in_flight >= 0) complete_gather(p.in_flight);
  write(param_index, full);
  if (p.gathered) p.tensor.detach().copy_(full.view(p.tensor.sizes()));
}

void ParamCoordinator::release_gathered() {
  // Prefetches past the end of the iteration are still collectives every rank issued: finish them.
  while (!gathers_.empty()) complete_gather(gathers_.begin()->first);
  for (auto& m : modules_) {
    m.backward_fetches = m.backward_nodes_done = m.recompute_holds = m.forward_fetches = 0;
    m.training_forwards = 0;
  }
  for (auto& p : params_) {
    p.refs = 0;
    p.grad_done = false;
    if (p.gathered && !p.persistent) drop(p);
  }
}

void ParamCoordinator::abandon_iteration() {
  release_gathered();
  trace().abandon_iteration();
}

void ParamCoordinator::abandon_forward() {
  for (auto& m : modules_) {
    for (; m.forward_fetches > 0; --m.forward_fetches) release_params(m.params);
  }
  drop_unreferenced();
  trace().abandon_iteration();
  inference_ = false;
}

void ParamCoordinator::drop_unreferenced() {
  // Prefetches past the last module are collectives every rank issued: finish them.
  while (!gathers_.empty()) complete_gather(gathers_.begin()->first);
  // What something still holds (a GatheredParameters block) keeps its references.
  for (auto& p : params_) {
    if (p.gathered && p.refs == 0 && !p.persistent) drop(p);
  }
}

void ParamCoordinator::begin_forward(bool grad_enabled) {
  // A forward without autograd that raised outside the engine never reached end_forward: its
  // partial order says nothing.
  if (inference_) eval_trace_.abandon_iteration();
  inference_ = !grad_enabled;
}

void ParamCoordinator::end_forward() {
  if (!inference_) return;
  drop_unreferenced();
  if (!eval_trace_.end_iteration()) {
    warn(detail::cat("rank ", comm_->rank(), ": ZeRO-3 module order of a forward without gradients "
                     "differed from the recorded one; recording it again"));
  }
  inference_ = false;
}

void ParamCoordinator::release_all() {
  release_gathered();
  if (!train_trace_.end_iteration()) {
    warn(detail::cat("rank ", comm_->rank(), ": ZeRO-3 module order differed from the recorded one "
                     "this iteration; recording it again"));
  }
}

void ParamCoordinator::refresh_persistent() {
  std::vector<int64_t> persistent;
  for (size_t i = 0; i < params_.size(); ++i) {
    // Frozen values do not change in a step.
    if (params_[i].persistent && !params_[i].frozen) {
      persistent.push_back(int64_t(i));
      if (params_[i].gathered) drop(params_[i]);
    }
  }
  gather(persistent);
}

void ParamCoordinator::drop(Param& p) {
  memory_.release(category(p), gathered_bytes(p));
  if (!p.persistent) live_numel_ -= p.numel;
  if (p.prefetched) {  // prefetched but never used: the trace changed, or make_room needed it
    p.prefetched = false;
    prefetched_ahead_numel_ -= p.numel;
  }
  // The Parameter shows an empty tensor, as in DeepSpeed; the gathered storage itself gives its
  // memory back even where autograd still holds views of it (they are read only after the module
  // is gathered again for backward, into this same storage).
  p.tensor.set_data(at::empty({0}, p.tensor.options()));
  c10::StorageImpl* s = p.storage.unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
  p.gathered = false;
}

at::Tensor ParamCoordinator::gathered_buffer(Param& p, int64_t numel, const at::TensorOptions& options) {
  if (!p.storage) {
    at::Tensor t = at::empty({numel}, options);
    p.storage = t.storage();
    return t;
  }
  c10::StorageImpl* s = p.storage.unsafeGetStorageImpl();
  const size_t nbytes = size_t(numel) * options.dtype().itemsize();
  if (s->nbytes() != nbytes) {
    s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
    s->set_nbytes(nbytes);
  }
  return at::empty({0}, options).set_(p.storage, 0, {numel}, {1});
}

void ParamCoordinator::gather(const std::vector<int64_t>& indices) {
  std::map<int64_t, std::vector<int64_t>> by_group;
  for (int64_t i : indices) by_group[params_[size_t(i)].group].push_back(i);
  for (auto& [g, members] : by_group) complete_gather(start_gather(g, members));
}

int64_t ParamCoordinator::start_gather(int64_t g, const std::vector<int64_t>& members) {
  FlatGroup& group = *groups_[size_t(g)];
  const ChunkLayout& L = group.chunk_layout();
  const int64_t world = comm_->world_size();
  Gather x;
  x.group = g;
  x.members = members;
  std::vector<at::Tensor> mine;
  for (int64_t i : members) {
    Param& p = params_[size_t(i)];
    const int64_t chunk = L.chunks[size_t(p.index)];
    // This rank's chunk, padded to the chunk size: the flat shard reserves whole chunks.
    at::Tensor own = group.params().narrow(0, L.local_offsets[size_t(p.index)], chunk);
    if (!p.persistent) live_numel_ += p.numel;
    // Counted from the start: a direct gather's buffer exists from here, and a prefetch's memory
    // should show while it is in flight, not only once its module fetches it.
    memory_.add(category(p), gathered_bytes(p));
    if (chunk * world >= kDirectGatherNumel) {
      // Rank r's chunk lands at r * chunk: exactly the parameter's layout, padding at the end.
      at::Tensor full = gathered_buffer(p, chunk * world, own.options());
      x.direct_works.push_back(comm_->all_gather(full, own, detail::cat("parameter ", i)));
      x.direct.emplace_back(i, std::move(full));
      continue;
    }
    x.batched.push_back(i);
    mine.push_back(own);
    x.offsets.push_back(x.send_numel);
    x.send_numel += chunk;
  }
  peak_live_numel_ = std::max(peak_live_numel_, live_numel_);
  if (!x.batched.empty()) {
    // Every rank sends its chunks of these parameters back to back.
    x.send = mine.size() == 1 ? mine[0].contiguous() : at::cat(mine);
    x.recv = at::empty({x.send_numel * world}, x.send.options());
    x.work = comm_->all_gather(x.recv, x.send, detail::cat("parameters of ", x.batched.size(), " tensors"));
  }
  const int64_t id = next_gather_id_++;
  for (int64_t i : members) params_[size_t(i)].in_flight = id;
  gathers_.emplace(id, std::move(x));
  return id;
}

void ParamCoordinator::complete_gather(int64_t id) {
  auto it = gathers_.find(id);
  ZS_CHECK(it != gathers_.end(), "ParamCoordinator: no gather #", id, " in flight");
  Gather x = std::move(it->second);
  gathers_.erase(it);
  const FlatGroup& group = *groups_[size_t(x.group)];
  const ChunkLayout& L = group.chunk_layout();
  const int64_t world = comm_->world_size();
  auto publish = [&](int64_t i, const at::Tensor& full) {
    Param& p = params_[size_t(i)];
    p.tensor.set_data(full.view(group.shape(p.index)));
    p.gathered = true;
    p.in_flight = -1;
  };
  // Waited here, in issue order: the module about to run reads these parameters.
  for (size_t k = 0; k < x.direct.size(); ++k) {
    x.direct_works[k].wait();
    const auto& [i, full] = x.direct[k];
    publish(i, full.narrow(0, 0, params_[size_t(i)].numel));
  }
  if (x.batched.empty()) return;
  x.work.wait();
  for (size_t k = 0; k < x.batched.size(); ++k) {
    Param& p = params_[size_t(x.batched[k])];
    const int64_t t = p.index;
    at::Tensor full = gathered_buffer(p, L.numels[size_t(t)], x.send.options());
    for (int64_t r = 0; r < world; ++r) {
      const int64_t held = L.held_numel(t, r);
      if (held > 0) {
        full.narrow(0, r * L.chunks[size_t(t)], held)
            .copy_(x.recv.narrow(0, r * x.send_numel + x.offsets[k], held));
      }
    }
    publish(x.batched[k], full);
  }
}

}  // namespace zeroshard
