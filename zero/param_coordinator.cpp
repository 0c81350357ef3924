// ZeRO-3 gathering and release by module, prefetch along the fetch order; see param_coordinator.h.
#include "zero/param_coordinator.h"

#include <algorithm>

#include "runtime/error.h"
#include "runtime/log.h"

namespace zeroshard {

namespace {
// How far ahead in the fetch order prefetch() looks for chunks to read from disk: the swap
// starts at most offload_param.buffer_count reads (5 by default), so a few modules' worth of
// candidates is enough, and the walk stays short on every fetch.
constexpr size_t kReadAheadParams = 64;
constexpr size_t kReadAheadModules = 16;
}  // namespace

ParamCoordinator::ParamCoordinator(std::vector<FlatGroup*> groups, std::shared_ptr<Comm> comm,
                                   const ZeroConfig& config, MemoryAccount& memory,
                                   std::vector<OptimizerShard*> shards, ParamSwap* swap)
    : gatherer_(std::move(groups), comm, config, memory, std::move(shards),
                [this](int64_t param) { return reused_soon(param); }, swap),
      rank_(comm->rank()),
      prefetch_numel_(config.stage3_prefetch_bucket_size),
      reuse_distance_numel_(config.stage3_max_reuse_distance),
      uses_(size_t(gatherer_.num_params())) {}

void ParamCoordinator::register_module(int64_t module_id, const std::vector<int64_t>& param_indices) {
  ZS_CHECK(module_id >= 0, "ParamCoordinator::register_module: negative module id");
  if (size_t(module_id) >= modules_.size()) modules_.resize(size_t(module_id) + 1);
  Module& m = modules_[size_t(module_id)];
  for (int64_t i : param_indices) {
    ZS_CHECK(i >= 0 && size_t(i) < uses_.size(), "ParamCoordinator::register_module: parameter ",
             i, " is outside 0..", uses_.size() - 1);
    m.params.push_back(i);
    uses_[size_t(i)].modules.push_back(module_id);
    const ParamInfo& p = gatherer_.param(i);
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
    warn(detail::cat("rank ", rank_, ": ZeRO-3 module order changed (module ", module_id,
                     " was not next); prefetching stops and the order is recorded again"));
  }
  Module& m = modules_[size_t(module_id)];
  gatherer_.fetch_params(m.params);
  ++(for_backward ? m.backward_fetches : m.forward_fetches);
  if (for_backward) {
    // A gradient that arrived before this module's backward began came from another autograd
    // pass (reentrant checkpointing's) and says nothing about this one: wait for the next.
    for (int64_t i : m.params) uses_[size_t(i)].grad_done = false;
  }
  prefetch();
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
  gatherer_.release_params(m.params);
  return false;
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

void ParamCoordinator::prefetch() {
  if (trace().mode() != FetchTrace::Mode::follow) return;
  const auto& order = trace().modules();
  if (prefetch_numel_ > 0) {
    // The bucket bounds everything prefetched and not yet fetched by its module, not each call's
    // additions: otherwise every fetch starts a bucket more and forward ends with backward's
    // parameters all gathered again.
    int64_t budget = prefetch_numel_ - gatherer_.counters().prefetched_ahead_numel;
    int64_t reserved = 0;  // chosen so far: the cap counts what is about to be in flight
    std::vector<int64_t> chosen;
    for (size_t k = trace().position(); k < order.size() && budget > 0; ++k) {
      for (int64_t i : modules_[size_t(order[k])].params) {
        if (gatherer_.whole(i)) continue;
        if (std::find(chosen.begin(), chosen.end(), i) != chosen.end()) continue;
        const int64_t numel = gatherer_.param(i).numel;
        if (numel > budget || reserved + numel > gatherer_.room_numel()) {
          budget = 0;
          break;
        }
        chosen.push_back(i);
        budget -= numel;
        reserved += numel;
      }
    }
    gatherer_.prefetch(chosen);
  }
  // Then disk reads of the parameters the order needs after those (a gather started now would
  // wait for its reads at once): they run while the modules before them compute. A bound keeps
  // this walk short; the swap starts as many as its staging buffers take.
  if (!gatherer_.reads_from_disk()) return;
  std::vector<int64_t> ahead;
  const size_t last = std::min(order.size(), trace().position() + kReadAheadModules);
  for (size_t k = trace().position(); k < last && ahead.size() < kReadAheadParams; ++k) {
    for (int64_t i : modules_[size_t(order[k])].params) {
      if (!gatherer_.whole(i)) ahead.push_back(i);
    }
  }
  gatherer_.read_ahead(ahead);
}

void ParamCoordinator::grad_done(int64_t param_index) {
  ParamUse& done = uses_.at(size_t(param_index));
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
  ZS_CHECK(param_index >= 0 && size_t(param_index) < uses_.size(), "ParamCoordinator: parameter ",
           param_index, " is outside 0..", uses_.size() - 1);
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
  const ParamUse& use = uses_.at(size_t(param_index));
  const bool persistent = gatherer_.param(param_index).persistent;
  const bool held = std::any_of(use.modules.begin(), use.modules.end(), [&](int64_t m) {
    return modules_[size_t(m)].forward_fetches > 0;
  });
  if (gatherer_.whole(param_index) && (held || persistent)) return -1;
  const bool known = member(module_id, param_index);
  const int64_t id = known ? module_id : join(module_id, param_index, true);
  Module& m = modules_[size_t(id)];
  // A module that joined during its own forward never fetched: count that forward as begun.
  if (m.forward_fetches == 0) m.forward_fetches = 1;
  // One reference per forward of it under way (a module may call itself): each one's end
  // releases the module's parameters once. A member that is not whole was dropped by an inner
  // call's end while an outer one still runs.
  for (int64_t k = 0; k < m.forward_fetches; ++k) gatherer_.fetch_params({param_index});
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
    const ParamInfo& p = gatherer_.param(i);
    return p.persistent || p.frozen || uses_[size_t(i)].grad_done;
  });
  if (!done) return;
  for (; m.backward_fetches > 0; --m.backward_fetches) gatherer_.release_params(m.params);
  m.backward_nodes_done = m.recompute_holds = 0;
}

void ParamCoordinator::release_gathered() {
  gatherer_.release_all();
  for (auto& m : modules_) {
    m.backward_fetches = m.backward_nodes_done = m.recompute_holds = m.forward_fetches = 0;
    m.training_forwards = 0;
  }
  for (auto& use : uses_) use.grad_done = false;
}

void ParamCoordinator::abandon_iteration() {
  release_gathered();
  trace().abandon_iteration();
}

void ParamCoordinator::abandon_forward() {
  for (auto& m : modules_) {
    for (; m.forward_fetches > 0; --m.forward_fetches) gatherer_.release_params(m.params);
  }
  gatherer_.release_unreferenced();
  trace().abandon_iteration();
  inference_ = false;
}

void ParamCoordinator::begin_forward(bool grad_enabled) {
  // A forward without autograd that raised outside the engine never reached end_forward: its
  // partial order says nothing.
  if (inference_) eval_trace_.abandon_iteration();
  inference_ = !grad_enabled;
}

void ParamCoordinator::end_forward() {
  if (!inference_) return;
  gatherer_.release_unreferenced();
  if (!eval_trace_.end_iteration()) {
    warn(detail::cat("rank ", rank_, ": ZeRO-3 module order of a forward without gradients "
                     "differed from the recorded one; recording it again"));
  }
  inference_ = false;
}

void ParamCoordinator::release_all() {
  release_gathered();
  if (!train_trace_.end_iteration()) {
    warn(detail::cat("rank ", rank_, ": ZeRO-3 module order differed from the recorded one "
                     "this iteration; recording it again"));
  }
}

}  // namespace zeroshard
