// Flat parameter groups; see flat_group.h. Everything allocated here is registered with the
// MemoryAccount so the per-rank model-state figures come from one place.
#include "zero/flat_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <sys/mman.h>
#include <unistd.h>

#include "runtime/error.h"

namespace zeroshard {

namespace {
// A zero-filled host tensor whose memory is only reserved: a page is committed when first
// written, and drop_param_pages gives it back.
at::Tensor reserve_host(int64_t numel, at::ScalarType dtype) {
  const size_t bytes = std::max<size_t>(1, size_t(numel) * c10::elementSize(dtype));
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    throw Error(detail::cat("offload_param nvme: cannot reserve ", bytes, " bytes of address space for "
                            "the parameter chunks: ", std::strerror(errno)));
  }
  return at::from_blob(p, {numel}, [bytes](void* q) { munmap(q, bytes); },
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
}
}  // namespace

FlatGroup::FlatGroup(const std::vector<at::Tensor>& params, const GroupSpec& spec,
                     MemoryAccount& memory)
    : rank_(spec.rank),
      full_grads_(spec.full_grads && !spec.partition_params),
      partitioned_(spec.partition_params),
      trainable_(spec.trainable),
      params_on_host_(spec.params_on_host),
      params_on_nvme_(spec.params_on_nvme),
      memory_(memory) {
  ZS_CHECK(!params.empty(), "FlatGroup: a parameter group has no parameters");
  ZS_CHECK(trainable_ || partitioned_, "FlatGroup: only stage 3 keeps frozen parameters in a group");
  ZS_CHECK(partitioned_ || !params_on_host_, "FlatGroup: only stage 3 keeps parameters in host memory");
  ZS_CHECK(params_on_host_ || !params_on_nvme_, "FlatGroup: parameters on NVMe (zero_optimization.offload_param."
           "device \"nvme\") are staged in host memory: params_on_host must be set too");
  const auto& chunked = spec.prechunked_shapes;
  ZS_CHECK(chunked.empty() || chunked.size() == params.size(), "FlatGroup: ", chunked.size(),
           " chunk shapes for ", params.size(), " parameters");
  ZS_CHECK(spec.partition_params ||
               std::none_of(chunked.begin(), chunked.end(), [](const auto& c) { return c.has_value(); }),
           "FlatGroup: pre-partitioned parameters (zero.Init) need stage 3");
  const auto is_chunk = [&](size_t i) { return !chunked.empty() && chunked[i].has_value(); };
  std::vector<int64_t> numels;
  for (size_t i = 0; i < params.size(); ++i) {
    shapes_.push_back(is_chunk(i) ? *chunked[i] : params[i].sizes().vec());
    int64_t n = 1;
    for (int64_t d : shapes_.back()) n *= d;
    numels.push_back(n);
  }
  const int64_t world = spec.world_size, rank = spec.rank;
  layout_ = make_flat_layout(numels, world, spec.alignment_numel);
  chunks_ = make_chunk_layout(numels, world);
  const auto opts = params[0].options().dtype(spec.model_dtype);
  // Zero-filled so padding never carries garbage into norms or collectives.
  if (partitioned_) {
    owned_ = {0, chunks_.shard_numel};
    params_ = params_on_nvme_ ? reserve_host(owned_.numel(), spec.model_dtype)
              : at::zeros({owned_.numel()}, params_on_host_ ? opts.device(at::kCPU).pinned_memory(spec.pin_host) : opts);
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t held = chunks_.held_numel(int64_t(i), rank);
      if (held == 0) continue;
      ZS_CHECK(!is_chunk(i) || params[i].numel() == chunks_.chunks[i], "FlatGroup: parameter ", i,
               " holds ", params[i].numel(), " elements, expected its chunk of ", chunks_.chunks[i]);
      at::Tensor mine = is_chunk(i) ? params[i].reshape(-1).narrow(0, 0, held)
                                    : params[i].reshape(-1).narrow(0, rank * chunks_.chunks[i], held);
      params_.narrow(0, chunks_.local_offsets[i], held).copy_(mine);
    }
  } else {
    owned_ = spec.shard_state ? shard_range(layout_.padded_numel, rank, world)
                              : ShardRange{0, layout_.padded_numel};
    params_ = at::zeros({layout_.padded_numel}, opts);
    for (size_t i = 0; i < params.size(); ++i) {
      params_.narrow(0, layout_.offsets[i], layout_.numels[i]).copy_(params[i].reshape(-1));
    }
  }
  device_options_ = opts;
  if (partitioned_) {
    if (trainable_) segment_grads({0});  // allocated by backward; a frozen group has none
  } else {
    grads_ = at::zeros({full_grads_ ? layout_.padded_numel : owned_.numel()}, opts);
  }
  accounted_[0] = params_on_nvme_ ? 0 : params_.nbytes();
  accounted_[1] = grads_.defined() ? grads_.nbytes() : 0;
  memory_.add(params_category(), accounted_[0]);
  memory_.add(MemoryCategory::gradients, accounted_[1]);
}

void FlatGroup::drop_param_pages(int64_t begin, int64_t numel) {
  ZS_CHECK(params_on_nvme_, "FlatGroup::drop_param_pages: the chunks are not on NVMe");
  ZS_CHECK(begin >= 0 && numel >= 0 && begin + numel <= params_.numel(), "FlatGroup::drop_param_pages: [",
           begin, ", ", begin + numel, ") is outside the store of ", params_.numel());
  static const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const auto base = reinterpret_cast<uintptr_t>(params_.data_ptr());
  const uintptr_t lo = (base + uintptr_t(begin) * params_.element_size() + page - 1) / page * page;
  const uintptr_t hi = (base + uintptr_t(begin + numel) * params_.element_size()) / page * page;
  // Pages shared with a neighbouring chunk stay: it may be resident.
  if (hi > lo) {
    ZS_CHECK(madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) == 0, "FlatGroup: giving back ",
             hi - lo, " bytes of the chunk store at element ", begin, " failed (madvise): ", std::strerror(errno));
  }
}

MemoryCategory FlatGroup::params_category() const {
  return params_on_host_ ? MemoryCategory::host_parameters : MemoryCategory::parameters;
}

FlatGroup::~FlatGroup() {
  memory_.release(params_category(), accounted_[0]);
  memory_.release(MemoryCategory::gradients, accounted_[1]);
}

std::vector<at::Tensor> FlatGroup::views(const at::Tensor& flat) const {
  std::vector<at::Tensor> out;
  out.reserve(shapes_.size());
  for (size_t i = 0; i < shapes_.size(); ++i) {
    out.push_back(flat.narrow(0, layout_.offsets[i], layout_.numels[i]).view(shapes_[i]));
  }
  return out;
}

std::vector<at::Tensor> FlatGroup::param_views() const {
  ZS_CHECK(!partitioned_, "FlatGroup::param_views: parameters are partitioned (stage 3); they are "
                          "gathered module by module");
  return views(params_);
}
std::vector<at::Tensor> FlatGroup::grad_views() const {
  ZS_CHECK(full_grads_, "FlatGroup::grad_views: this group keeps only its gradient shard");
  return views(grads_);
}

at::Tensor FlatGroup::owned_grads() const {
  ZS_CHECK(!partitioned_, "FlatGroup::owned_grads: stage 3 keeps its gradients in segments; "
                          "use grad_pieces()");
  return full_grads_ ? grads_.narrow(0, owned_.begin, owned_.numel()) : grads_;
}

void FlatGroup::segment_grads(std::vector<int64_t> begins) {
  ZS_CHECK(partitioned_ && trainable_,
           "FlatGroup::segment_grads: only stage 3's trainable groups keep gradients in segments");
  std::sort(begins.begin(), begins.end());
  begins.erase(std::unique(begins.begin(), begins.end()), begins.end());
  ZS_CHECK(!begins.empty() && begins.front() == 0 && begins.back() < std::max<int64_t>(owned_.numel(), 1),
           "FlatGroup::segment_grads: segments must start at 0 and lie inside the ",
           owned_.numel(), "-element shard");
  zero_grads();
  segment_begins_ = std::move(begins);
  segments_.assign(segment_begins_.size(), at::Tensor());
}

int64_t FlatGroup::segment_end(size_t i) const {
  return i + 1 < segment_begins_.size() ? segment_begins_[i + 1] : owned_.numel();
}

size_t FlatGroup::segment_index(int64_t begin, int64_t numel) const {
  const auto it = std::lower_bound(segment_begins_.begin(), segment_begins_.end(), begin);
  const size_t i = size_t(it - segment_begins_.begin());
  ZS_CHECK(it != segment_begins_.end() && *it == begin && segment_end(i) - begin == numel,
           "FlatGroup: [", begin, ", ", begin + numel, ") is not one of the gradient segments");
  return i;
}

bool FlatGroup::holds_grad_segment(int64_t begin) const {
  const auto it = std::lower_bound(segment_begins_.begin(), segment_begins_.end(), begin);
  return it != segment_begins_.end() && *it == begin &&
         segments_[size_t(it - segment_begins_.begin())].defined();
}

at::Tensor FlatGroup::grad_segment(int64_t begin, int64_t numel, bool zeroed) {
  at::Tensor& t = segments_[segment_index(begin, numel)];
  if (!t.defined()) {
    t = zeroed ? at::zeros({numel}, device_options_) : at::empty({numel}, device_options_);
    accounted_[1] += t.nbytes();
    memory_.add(MemoryCategory::gradients, t.nbytes());
  }
  return t;
}

std::vector<std::pair<int64_t, at::Tensor>> FlatGroup::grad_pieces() {
  if (!partitioned_) return {{0, owned_grads()}};
  std::vector<std::pair<int64_t, at::Tensor>> pieces;
  for (size_t i = 0; i < segment_begins_.size(); ++i) {
    const int64_t begin = segment_begins_[i];
    pieces.emplace_back(begin, grad_segment(begin, segment_end(i) - begin, true));
  }
  return pieces;
}

void FlatGroup::zero_grads() {
  if (!partitioned_) {
    grads_.zero_();
    return;
  }
  for (auto& t : segments_) t = at::Tensor();
  memory_.release(MemoryCategory::gradients, accounted_[1]);
  accounted_[1] = 0;
}

void FlatGroup::write_tensor(int64_t i, const at::Tensor& full) {
  const at::Tensor flat = full.reshape(-1);
  ZS_CHECK(flat.numel() == layout_.numels[size_t(i)], "FlatGroup::write_tensor: ", flat.numel(),
           " values for tensor ", i, " of ", layout_.numels[size_t(i)], " elements");
  if (!partitioned_) {
    params_.narrow(0, layout_.offsets[size_t(i)], flat.numel()).copy_(flat);
    return;
  }
  const auto piece = owned_piece(i);
  if (!piece) return;
  // Stage 3's owned range starts at the chunk shard's start: buffer offsets index params_ too.
  params_.narrow(0, piece->buffer_begin, piece->numel).copy_(flat.narrow(0, piece->tensor_begin, piece->numel));
}

std::optional<Intersection> FlatGroup::owned_piece(int64_t i) const {
  const size_t t = size_t(i);
  if (partitioned_) {
    const int64_t held = chunks_.held_numel(i, rank_);
    if (held == 0) return std::nullopt;
    return Intersection{i, chunks_.local_offsets[t], rank_ * chunks_.chunks[t], held};
  }
  const int64_t begin = std::max(layout_.offsets[t], owned_.begin);
  const int64_t end = std::min(layout_.offsets[t] + layout_.numels[t], owned_.end);
  if (end <= begin) return std::nullopt;
  return Intersection{i, begin - owned_.begin, begin - layout_.offsets[t], end - begin};
}

at::Tensor FlatGroup::owned_grad_view(int64_t begin, int64_t numel) const {
  if (!partitioned_) return owned_grads().narrow(0, begin, numel);
  const auto it = std::upper_bound(segment_begins_.begin(), segment_begins_.end(), begin);
  const size_t s = size_t(it - segment_begins_.begin()) - 1;
  ZS_CHECK(it != segment_begins_.begin() && begin + numel <= segment_end(s) && segments_[s].defined(),
           "FlatGroup::owned_grad_view: [", begin, ", ", begin + numel, ") is not inside a written segment");
  return segments_[s].narrow(0, begin - segment_begins_[s], numel);
}

void FlatGroup::copy_owned_grads(int64_t begin, int64_t numel, at::Tensor out) const {
  if (!partitioned_) {
    out.copy_(owned_grads().narrow(0, begin, numel));
    return;
  }
  // Stage 3's segments tile the owned range; a tensor's chunk may span several (pieces).
  for (size_t s = 0; s < segment_begins_.size(); ++s) {
    const int64_t from = std::max(begin, segment_begins_[s]);
    const int64_t to = std::min(begin + numel, segment_end(s));
    if (to <= from) continue;
    at::Tensor dst = out.narrow(0, from - begin, to - from);
    if (segments_[s].defined()) {
      dst.copy_(segments_[s].narrow(0, from - segment_begins_[s], to - from));
    } else {
      dst.zero_();
    }
  }
}


}  // namespace zeroshard
