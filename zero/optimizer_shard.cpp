// Optimizer shards; see optimizer_shard.h.
#include "zero/optimizer_shard.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "runtime/error.h"

namespace zeroshard {

OptimizerShard::OptimizerShard(std::vector<ShardPart> parts, std::vector<SubGroup> sub_groups,
                               const OptimizerRow& row, double state_init, MemoryAccount& memory)
    : parts_(std::move(parts)),
      sub_groups_(std::move(sub_groups)),
      row_(row),
      state_init_(state_init),
      memory_(memory) {
  for (const ShardPart& p : parts_) {
    ZS_CHECK(p.begin == numel_ && p.master.defined() && p.master.scalar_type() == at::kFloat &&
                 p.master.dim() == 1 && p.master.numel() == p.numel,
             "OptimizerShard: the parts must tile the owned range with flat fp32 masters");
    numel_ += p.numel;
    if (!p.shares_model_copy) memory_.add(category(p, MemoryCategory::master_weights), p.master.nbytes());
    if (p.swapped) resident_ = 1;  // seeded in host memory, then written out (end_resident)
  }
  for (const SubGroup& sg : sub_groups_) part(sg.begin, sg.numel);  // each inside one part
}

OptimizerShard::~OptimizerShard() {
  drop_state();
  for (ShardPart& p : parts_) {
    if (p.swapped) {
      free_resident(p);
    } else if (!p.shares_model_copy) {
      memory_.release(category(p, MemoryCategory::master_weights), p.master.nbytes());
    }
  }
}

MemoryCategory OptimizerShard::category(const ShardPart& p, MemoryCategory device_category) const {
  return p.residency != Residency::device ? host_category(device_category) : device_category;
}

const ShardPart& OptimizerShard::part(int64_t begin, int64_t numel) const {
  for (const ShardPart& p : parts_) {
    if (p.begin <= begin && begin + numel <= p.begin + p.numel) return p;
  }
  throw Error(detail::cat("OptimizerShard: range [", begin, ", ", begin + numel,
                          ") is not inside one residency part of the owned range (", numel_, ")"));
}

ShardPart& OptimizerShard::part_mut(int64_t begin, int64_t numel) {
  return const_cast<ShardPart&>(part(begin, numel));
}

at::Tensor OptimizerShard::master(int64_t begin, int64_t numel) const {
  const ShardPart& p = part(begin, numel);
  ZS_CHECK(p.master.defined(), "OptimizerShard::master: [", begin, ", ", begin + numel,
           ") is on NVMe and the shard is not resident");
  return p.master.narrow(0, begin - p.begin, numel);
}

at::Tensor OptimizerShard::state(size_t slot, int64_t begin, int64_t numel) {
  create_state();
  ShardPart& p = part_mut(begin, numel);
  ZS_CHECK(!p.state.empty(), "OptimizerShard::state: [", begin, ", ", begin + numel,
           ") is on NVMe and the shard is not resident");
  return p.state.at(slot).narrow(0, begin - p.begin, numel);
}

at::Tensor OptimizerShard::master_values() {
  make_resident();
  std::vector<at::Tensor> pieces;
  for (const ShardPart& p : parts_) pieces.push_back(p.master.cpu().clone());
  end_resident(false);
  return pieces.size() == 1 ? pieces[0] : at::cat(pieces);
}

void OptimizerShard::add_state(ShardPart& p) {
  for (size_t i = 0; i < row_.state_names.size(); ++i) {
    p.state.push_back(at::full({p.numel}, state_init_, p.master.options().pinned_memory(false)));
    memory_.add(category(p, MemoryCategory::optimizer_state), p.state.back().nbytes());
  }
}

void OptimizerShard::create_state() {
  if (has_state_) return;
  for (ShardPart& p : parts_) {
    // A non-resident NVMe part's state is created where it lives: its first read fills it.
    if (p.master.defined()) add_state(p);
  }
  has_state_ = true;
}

void OptimizerShard::drop_state() {
  for (ShardPart& p : parts_) {
    for (const at::Tensor& s : p.state) memory_.release(category(p, MemoryCategory::optimizer_state), s.nbytes());
    p.state.clear();
    if (p.swapped) p.swapped->forget_state();
  }
  has_state_ = false;
}

void OptimizerShard::through_sub_groups(
    const ShardPart& p, int64_t begin, int64_t numel, bool write,
    const std::function<void(const SubGroup&, at::Tensor&, std::vector<at::Tensor>&)>& visit) {
  for (const SubGroup& sg : sub_groups_) {
    if (sg.begin + sg.numel <= begin || sg.begin >= begin + numel) continue;
    if (sg.begin < p.begin || sg.begin >= p.begin + p.numel) continue;
    at::Tensor master = at::empty({sg.numel}, at::kFloat);
    std::vector<at::Tensor> state;
    for (size_t i = 0; has_state_ && i < row_.state_names.size(); ++i) state.push_back(at::empty({sg.numel}, at::kFloat));
    p.swapped->load(sg.begin, master, state, state_init_);
    visit(sg, master, state);
    if (write) p.swapped->store(sg.begin, master, state);
  }
}

at::Tensor OptimizerShard::read_values(int64_t slot, int64_t begin, int64_t numel) {
  const ShardPart& p = part(begin, numel);
  if (!p.swapped || resident()) {
    return (slot < 0 ? master(begin, numel) : state(size_t(slot), begin, numel)).clone();
  }
  if (slot >= 0 && !has_state_) return at::full({numel}, state_init_, at::kFloat);
  at::Tensor out = at::empty({numel}, at::kFloat);
  through_sub_groups(p, begin, numel, false, [&](const SubGroup& sg, at::Tensor& m, std::vector<at::Tensor>& st) {
    const int64_t lo = std::max(begin, sg.begin), hi = std::min(begin + numel, sg.begin + sg.numel);
    const at::Tensor& from = slot < 0 ? m : st.at(size_t(slot));
    out.narrow(0, lo - begin, hi - lo).copy_(from.narrow(0, lo - sg.begin, hi - lo));
  });
  return out;
}

void OptimizerShard::write_values(int64_t slot, int64_t begin, int64_t numel, const at::Tensor& values) {
  if (slot >= 0) create_state();  // now when no step has created it yet
  const ShardPart& p = part(begin, numel);
  if (!p.swapped || resident()) {
    (slot < 0 ? master(begin, numel) : state(size_t(slot), begin, numel)).copy_(values);
    return;
  }
  through_sub_groups(p, begin, numel, true, [&](const SubGroup& sg, at::Tensor& m, std::vector<at::Tensor>& st) {
    const int64_t lo = std::max(begin, sg.begin), hi = std::min(begin + numel, sg.begin + sg.numel);
    at::Tensor& to = slot < 0 ? m : st.at(size_t(slot));
    to.narrow(0, lo - sg.begin, hi - lo).copy_(values.narrow(0, lo - begin, hi - lo));
  });
}

bool OptimizerShard::swapped_anywhere() const {
  return std::any_of(parts_.begin(), parts_.end(), [](const ShardPart& p) { return p.swapped != nullptr; });
}

void OptimizerShard::make_resident() {
  if (!swapped_anywhere()) return;  // nothing to bring in, and nothing to count
  if (resident_ > 0) {
    ++resident_;
    return;
  }
  // Read into new tensors, kept only when every read succeeded: a failed read leaves the shard
  // as it was (not resident), never holding tensors that were never filled.
  std::vector<std::pair<at::Tensor, std::vector<at::Tensor>>> loaded;
  for (ShardPart& p : parts_) {
    if (!p.swapped) continue;
    at::Tensor master = at::empty({p.numel}, at::kFloat);
    std::vector<at::Tensor> state;
    for (size_t i = 0; has_state_ && i < row_.state_names.size(); ++i) state.push_back(at::empty({p.numel}, at::kFloat));
    for (const SubGroup& sg : sub_groups_) {
      if (sg.begin < p.begin || sg.begin >= p.begin + p.numel) continue;
      std::vector<at::Tensor> pieces;
      for (const at::Tensor& s : state) pieces.push_back(s.narrow(0, sg.begin - p.begin, sg.numel));
      p.swapped->load(sg.begin, master.narrow(0, sg.begin - p.begin, sg.numel), pieces, state_init_);
    }
    loaded.emplace_back(std::move(master), std::move(state));
  }
  size_t next = 0;
  for (ShardPart& p : parts_) {
    if (!p.swapped) continue;
    auto& [master, state] = loaded[next++];
    p.master = std::move(master);
    memory_.add(category(p, MemoryCategory::master_weights), p.master.nbytes());
    for (at::Tensor& s : state) {
      memory_.add(category(p, MemoryCategory::optimizer_state), s.nbytes());
      p.state.push_back(std::move(s));
    }
  }
  resident_ = 1;
}

void OptimizerShard::end_resident(bool written) {
  if (!swapped_anywhere()) return;
  ZS_CHECK(resident_ > 0, "OptimizerShard::end_resident without make_resident");
  resident_written_ = resident_written_ || written;
  if (--resident_ > 0) return;
  const bool write = resident_written_;
  resident_written_ = false;
  for (ShardPart& p : parts_) {
    if (!p.swapped) continue;
    if (write) {
      for (const SubGroup& sg : sub_groups_) {
        if (sg.begin < p.begin || sg.begin >= p.begin + p.numel) continue;
        std::vector<at::Tensor> state;
        for (const at::Tensor& s : p.state) state.push_back(s.narrow(0, sg.begin - p.begin, sg.numel));
        p.swapped->store(sg.begin, p.master.narrow(0, sg.begin - p.begin, sg.numel), state);
      }
    }
    free_resident(p);
  }
}

void OptimizerShard::free_resident(ShardPart& p) {
  if (p.master.defined()) memory_.release(category(p, MemoryCategory::master_weights), p.master.nbytes());
  for (const at::Tensor& s : p.state) memory_.release(category(p, MemoryCategory::optimizer_state), s.nbytes());
  p.master = at::Tensor();
  p.state.clear();
}

int64_t OptimizerShard::slot(const std::string& what) const {
  if (what == "fp32_param") return -1;
  const auto& names = row_.state_names;
  const auto it = std::find(names.begin(), names.end(), what);
  if (it == names.end()) {
    std::string allowed;
    for (const auto& n : names) allowed += (allowed.empty() ? "" : ", ") + n;
    throw UsageError(detail::cat("optim_state_key: got \"", what, "\", expected one of ", allowed,
                                 " (the state of ", row_.types.front(), ")"));
  }
  return it - names.begin();
}

void write_tensor_values(FlatGroup& storage, OptimizerShard* shard, int64_t i, const at::Tensor& full) {
  storage.write_tensor(i, full);
  if (!shard) return;
  if (const auto piece = storage.owned_piece(i)) {
    if (shard->shares_model_copy(piece->buffer_begin, piece->numel)) return;
    shard->write_values(-1, piece->buffer_begin, piece->numel,
                        full.reshape(-1).narrow(0, piece->tensor_begin, piece->numel));
  }
}

std::vector<int64_t> owned_piece_begins(const FlatGroup& storage) {
  std::vector<int64_t> begins;
  for (int64_t i = 0; i < storage.num_tensors(); ++i) {
    if (const auto piece = storage.owned_piece(i)) begins.push_back(piece->buffer_begin);
  }
  std::sort(begins.begin(), begins.end());
  begins.erase(std::unique(begins.begin(), begins.end()), begins.end());
  return begins;
}

std::unique_ptr<OptimizerShard> make_shard(const FlatGroup& storage, const std::vector<at::Tensor>& values,
                                           const std::vector<ChunkedShape>& prechunked,
                                           const OptimizerConfig& config, std::vector<SubGroup> sub_groups,
                                           const HostPool& pool, MemoryAccount& memory,
                                           SwapSpace* swap, const std::string& swap_name) {
  const OptimizerRow& row = optimizer_row(config.type);
  const double init = row.state_init(config);
  const at::Tensor owned = storage.owned_params();
  const int64_t numel = owned.numel();
  const int64_t split = host_split(sub_groups, numel);
  std::vector<ShardPart> parts;
  const Residency offloaded = swap ? Residency::nvme : Residency::host;
  for (const auto& [begin, end, residency] : {std::tuple{int64_t(0), split, Residency::device},
                                              std::tuple{split, numel, offloaded}}) {
    if (end == begin && !(numel == 0 && residency == Residency::device)) continue;
    ShardPart p;
    p.begin = begin;
    p.numel = end - begin;
    p.residency = residency;
    // The fp32 model copy is the master only where both live in the same place.
    if (residency == Residency::device && owned.scalar_type() == at::kFloat && !storage.params_on_host()) {
      p.shares_model_copy = true;
      p.master = owned.narrow(0, begin, p.numel);
    } else {
      // Zero-filled so padding never carries garbage into norms.
      p.master = residency == Residency::host ? pool.allocate_zeros(p.numel, at::kFloat)
                 : residency == Residency::nvme ? at::zeros({p.numel}, at::kFloat)  // resident until written out
                                                : at::zeros({p.numel}, storage.device_options().dtype(at::kFloat));
    }
    if (residency == Residency::nvme) {
      std::vector<SubGroup> mine;
      for (const SubGroup& sg : sub_groups) {
        if (sg.begin >= begin && sg.begin < end) mine.push_back(sg);
      }
      p.swapped = std::make_unique<SwappedPart>(*swap, swap_name, mine, optimizer_row(config.type).state_names.size());
    }
    parts.push_back(std::move(p));
  }
  auto shard = std::make_unique<OptimizerShard>(std::move(parts), std::move(sub_groups), row, init, memory);
  ZS_CHECK(int64_t(values.size()) == storage.num_tensors(), "make_shard: ", values.size(),
           " values for ", storage.num_tensors(), " tensors");
  for (int64_t i = 0; i < storage.num_tensors(); ++i) {
    const auto piece = storage.owned_piece(i);
    if (!piece || shard->shares_model_copy(piece->buffer_begin, piece->numel)) continue;
    const bool chunk = !prechunked.empty() && prechunked[size_t(i)].has_value();
    // A chunk passed in (zero.Init) starts at this rank's first element of the tensor.
    const int64_t from = chunk ? 0 : piece->tensor_begin;
    shard->master(piece->buffer_begin, piece->numel)
        .copy_(values[size_t(i)].reshape(-1).narrow(0, from, piece->numel));
  }
  return shard;
}

}  // namespace zeroshard
