// Shard math for flat buffers: where each tensor lives in a padded flat buffer, which contiguous
// slice each rank owns, and how a rank's slice intersects each tensor. Pure functions, no Torch.
#pragma once
#include <cstdint>
#include <vector>

namespace zeroshard {

// Rounds numel up so the buffer splits into world_size equal shards that each start on an
// alignment_numel boundary (collectives and vector kernels want aligned starts).
int64_t padded_numel(int64_t numel, int64_t world_size, int64_t alignment_numel);

struct ShardRange {
  int64_t begin;  // offset into the flat buffer, inclusive
  int64_t end;    // exclusive
  int64_t numel() const { return end - begin; }
};

// Rank r of world_size owns [r*S, (r+1)*S) of a buffer of padded_numel elements.
ShardRange shard_range(int64_t padded_numel, int64_t rank, int64_t world_size);

// Tensors packed one after another (no gaps; the padding sits at the end of the buffer).
struct FlatLayout {
  std::vector<int64_t> offsets;  // start of tensor i in the flat buffer
  std::vector<int64_t> numels;
  int64_t total_numel = 0;       // sum of numels
  int64_t padded_numel = 0;      // total rounded up for world_size and alignment
  int64_t world_size = 1;
  int64_t shard_numel() const { return padded_numel / world_size; }
};

FlatLayout make_flat_layout(const std::vector<int64_t>& numels, int64_t world_size,
                            int64_t alignment_numel);

// The part of tensor `index` that falls inside `range`, both in buffer and in tensor coordinates.
struct Intersection {
  int64_t index;          // tensor index in the layout
  int64_t buffer_begin;   // in flat-buffer coordinates
  int64_t tensor_begin;   // offset inside the tensor
  int64_t numel;
};

// Every tensor that overlaps `range`, in layout order; empty slices are left out.
std::vector<Intersection> intersect(const FlatLayout& layout, ShardRange range);

}  // namespace zeroshard
