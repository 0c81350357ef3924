// NVMe swap space and swapped shard parts; see swap_space.h.
#include "zero/swap_space.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "runtime/error.h"
#include "runtime/log.h"

namespace zeroshard {

namespace {
AioOptions aio_options(const AioConfig& c) {
  AioOptions o;
  o.block_size = c.block_size;
  o.queue_depth = c.queue_depth;
  o.intra_op_parallelism = c.intra_op_parallelism;
  o.single_submit = c.single_submit;
  o.overlap_events = c.overlap_events;
  return o;
}
}  // namespace

at::Tensor aligned_for_direct_io(const at::Tensor& base, int64_t bytes) {
  ZS_CHECK(base.scalar_type() == at::kByte && base.dim() == 1 && int64_t(base.numel()) >= bytes + kDirectAlignment,
           "aligned_for_direct_io: ", base.numel(), " bytes cannot hold ", bytes, " aligned");
  const auto address = reinterpret_cast<uintptr_t>(base.data_ptr());
  return base.narrow(0, int64_t((kDirectAlignment - address % kDirectAlignment) % kDirectAlignment), bytes);
}

SwapSettings optimizer_swap_settings(const Config& config) {
  const OffloadOptimizerConfig& o = config.zero_optimization.offload_optimizer;
  return {o.nvme_path, "zero_optimization.offload_optimizer.nvme_path", o.buffer_count, o.pipeline_read,
          o.pipeline_write};
}

SwapSettings param_swap_settings(const Config& config) {
  const OffloadParamConfig& o = config.zero_optimization.offload_param;
  return {o.nvme_path, "zero_optimization.offload_param.nvme_path", o.buffer_count, false, false};
}

SwapSpace::SwapSpace(const SwapSettings& settings, const AioConfig& aio, int rank, HostPool& pool)
    : pool_(pool),
      buffer_count_(settings.buffer_count),
      pipeline_read_(settings.pipeline_read),
      pipeline_write_(settings.pipeline_write) {
  dir_ = std::make_unique<SwapDir>(settings.nvme_path, settings.key, rank);
  engine_ = std::make_unique<AioEngine>(aio_options(aio));
}

SwapSpace::SwapSpace(const Config& config, int rank, HostPool& pool)
    : SwapSpace(optimizer_swap_settings(config), config.aio, rank, pool) {}

SwapSpace::~SwapSpace() {
  for (auto& [view, base] : lent_) pool_.release(base);
}

std::string SwapSpace::backend() const { return engine_->backend_reason(); }

at::Tensor SwapSpace::acquire() {
  at::Tensor base = pool_.acquire(staging_allocation_bytes(staging_bytes_), at::kByte);
  at::Tensor view = aligned_for_direct_io(base, staging_bytes_);
  lent_.emplace_back(view, base);
  return view;
}

void SwapSpace::release(const at::Tensor& buffer) {
  const auto it = std::find_if(lent_.begin(), lent_.end(), [&](const auto& pair) {
    return pair.first.data_ptr() == buffer.data_ptr();
  });
  ZS_CHECK(it != lent_.end(), "SwapSpace::release: not a buffer of this space");
  pool_.release(it->second);
  lent_.erase(it);
}

SwappedPart::SwappedPart(SwapSpace& space, const std::string& name, const std::vector<SubGroup>& sub_groups,
                         size_t slots, at::ScalarType dtype, std::string unit)
    : space_(space), slots_(slots), dtype_(dtype), unit_(std::move(unit)) {
  for (const SubGroup& sg : sub_groups) {
    ZS_CHECK(regions_.empty() || regions_.back().begin < sg.begin, "SwappedPart: regions out of order");
    Region r;
    r.begin = sg.begin;
    r.numel = sg.numel;
    r.offset = file_bytes_;
    r.slot_bytes = align_up(sg.numel * int64_t(c10::elementSize(dtype_)));
    file_bytes_ += swap_region_bytes(r.slot_bytes, int64_t(slots_));
    regions_.push_back(r);
  }
  file_ = std::make_unique<DirectFile>(space_.dir().file(name), true);
  space_.note_region(max_region_bytes());
}

SwappedPart::~SwappedPart() {
  for (Region& r : regions_) {
    try {
      settle(r);  // why: the file closes next
    } catch (const Error& e) {
      // The run is ending: its state on disk goes with it, so this is worth a line, not a throw.
      warn(detail::cat("NVMe: at shutdown: ", e.what()));
    }
  }
}

void SwappedPart::settle(Region& r) {
  if (!r.pending) return;
  const AioEngine::Handle h = std::move(r.pending);
  r.pending.reset();
  try {
    AioEngine::wait(h);
  } catch (const IoError& e) {
    // Some blocks may have landed and others not, the header among them: only a new write of
    // the whole region makes it readable again.
    r.lost = e.what();
    throw;
  }
}

void SwappedPart::settle(int64_t begin) { settle(region_mut(begin)); }

void SwappedPart::preallocate() {
  if (file_bytes_ > 0) file_->preallocate(file_bytes_);
}

int64_t SwappedPart::max_region_bytes() const {
  int64_t most = 0;
  for (const Region& r : regions_) most = std::max(most, swap_region_bytes(r.slot_bytes, int64_t(slots_)));
  return most;
}

const SwappedPart::Region& SwappedPart::region(int64_t begin) const {
  const auto it = std::lower_bound(regions_.begin(), regions_.end(), begin,
                                   [](const Region& r, int64_t b) { return r.begin < b; });
  if (it != regions_.end() && it->begin == begin) return *it;
  throw InternalError(detail::cat("SwappedPart: no ", unit_, " starts at ", begin));
}

SwappedPart::Region& SwappedPart::region_mut(int64_t begin) { return const_cast<Region&>(region(begin)); }

AioEngine::Handle SwappedPart::read(int64_t begin, const at::Tensor& buffer) {
  Region& r = region_mut(begin);
  settle(r);
  if (!r.lost.empty()) {
    throw IoError(detail::cat("read ", file_->path(), ": the ", unit_, " at offset ", r.offset,
                              " holds nothing usable: its last write failed (", r.lost, ")"));
  }
  const int64_t bytes = kHeaderBytes + (r.has_state ? r.slot_bytes * int64_t(1 + slots_) : r.slot_bytes);
  ZS_CHECK(buffer.nbytes() >= size_t(bytes), "SwappedPart::read: buffer too small");
  return space_.engine().read(*file_, buffer.data_ptr(), bytes, r.offset);
}

AioEngine::Handle SwappedPart::write(int64_t begin, const at::Tensor& buffer, bool with_state) {
  Region& r = region_mut(begin);
  settle(r);  // why: two writes of one region in flight could land in either order
  const int64_t bytes = kHeaderBytes + (with_state ? r.slot_bytes * int64_t(1 + slots_) : r.slot_bytes);
  ZS_CHECK(buffer.nbytes() >= size_t(bytes), "SwappedPart::write: buffer too small");
  Header h;
  h.begin = r.begin;
  h.sequence = ++r.sequence;
  std::memcpy(buffer.data_ptr(), &h, sizeof(h));
  r.has_state = r.has_state || (with_state && slots_ > 0);
  r.pending = space_.engine().write(*file_, buffer.data_ptr(), bytes, r.offset);
  r.lost.clear();  // settle() sets it again if this write fails too
  return r.pending;
}

void SwappedPart::load(int64_t begin, const at::Tensor& master, const std::vector<at::Tensor>& state, double init) {
  const Region& r = region(begin);
  at::Tensor buffer = space_.acquire();
  try {
    AioEngine::wait(read(begin, buffer));
    check(begin, buffer);
    master.copy_(view(buffer, begin, -1));
    for (size_t s = 0; s < state.size(); ++s) {
      if (r.has_state) {
        state[s].copy_(view(buffer, begin, int64_t(s)));
      } else {
        state[s].fill_(init);
      }
    }
  } catch (...) {
    space_.release(buffer);
    throw;
  }
  space_.release(buffer);
}

void SwappedPart::store(int64_t begin, const at::Tensor& master, const std::vector<at::Tensor>& state) {
  at::Tensor buffer = space_.acquire();
  try {
    view(buffer, begin, -1).copy_(master);
    for (size_t s = 0; s < state.size(); ++s) view(buffer, begin, int64_t(s)).copy_(state[s]);
    ++region_mut(begin).generation;
    write(begin, buffer, !state.empty());
    settle(begin);
  } catch (...) {
    space_.release(buffer);
    throw;
  }
  space_.release(buffer);
}

at::Tensor SwappedPart::view(const at::Tensor& buffer, int64_t begin, int64_t slot) const {
  const Region& r = region(begin);
  const int64_t at_byte = kHeaderBytes + r.slot_bytes * (slot + 1);
  return buffer.narrow(0, at_byte, r.numel * int64_t(c10::elementSize(dtype_))).view(dtype_);
}

void SwappedPart::check(int64_t begin, const at::Tensor& buffer) const {
  const Region& r = region(begin);
  Header got;
  std::memcpy(&got, buffer.data_ptr(), sizeof(got));
  Header want;  // the magic by its default
  want.begin = r.begin;
  want.sequence = r.sequence;
  if (std::memcmp(got.magic, want.magic, sizeof(got.magic)) == 0 && got.begin == want.begin &&
      got.sequence == want.sequence) {
    return;
  }
  throw IoError(detail::cat("read ", file_->path(), ": the ", unit_, " at offset ", r.offset, " (",
                            kHeaderBytes + r.slot_bytes * int64_t(1 + slots_), " bytes) does not hold what this "
                            "run wrote there (write ", r.sequence, " of elements [", r.begin, ", ",
                            r.begin + r.numel, ")): the file was truncated, overwritten or replaced by "
                            "something else while the run used it"));
}

bool SwappedPart::has_state(int64_t begin) const { return region(begin).has_state; }

void SwappedPart::forget_state() {
  for (Region& r : regions_) {
    r.has_state = false;
    ++r.generation;
  }
}

}  // namespace zeroshard
