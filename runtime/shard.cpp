// Shard math; see shard.h. Every function here is exercised for all (rank, world, alignment)
// combinations in tests/cpp/runtime/test_shard.cpp.
#include "runtime/shard.h"

#include <algorithm>

#include "runtime/error.h"

namespace zeroshard {

int64_t padded_numel(int64_t numel, int64_t world_size, int64_t alignment_numel) {
  ZS_CHECK(numel >= 0, "padded_numel: numel must be >= 0, got ", numel);
  ZS_CHECK(world_size >= 1, "padded_numel: world_size must be >= 1, got ", world_size);
  ZS_CHECK(alignment_numel >= 1, "padded_numel: alignment_numel must be >= 1, got ", alignment_numel);
  const int64_t unit = world_size * alignment_numel;
  return (numel + unit - 1) / unit * unit;
}

ShardRange shard_range(int64_t padded, int64_t rank, int64_t world_size) {
  ZS_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "shard_range: rank ", rank,
           " is outside world_size ", world_size);
  ZS_CHECK(padded % world_size == 0, "shard_range: padded numel ", padded,
           " is not a multiple of world_size ", world_size);
  const int64_t shard = padded / world_size;
  return {rank * shard, (rank + 1) * shard};
}

FlatLayout make_flat_layout(const std::vector<int64_t>& numels, int64_t world_size,
                            int64_t alignment_numel) {
  FlatLayout layout;
  layout.world_size = world_size;
  layout.numels = numels;
  layout.offsets.reserve(numels.size());
  for (int64_t n : numels) {
    ZS_CHECK(n >= 0, "make_flat_layout: negative numel ", n);
    layout.offsets.push_back(layout.total_numel);
    layout.total_numel += n;
  }
  layout.padded_numel = padded_numel(layout.total_numel, world_size, alignment_numel);
  return layout;
}

std::vector<Intersection> intersect(const FlatLayout& layout, ShardRange range) {
  std::vector<Intersection> out;
  // Offsets are sorted, so start at the last tensor that begins at or before range.begin.
  auto it = std::upper_bound(layout.offsets.begin(), layout.offsets.end(), range.begin);
  size_t i = it == layout.offsets.begin() ? 0 : size_t(it - layout.offsets.begin() - 1);
  for (; i < layout.offsets.size() && layout.offsets[i] < range.end; ++i) {
    const int64_t begin = std::max(layout.offsets[i], range.begin);
    const int64_t end = std::min(layout.offsets[i] + layout.numels[i], range.end);
    if (end > begin) out.push_back({int64_t(i), begin, begin - layout.offsets[i], end - begin});
  }
  return out;
}

ChunkLayout make_chunk_layout(const std::vector<int64_t>& numels, int64_t world_size) {
  ZS_CHECK(world_size >= 1, "make_chunk_layout: world_size must be >= 1, got ", world_size);
  ChunkLayout L;
  L.numels = numels;
  L.world_size = world_size;
  for (int64_t n : numels) {
    ZS_CHECK(n >= 0, "make_chunk_layout: negative numel ", n);
    const int64_t chunk = (n + world_size - 1) / world_size;
    L.chunks.push_back(chunk);
    L.local_offsets.push_back(L.shard_numel);
    L.shard_numel += chunk;
  }
  return L;
}

int64_t ChunkLayout::held_numel(int64_t i, int64_t rank) const {
  const int64_t begin = rank * chunks[size_t(i)];
  return std::max<int64_t>(0, std::min(chunks[size_t(i)], numels[size_t(i)] - begin));
}

}  // namespace zeroshard
