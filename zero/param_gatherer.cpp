// ZeRO-3 parameter gathering, reference counts, release and write-back; see param_gatherer.h.
#include "zero/param_gatherer.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "runtime/error.h"
#include "runtime/trace.h"

namespace zeroshard {
namespace {
// Parameters of at least this many elements (4 MB in fp32) get an all-gather of their own, straight
// into their full tensor; smaller ones are batched, as one collective each costs a round trip.
constexpr int64_t kDirectGatherNumel = int64_t(1) << 20;
}  // namespace

ParamGatherer::ParamGatherer(std::vector<FlatGroup*> groups, std::shared_ptr<Comm> comm,
                             const ZeroConfig& config, MemoryAccount& memory,
                             std::vector<OptimizerShard*> shards, ReusedSoon reused_soon, ParamSwap* swap)
    : groups_(std::move(groups)), comm_(std::move(comm)), shards_(std::move(shards)),
      reused_soon_(std::move(reused_soon)),
      max_live_numel_(config.stage3_max_live_parameters),
      memory_(memory),
      swap_(swap) {
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (int64_t i = 0; i < groups_[g]->num_tensors(); ++i) {
      Param p;
      p.group = int64_t(g);
      p.index = i;
      p.numel = groups_[g]->chunk_layout().numels[size_t(i)];
      p.persistent = p.numel < config.stage3_param_persistence_threshold;
      p.frozen = !groups_[g]->trainable();
      params_.push_back(std::move(p));
    }
  }
}

ParamGatherer::~ParamGatherer() {
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
    memory_.release(MemoryCategory::comm_buffers, g.staged_bytes);
  }
  for (auto& p : params_) {
    if (p.gathered || p.in_flight >= 0) memory_.release(category(p), gathered_bytes(p));
  }
}

MemoryCategory ParamGatherer::category(const Param& p) {
  return p.persistent ? MemoryCategory::parameters : MemoryCategory::gathered_parameters;
}

int64_t ParamGatherer::gathered_bytes(const Param& p) const {
  return p.numel * int64_t(groups_[size_t(p.group)]->params().element_size());
}

bool ParamGatherer::whole(int64_t param_index) const {
  const Param& p = params_.at(size_t(param_index));
  return p.persistent || p.gathered || p.in_flight >= 0;
}

void ParamGatherer::attach(const std::vector<at::Tensor>& params) {
  ZS_CHECK(params.size() == params_.size(), "ParamGatherer::attach: got ", params.size(),
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

void ParamGatherer::fetch_params(const std::vector<int64_t>& indices) {
  trace::Scope traced("gather", [&] { return detail::cat("fetch ", indices.size(), " parameter(s)"); });
  std::vector<int64_t> missing;
  int64_t need = 0;
  for (int64_t i : indices) {
    Param& p = params_.at(size_t(i));
    if (p.in_flight >= 0) complete_gather(p.in_flight);  // prefetched: only wait for it
    if (p.prefetched) {
      p.prefetched = false;
      counters_.prefetched_ahead_numel -= p.numel;
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

void ParamGatherer::release_params(const std::vector<int64_t>& indices) {
  trace::Scope traced("gather", [&] { return detail::cat("release ", indices.size(), " parameter(s)"); });
  for (int64_t i : indices) {
    Param& p = params_.at(size_t(i));
    if (p.refs > 0 && --p.refs == 0) unused(p);
  }
}

void ParamGatherer::unused(Param& p) {
  if (p.persistent || !p.gathered) return;
  // Kept when the owner's reuse rule says it is needed again soon and the cap allows it.
  if (reused_soon_ && reused_soon_(&p - params_.data()) && counters_.live_numel <= max_live_numel_) return;
  drop(p);
}

void ParamGatherer::make_room(int64_t numel) {
  // Kept-for-reuse parameters (gathered, unreferenced) go first when the cap would be crossed.
  for (auto& p : params_) {
    if (counters_.live_numel + numel <= max_live_numel_) return;
    if (p.gathered && p.refs == 0 && !p.persistent) drop(p);
  }
}

void ParamGatherer::prefetch(const std::vector<int64_t>& indices) {
  std::map<int64_t, std::vector<int64_t>> by_group;
  for (int64_t i : indices) by_group[params_.at(size_t(i)).group].push_back(i);
  for (auto& [g, members] : by_group) {
    for (int64_t i : members) {
      Param& p = params_[size_t(i)];
      ZS_CHECK(!p.persistent && !p.gathered && p.in_flight < 0 && !p.prefetched,
               "ParamGatherer::prefetch: parameter ", i, " is whole already or listed twice");
      p.prefetched = true;
      counters_.prefetched_ahead_numel += p.numel;
    }
    start_gather(g, members);
    counters_.prefetched_params += int64_t(members.size());
  }
}

void ParamGatherer::complete_all_gathers() {
  // Prefetches past the last module (or the end of the iteration) are still collectives every
  // rank issued: finish them.
  while (!gathers_.empty()) complete_gather(gathers_.begin()->first);
}

void ParamGatherer::release_all() {
  complete_all_gathers();
  for (auto& p : params_) {
    p.refs = 0;
    if (p.gathered && !p.persistent) drop(p);
  }
}

void ParamGatherer::release_unreferenced() {
  complete_all_gathers();
  // What something still holds (a GatheredParameters block) keeps its references.
  for (auto& p : params_) {
    if (p.gathered && p.refs == 0 && !p.persistent) drop(p);
  }
}

void ParamGatherer::write_back(int64_t param_index, int modifier_rank) {
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

void ParamGatherer::write(int64_t param_index, const at::Tensor& full) {
  const Param& p = params_.at(size_t(param_index));
  OptimizerShard* shard = shards_.empty() ? nullptr : shards_.at(size_t(p.group));
  in_host(p, /*written=*/true, [&] { write_tensor_values(*groups_[size_t(p.group)], shard, p.index, full); });
}

void ParamGatherer::with_chunk(int64_t param_index, const std::function<void()>& fn) {
  in_host(params_.at(size_t(param_index)), /*written=*/false, fn);
}

void ParamGatherer::in_host(const Param& p, bool written, const std::function<void()>& fn) {
  if (!swap_) return fn();
  swap_->hold(p.group, {p.index});
  {
    struct Unhold {
      ParamSwap* swap;
      const Param& p;
      bool written;
      ~Unhold() { swap->unhold(p.group, {p.index}, written); }
    } unhold{swap_, p, written};
    fn();
  }
  swap_->trim();  // what no longer fits max_in_cpu leaves now
}

void ParamGatherer::read_ahead(const std::vector<int64_t>& indices) {
  if (!swap_) return;
  std::map<int64_t, std::vector<int64_t>> by_group;
  for (int64_t i : indices) {
    const Param& p = params_.at(size_t(i));
    if (!p.persistent) by_group[p.group].push_back(p.index);
  }
  for (const auto& [g, tensors] : by_group) swap_->prefetch(g, tensors);
}

void ParamGatherer::overwrite(int64_t param_index, const at::Tensor& full) {
  Param& p = params_.at(size_t(param_index));
  // A gather in flight would publish the old values over the new ones when it lands.
  if (p.in_flight >= 0) complete_gather(p.in_flight);
  write(param_index, full);
  if (p.gathered) p.tensor.detach().copy_(full.view(p.tensor.sizes()));
}

void ParamGatherer::refresh_persistent(bool include_frozen) {
  std::vector<int64_t> persistent;
  for (size_t i = 0; i < params_.size(); ++i) {
    // Frozen values do not change in a step.
    if (params_[i].persistent && (include_frozen || !params_[i].frozen)) {
      persistent.push_back(int64_t(i));
      if (params_[i].gathered) drop(params_[i]);
    }
  }
  gather(persistent);
}

void ParamGatherer::drop(Param& p) {
  memory_.release(category(p), gathered_bytes(p));
  if (!p.persistent) counters_.live_numel -= p.numel;
  if (p.prefetched) {  // prefetched but never used: the trace changed, or make_room needed it
    p.prefetched = false;
    counters_.prefetched_ahead_numel -= p.numel;
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

at::Tensor ParamGatherer::gathered_buffer(Param& p, int64_t numel, const at::TensorOptions& options) {
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

void ParamGatherer::gather(const std::vector<int64_t>& indices) {
  std::map<int64_t, std::vector<int64_t>> by_group;
  for (int64_t i : indices) by_group[params_[size_t(i)].group].push_back(i);
  for (auto& [g, members] : by_group) complete_gather(start_gather(g, members));
}

int64_t ParamGatherer::start_gather(int64_t g, const std::vector<int64_t>& members) {
  FlatGroup& group = *groups_[size_t(g)];
  const ChunkLayout& L = group.chunk_layout();
  const int64_t world = comm_->world_size();
  Gather x;
  x.group = g;
  x.members = members;
  // Parameters on NVMe: the chunks are in host memory while this reads them. Every read of them
  // below is done when it returns: at::cat and the copies up (all_gather waits for them with
  // chunks on NVMe) are synchronous on the host.
  std::vector<int64_t> held;
  if (swap_) {
    for (int64_t i : members) {
      if (!params_[size_t(i)].persistent) held.push_back(params_[size_t(i)].index);
    }
    swap_->hold(g, held);
  }
  struct Unhold {  // on an error below; else ended before the return, then trimmed
    ParamSwap* swap;
    int64_t group;
    std::vector<int64_t>& held;
    ~Unhold() {
      if (swap) swap->unhold(group, held, false);
    }
    void now() {
      swap->unhold(group, held, false);
      held.clear();
      swap->trim();  // what no longer fits max_in_cpu leaves now
    }
  } unhold{swap_, g, held};
  std::vector<at::Tensor> mine;
  for (int64_t i : members) {
    Param& p = params_[size_t(i)];
    const int64_t chunk = L.chunks[size_t(p.index)];
    // This rank's chunk, padded to the chunk size: the flat shard reserves whole chunks.
    at::Tensor own = group.params().narrow(0, L.local_offsets[size_t(p.index)], chunk);
    if (!p.persistent) counters_.live_numel += p.numel;
    // Counted from the start: a direct gather's buffer exists from here, and a prefetch's memory
    // should show while it is in flight, not only once its module fetches it.
    memory_.add(category(p), gathered_bytes(p));
    if (chunk * world >= kDirectGatherNumel) {
      // Rank r's chunk lands at r * chunk: exactly the parameter's layout, padding at the end.
      at::Tensor full = gathered_buffer(p, chunk * world, group.device_options());
      x.direct_works.push_back(all_gather(group, x, full, own, detail::cat("parameter ", i)));
      x.direct.emplace_back(i, std::move(full));
      continue;
    }
    x.batched.push_back(i);
    mine.push_back(own);
    x.offsets.push_back(x.send_numel);
    x.send_numel += chunk;
  }
  counters_.peak_live_numel = std::max(counters_.peak_live_numel, counters_.live_numel);
  if (!x.batched.empty()) {
    // Every rank sends its chunks of these parameters back to back.
    x.send = mine.size() == 1 ? mine[0].contiguous() : at::cat(mine);
    x.recv = at::empty({x.send_numel * world}, group.device_options());
    x.work = all_gather(group, x, x.recv, x.send, detail::cat("parameters of ", x.batched.size(), " tensors"));
  }
  const int64_t id = next_gather_id_++;
  for (int64_t i : members) params_[size_t(i)].in_flight = id;
  gathers_.emplace(id, std::move(x));
  if (swap_) unhold.now();
  return id;
}

CommWork ParamGatherer::all_gather(const FlatGroup& group, Gather& x, at::Tensor out, const at::Tensor& in,
                                   const std::string& what) {
  if (!group.params_on_host()) return comm_->all_gather(out, in, what);
  if (!up_) up_ = std::make_unique<CopyStream>(group.device_options().device());
  CommWork work;
  // On the copy stream: the copy up and the collective reading it wait for each other only, and
  // the compute stream waits for the collective when complete_gather waits for its work. On a
  // CPU-only run the copy is a host copy. The staged chunk lives until the gather completes.
  // Chunks on NVMe are copied up before this returns (the host waits for the copy stream): their
  // pages may be given back right after, and an asynchronous copy from pageable memory is not
  // promised to have read its source when it returns.
  const bool wait = group.params_on_nvme();
  up_->on_copy_stream([&] {
    at::Tensor staged = in.to(group.device_options(), /*non_blocking=*/!wait, /*copy=*/true);
    x.staged_bytes += staged.nbytes();
    memory_.add(MemoryCategory::comm_buffers, staged.nbytes());
    x.staged.push_back(staged);
    work = comm_->all_gather(out, staged, what);
  });
  return work;
}

void ParamGatherer::complete_gather(int64_t id) {
  auto it = gathers_.find(id);
  ZS_CHECK(it != gathers_.end(), "ParamGatherer: no gather #", id, " in flight");
  Gather x = std::move(it->second);
  gathers_.erase(it);
  // The staged chunks are released once their collectives are waited for, below: their memory
  // is kept from reuse until the compute stream, which those waits ordered after the
  // collectives, gets there.
  struct ReleaseStaged {
    const Gather& x;
    MemoryAccount& memory;
    const CopyStream* up;
    ~ReleaseStaged() {
      for (const at::Tensor& t : x.staged) up->keep_for_compute(t);
      memory.release(MemoryCategory::comm_buffers, x.staged_bytes);
    }
  } release_staged{x, memory_, up_.get()};
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
    at::Tensor full = gathered_buffer(p, L.numels[size_t(t)], group.device_options());
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
