// Optimizer shards; see optimizer_shard.h.
#include "zero/optimizer_shard.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "runtime/error.h"

namespace zeroshard {

OptimizerShard::OptimizerShard(at::Tensor master, bool shares_model_copy, const OptimizerRow& row,
                               double state_init, MemoryAccount& memory)
    : master_(std::move(master)),
      shares_model_copy_(shares_model_copy),
      row_(row),
      state_init_(state_init),
      memory_(memory) {
  ZS_CHECK(master_.defined() && master_.scalar_type() == at::kFloat && master_.dim() == 1,
           "OptimizerShard: the master values must be a flat fp32 tensor");
  if (!shares_model_copy_) {
    master_bytes_ = master_.nbytes();
    memory_.add(MemoryCategory::master_weights, master_bytes_);
  }
}

OptimizerShard::~OptimizerShard() {
  memory_.release(MemoryCategory::master_weights, master_bytes_);
  memory_.release(MemoryCategory::optimizer_state, state_bytes_);
}

std::vector<at::Tensor>& OptimizerShard::state() {
  if (state_.empty()) {
    for (size_t i = 0; i < row_.state_names.size(); ++i) {
      state_.push_back(at::full({master_.numel()}, state_init_, master_.options()));
      state_bytes_ += state_.back().nbytes();
    }
    memory_.add(MemoryCategory::optimizer_state, state_bytes_);
  }
  return state_;
}

void OptimizerShard::drop_state() {
  state_.clear();
  memory_.release(MemoryCategory::optimizer_state, state_bytes_);
  state_bytes_ = 0;
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
  if (!shard || shard->shares_model_copy()) return;
  if (const auto piece = storage.owned_piece(i)) {
    shard->master().narrow(0, piece->buffer_begin, piece->numel)
        .copy_(full.reshape(-1).narrow(0, piece->tensor_begin, piece->numel));
  }
}

std::unique_ptr<OptimizerShard> make_shard(const FlatGroup& storage, const std::vector<at::Tensor>& values,
                                           const std::vector<ChunkedShape>& prechunked,
                                           const OptimizerConfig& config, MemoryAccount& memory) {
  const OptimizerRow& row = optimizer_row(config.type);
  const double init = row.state_init(config);
  const at::Tensor owned = storage.owned_params();
  if (owned.scalar_type() == at::kFloat) {
    return std::make_unique<OptimizerShard>(owned, true, row, init, memory);
  }
  ZS_CHECK(int64_t(values.size()) == storage.num_tensors(), "make_shard: ", values.size(),
           " values for ", storage.num_tensors(), " tensors");
  // Zero-filled so padding never carries garbage into norms.
  at::Tensor master = at::zeros({owned.numel()}, owned.options().dtype(at::kFloat));
  for (int64_t i = 0; i < storage.num_tensors(); ++i) {
    const auto piece = storage.owned_piece(i);
    if (!piece) continue;
    const bool chunk = !prechunked.empty() && prechunked[size_t(i)].has_value();
    // A chunk passed in (zero.Init) starts at this rank's first element of the tensor.
    const int64_t from = chunk ? 0 : piece->tensor_begin;
    master.narrow(0, piece->buffer_begin, piece->numel)
        .copy_(values[size_t(i)].reshape(-1).narrow(0, from, piece->numel));
  }
  return std::make_unique<OptimizerShard>(master, false, row, init, memory);
}

}  // namespace zeroshard
