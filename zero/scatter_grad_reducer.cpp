// Stage 3's chunked reduce-scatter of staged buckets; see scatter_grad_reducer.h.
#include "zero/scatter_grad_reducer.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "kernels/ops.h"

namespace zeroshard {

ScatterGradReducer::ScatterGradReducer(const std::vector<FlatGroup*>& groups,
                                       std::shared_ptr<Comm> comm, const ReduceOptions& options,
                                       MemoryAccount& memory)
    : StagedReducer(groups, std::move(comm), options, memory) {
  const int64_t world = comm_->world_size();
  for (const BucketSpec& spec : plan_.buckets) {
    const ChunkLayout& L = groups_[size_t(spec.group)]->chunk_layout();
    const int64_t begin = L.local_offsets[size_t(spec.first_param)];
    const size_t last = size_t(spec.end_param - 1);
    const int64_t local = L.local_offsets[last] + L.chunks[last] - begin;  // chunks per rank
    // A parameter larger than a bucket: pieces of its chunk, world parts of them per bucket.
    const int64_t step = spec.numel > opt_.bucket_numel ? std::max<int64_t>(1, opt_.bucket_numel / world)
                                                        : local;
    for (int64_t at = 0; at < local; at += step) {
      Bucket b;
      b.spec = spec;
      b.local_begin = begin + at;
      b.local_numel = std::min(step, local - at);
      b.staged_numel = b.local_numel * world;
      add_bucket(std::move(b));
    }
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
  const int64_t chunk = L.chunks[size_t(t)];
  const at::Tensor flat = grad.reshape(-1);
  // The elements of each rank's chunk that this bucket holds: all, or one piece.
  const int64_t from = std::max<int64_t>(0, b.local_begin - L.local_offsets[size_t(t)]);
  const int64_t to = std::min(chunk, b.local_begin + b.local_numel - L.local_offsets[size_t(t)]);
  const int64_t into = L.local_offsets[size_t(t)] + from - b.local_begin;
  for (int64_t r = 0; r < comm_->world_size(); ++r) {
    const int64_t n = std::min(to, L.held_numel(t, r)) - from;
    if (n > 0) staging.narrow(0, r * b.local_numel + into, n).copy_(flat.narrow(0, r * chunk + from, n));
  }
}

CommWork ScatterGradReducer::reduce(const Bucket&, at::Tensor staging, const std::string& what) {
  return comm_->reduce_scatter_in_place(staging, what);
}

std::pair<int64_t, int64_t> ScatterGradReducer::accumulate(const Bucket& b, const at::Tensor& reduced,
                                                           double scale) {
  FlatGroup& g = *groups_[size_t(b.spec.group)];
  const at::Tensor part = reduced.narrow(0, comm_->rank() * b.local_numel, b.local_numel);
  if (g.holds_grad_segment(b.local_begin)) {  // an earlier micro-step's gradients: accumulate
    // Mixed dtypes add in the wider one, rounding once into the shard's.
    ops::add_scaled_(g.grad_segment(b.local_begin, b.local_numel, true), part, scale);
  } else {  // the first in this window: written whole, so not zero-filled first
    ops::scale_copy(g.grad_segment(b.local_begin, b.local_numel, false), part, scale);
  }
  return {b.local_begin, b.local_numel};
}

}  // namespace zeroshard
