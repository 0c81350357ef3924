// Stage 3's chunked reduce-scatter of staged buckets; see scatter_grad_reducer.h.
#include "zero/scatter_grad_reducer.h"

#include <ATen/ATen.h>

#include "kernels/ops.h"

namespace zeroshard {

ScatterGradReducer::ScatterGradReducer(const std::vector<FlatGroup*>& groups,
                                       std::shared_ptr<Comm> comm, const ReduceOptions& options,
                                       MemoryAccount& memory)
    : StagedReducer(groups, std::move(comm), options, memory) {
  for (const BucketSpec& spec : plan_.buckets) {
    const ChunkLayout& L = groups_[size_t(spec.group)]->chunk_layout();
    Bucket b;
    b.spec = spec;
    b.local_begin = L.local_offsets[size_t(spec.first_param)];
    const size_t last = size_t(spec.end_param - 1);
    b.local_numel = L.local_offsets[last] + L.chunks[last] - b.local_begin;  // chunks per rank
    b.staged_numel = b.local_numel * comm_->world_size();
    add_bucket(std::move(b));
  }
  // Each bucket's part of the gradient shard is a segment of its own, allocated when the bucket
  // is first reduced (see FlatGroup::segment_grads).
  std::vector<std::vector<int64_t>> begins(groups_.size());
  for (const Bucket& b : buckets()) begins[size_t(b.spec.group)].push_back(b.local_begin);
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!begins[g].empty()) groups_[g]->segment_grads(begins[g]);
  }
}

void ScatterGradReducer::stage(const Bucket& b, at::Tensor staging, int64_t index,
                               const at::Tensor& grad) {
  const ChunkLayout& L = groups_[size_t(b.spec.group)]->chunk_layout();
  const int64_t t = index - group_base_[size_t(b.spec.group)];
  const at::Tensor flat = grad.reshape(-1);
  const int64_t into = L.local_offsets[size_t(t)] - b.local_begin;
  for (int64_t r = 0; r < comm_->world_size(); ++r) {
    const int64_t held = L.held_numel(t, r);
    if (held > 0) {
      staging.narrow(0, r * b.local_numel + into, held)
          .copy_(flat.narrow(0, r * L.chunks[size_t(t)], held));
    }
  }
}

CommWork ScatterGradReducer::reduce(const Bucket&, at::Tensor staging, const std::string& what) {
  return comm_->reduce_scatter_in_place(staging, what);
}

void ScatterGradReducer::accumulate(const Bucket& b, const at::Tensor& reduced, double scale) {
  FlatGroup& g = *groups_[size_t(b.spec.group)];
  const at::Tensor part = reduced.narrow(0, comm_->rank() * b.local_numel, b.local_numel);
  if (g.holds_grad_segment(b.local_begin)) {  // an earlier micro-step's gradients: accumulate
    // Mixed dtypes add in the wider one, rounding once into the shard's.
    g.grad_segment(b.local_begin, b.local_numel, true).add_(part, scale);
  } else {  // the first in this window: written whole, so not zero-filled first
    ops::scale_copy(g.grad_segment(b.local_begin, b.local_numel, false), part, scale);
  }
}

}  // namespace zeroshard
