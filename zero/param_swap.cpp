// Parameter chunks on NVMe; see param_swap.h.
#include "zero/param_swap.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <sys/mman.h>
#include <unistd.h>

#include "runtime/error.h"
#include "runtime/log.h"
#include "runtime/trace.h"

namespace zeroshard {

namespace {
double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

ParamSwap::ParamSwap(const Config& config, int rank, HostPool& pool, MemoryAccount& memory)
    : memory_(memory),
      max_in_cpu_(config.zero_optimization.offload_param.max_in_cpu),
      buffer_size_(config.zero_optimization.offload_param.buffer_size) {
  const OffloadParamConfig& o = config.zero_optimization.offload_param;
  if (o.buffer_count < 1) {
    throw ConfigError(detail::cat("zero_optimization.offload_param.buffer_count: got ", o.buffer_count,
                                  "; parameters on NVMe need at least 1 staging buffer"));
  }
  space_ = std::make_unique<SwapSpace>(param_swap_settings(config), config.aio, rank, pool);
}

ParamSwap::~ParamSwap() {
  for (auto& group : chunks_) {
    for (Chunk& c : group) {
      if (c.reading) land(c, false);
    }
  }
  while (!writes_.empty()) {
    try {
      retire_oldest_write();
    } catch (const Error&) {
      // The run is ending and its parameters on disk go with it; SwappedPart warned.
    }
  }
  for (auto& group : chunks_) {
    for (Chunk& c : group) set_resident(c, false);
  }
}

void ParamSwap::start(const std::vector<FlatGroup*>& groups, const std::vector<std::vector<bool>>& persistent) {
  ZS_CHECK(groups_.empty(), "ParamSwap::start: started already");
  ZS_CHECK(groups.size() == persistent.size(), "ParamSwap::start: ", persistent.size(), " lists for ",
           groups.size(), " groups");
  groups_ = groups;
  int64_t largest = 0, bytes = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    FlatGroup& group = *groups[g];
    const ChunkLayout& L = group.chunk_layout();
    std::vector<Chunk> chunks;
    std::vector<SubGroup> regions;
    for (int64_t t = 0; t < group.num_tensors(); ++t) {
      Chunk c;
      c.group = int64_t(g);
      c.tensor = t;
      c.begin = L.local_offsets[size_t(t)];
      c.numel = L.chunks[size_t(t)];
      c.stays = !group.params_on_nvme() || persistent[g].at(size_t(t)) || c.numel == 0;
      c.resident = false;
      if (!c.stays) {
        regions.push_back({c.begin, c.numel, Residency::nvme});
        largest = std::max(largest, c.numel);
      }
      chunks.push_back(std::move(c));
    }
    chunks_.push_back(std::move(chunks));
    parts_.push_back(regions.empty() ? nullptr
                                     : std::make_unique<SwappedPart>(*space_, detail::cat("param_group", g, ".swp"),
                                                                     regions, 0, group.params().scalar_type(),
                                                                     "parameter chunk"));
    if (parts_.back()) bytes += parts_.back()->file_bytes();
  }
  if (largest > buffer_size_) {
    throw ConfigError(detail::cat("zero_optimization.offload_param.buffer_size: got ", buffer_size_,
                                  " elements, but this rank's largest parameter chunk has ", largest,
                                  "; a staging buffer holds one whole chunk, so set it to at least ", largest));
  }
  space_->dir().require_space(bytes);
  for (auto& part : parts_) {
    if (part) part->preallocate();
  }
  int64_t total = 0, written = 0;
  for (auto& group : chunks_)
    for (Chunk& c : group) total += groups_[size_t(c.group)]->params_on_nvme() && !c.stays;
  for (auto& group : chunks_) {
    for (Chunk& c : group) {
      if (!groups_[size_t(c.group)]->params_on_nvme()) continue;
      set_resident(c, true);  // the first values are in the store
      if (c.stays) continue;
      c.dirty = true;
      evict(c);
      progress("NVMe: writing the parameter chunks", ++written, total);
    }
  }
  settle();
}

bool ParamSwap::swapped(int64_t group) const { return parts_.at(size_t(group)) != nullptr; }

ParamSwap::Chunk& ParamSwap::chunk(int64_t group, int64_t tensor) {
  return chunks_.at(size_t(group)).at(size_t(tensor));
}

at::Tensor ParamSwap::values(const Chunk& c) const {
  return groups_[size_t(c.group)]->params().narrow(0, c.begin, c.numel);
}

void ParamSwap::set_resident(Chunk& c, bool resident) {
  if (c.resident == resident || !groups_[size_t(c.group)]->params_on_nvme()) return;
  const int64_t bytes = c.numel * int64_t(groups_[size_t(c.group)]->params().element_size());
  c.resident = resident;
  if (resident) {
    memory_.add(MemoryCategory::host_parameters, bytes);
    counters_.resident_numel += c.numel;
    if (c.stays) counters_.persistent_numel += c.numel;
    counters_.peak_resident_numel = std::max(counters_.peak_resident_numel, counters_.resident_numel);
  } else {
    memory_.release(MemoryCategory::host_parameters, bytes);
    counters_.resident_numel -= c.numel;
    if (c.stays) counters_.persistent_numel -= c.numel;
  }
}

int64_t ParamSwap::lent() const { return reads_in_flight_ + int64_t(writes_.size()); }

void ParamSwap::retire_oldest_write() {
  Write w = std::move(writes_.front());
  writes_.pop_front();
  const auto t = std::chrono::steady_clock::now();
  struct Give {
    SwapSpace& space;
    const at::Tensor& buffer;
    ~Give() { space.release(buffer); }
  } give{*space_, w.buffer};
  w.part->settle(w.begin);  // raises the write's IoError
  counters_.wait_ms += ms_since(t);
}

at::Tensor ParamSwap::acquire_buffer() {
  while (lent() >= space_->buffer_count()) {
    if (!writes_.empty()) {
      retire_oldest_write();
      continue;
    }
    // Every buffer holds a read in flight: the oldest-used one lands.
    Chunk* oldest = nullptr;
    for (auto& group : chunks_) {
      for (Chunk& c : group) {
        if (c.reading && (!oldest || c.used < oldest->used)) oldest = &c;
      }
    }
    ZS_CHECK(oldest, "ParamSwap: ", lent(), " staging buffers lent and none to take back");
    land(*oldest);
  }
  at::Tensor buffer = space_->acquire();
  counters_.peak_lent = std::max(counters_.peak_lent, lent() + 1);  // the caller's one counts from here
  return buffer;
}

void ParamSwap::start_read(Chunk& c) {
  at::Tensor buffer = acquire_buffer();
  try {
    c.reading = parts_[size_t(c.group)]->read(c.begin, buffer);
  } catch (...) {
    space_->release(buffer);
    throw;
  }
  c.read_buffer = buffer;
  ++reads_in_flight_;
  ++counters_.reads;
}

void ParamSwap::land(Chunk& c, bool keep) {
  const AioEngine::Handle h = std::move(c.reading);
  c.reading.reset();
  const at::Tensor buffer = std::move(c.read_buffer);
  c.read_buffer = at::Tensor();
  --reads_in_flight_;
  struct Give {
    SwapSpace& space;
    const at::Tensor& buffer;
    ~Give() { space.release(buffer); }
  } give{*space_, buffer};
  const auto t = std::chrono::steady_clock::now();
  if (!keep) {
    try {
      AioEngine::wait(h);
    } catch (const Error&) {
      // Dropped unread: the values come from elsewhere (a store, or the run is ending).
    }
    return;
  }
  trace::Scope traced("swap", [&] { return detail::cat("swap in parameter chunk ", c.group, ":", c.begin); });
  AioEngine::wait(h);
  counters_.wait_ms += ms_since(t);
  SwappedPart& part = *parts_[size_t(c.group)];
  part.check(c.begin, buffer);
  values(c).copy_(part.view(buffer, c.begin, -1));
  set_resident(c, true);
  c.dirty = false;
}

void ParamSwap::write_out(Chunk& c, const at::Tensor& from) {
  trace::Scope traced("swap", [&] { return detail::cat("swap out parameter chunk ", c.group, ":", c.begin); });
  SwappedPart& part = *parts_[size_t(c.group)];
  Write w{&part, c.begin, acquire_buffer()};
  try {
    part.view(w.buffer, c.begin, -1).copy_(from);
    part.write(c.begin, w.buffer, false);
  } catch (...) {
    space_->release(w.buffer);
    throw;
  }
  writes_.push_back(std::move(w));
  ++counters_.writes;
}

void ParamSwap::evict(Chunk& c) {
  if (c.dirty) write_out(c, values(c));
  c.dirty = false;
  groups_[size_t(c.group)]->drop_param_pages(c.begin, c.numel);
  set_resident(c, false);
}

void ParamSwap::hold(int64_t group, const std::vector<int64_t>& tensors) {
  if (!swapped(group)) return;
  ZS_CHECK(unbalanced_.empty(), "ParamSwap: a hold of ", unbalanced_, " ended more often than it began");
  ++clock_;
  for (int64_t t : tensors) {
    Chunk& c = chunk(group, t);
    if (!c.stays && !c.resident && !c.reading) start_read(c);
  }
  size_t taken = 0;
  try {
    for (int64_t t : tensors) {
      Chunk& c = chunk(group, t);
      if (c.reading) land(c);
      ++c.holds;
      ++taken;
      c.used = clock_;
    }
    trim();  // may write chunks out: an error there must not leave these held either
  } catch (...) {
    for (size_t k = 0; k < taken; ++k) --chunk(group, tensors[k]).holds;
    throw;
  }
}

void ParamSwap::unhold(int64_t group, const std::vector<int64_t>& tensors, bool written) noexcept {
  if (!swapped(group)) return;
  for (int64_t t : tensors) {
    Chunk& c = chunk(group, t);
    if (c.holds > 0) {
      --c.holds;
    } else {
      unbalanced_ = detail::cat("group ", group, " tensor ", t);  // raised by the next hold()
    }
    c.dirty = c.dirty || written;
  }
}

void ParamSwap::prefetch(int64_t group, const std::vector<int64_t>& tensors) {
  if (!swapped(group)) return;
  for (int64_t t : tensors) {
    if (lent() >= space_->buffer_count()) return;
    Chunk& c = chunk(group, t);
    if (c.stays || c.resident || c.reading) continue;
    c.used = clock_;
    start_read(c);
    ++counters_.prefetched;
  }
}

void ParamSwap::store(int64_t group, int64_t begin, const at::Tensor& values_in) {
  if (!swapped(group)) return;
  const at::Tensor in = values_in.reshape(-1);
  const int64_t end = begin + in.numel();
  auto& chunks = chunks_.at(size_t(group));
  // The first chunk that ends after begin.
  auto it = std::upper_bound(chunks.begin(), chunks.end(), begin,
                             [](int64_t b, const Chunk& c) { return b < c.begin + c.numel; });
  for (; it != chunks.end() && it->begin < end; ++it) {
    Chunk& c = *it;
    if (c.numel == 0) continue;
    const int64_t lo = std::max(begin, c.begin), hi = std::min(end, c.begin + c.numel);
    const at::Tensor piece = in.narrow(0, lo - begin, hi - lo);
    const bool whole = lo == c.begin && hi == c.begin + c.numel;
    if (c.reading) land(c, /*keep=*/!whole);  // a read of the old values: useless when all are new
    if (c.stays || c.resident) {
      values(c).narrow(0, lo - c.begin, hi - lo).copy_(piece);
      c.dirty = !c.stays;
    } else if (whole) {
      write_out(c, piece);  // on disk it stays, with the new values
    } else {
      hold(group, {c.tensor});  // part of it: the rest is read first
      values(c).narrow(0, lo - c.begin, hi - lo).copy_(piece);
      unhold(group, {c.tensor}, true);
    }
  }
  trim();
}

void ParamSwap::hold_all() {
  ZS_CHECK(!all_held_, "ParamSwap::hold_all: held already");
  std::vector<std::pair<int64_t, int64_t>> taken;
  try {
    // One chunk at a time: the whole store may need more staging buffers than there are.
    for (size_t g = 0; g < chunks_.size(); ++g) {
      for (const Chunk& c : chunks_[g]) {
        hold(int64_t(g), {c.tensor});
        taken.emplace_back(int64_t(g), c.tensor);
      }
    }
  } catch (...) {
    for (const auto& [g, t] : taken) unhold(g, {t}, false);
    try {
      trim();  // what the rolled-back holds brought in leaves again
    } catch (const Error&) {
      // The first error is the one to report; a chunk whose write failed here stays in host
      // memory, changed, and the next trim writes it again.
    }
    throw;
  }
  all_held_ = true;
}

void ParamSwap::unhold_all(bool written) noexcept {
  if (!all_held_) return;
  all_held_ = false;
  for (size_t g = 0; g < chunks_.size(); ++g) {
    std::vector<int64_t> all;
    for (const Chunk& c : chunks_[g]) all.push_back(c.tensor);
    unhold(int64_t(g), all, written);
  }
}

void ParamSwap::trim() {
  int64_t unheld = 0;
  std::vector<Chunk*> candidates;
  for (auto& group : chunks_) {
    for (Chunk& c : group) {
      if (c.stays || !c.resident || c.holds > 0) continue;
      unheld += c.numel;
      candidates.push_back(&c);
    }
  }
  if (unheld <= max_in_cpu_) return;
  std::sort(candidates.begin(), candidates.end(), [](const Chunk* a, const Chunk* b) { return a->used < b->used; });
  for (Chunk* c : candidates) {
    if (unheld <= max_in_cpu_) break;
    unheld -= c->numel;
    evict(*c);
  }
}

int64_t ParamSwap::mapped_bytes() const {
  const int64_t page = sysconf(_SC_PAGESIZE);
  int64_t bytes = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!parts_[g]) continue;
    const at::Tensor store = groups_[g]->params();
    const int64_t length = (int64_t(store.nbytes()) + page - 1) / page * page;
    std::vector<unsigned char> pages(size_t(length / page));
    if (length == 0) continue;
    ZS_CHECK(mincore(store.data_ptr(), size_t(length), pages.data()) == 0, "ParamSwap: mincore of ", length,
             " bytes of group ", g, "'s chunk store failed: ", std::strerror(errno));
    for (unsigned char p : pages) bytes += (p & 1) ? page : 0;
  }
  return bytes;
}

void ParamSwap::settle() {
  while (!writes_.empty()) retire_oldest_write();
}

}  // namespace zeroshard
