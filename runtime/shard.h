// Shard math for flat buffers: where each tensor lives in a padded flat buffer, which contiguous
// slice each rank owns, and how a rank's slice intersects each tensor. Pure functions, no Torch.
#pragma once
#include <cstdint>
#include <vector>

namespace zeroshard {

// Shard starts aligned to 16 elements: 64 bytes of fp32, so vector kernels start on a cache line.
// Every flat group's layout is make_flat_layout(numels, world_size, kAlignmentNumel).
constexpr int64_t kAlignmentNumel = 16;

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

// ZeRO-3 partitions each tensor on its own: tensor i is split into world_size chunks of
// ceil(numel_i / world_size) elements, rank r holding elements [r*chunk_i, (r+1)*chunk_i) (the last
// chunks padded). A rank stores its chunks of every tensor back to back, so its shard is
// contiguous and the chunks of consecutive tensors can be gathered or reduce-scattered together.
struct ChunkLayout {
  std::vector<int64_t> numels;
  std::vector<int64_t> chunks;          // chunk size of tensor i
  std::vector<int64_t> local_offsets;   // start of tensor i's chunk in every rank's shard
  int64_t shard_numel = 0;              // sum of chunks: every rank's shard has this size
  int64_t world_size = 1;
  // How many of tensor i's elements rank r really holds (the rest of its chunk is padding).
  int64_t held_numel(int64_t i, int64_t rank) const;
};

ChunkLayout make_chunk_layout(const std::vector<int64_t>& numels, int64_t world_size);

}  // namespace zeroshard
