// Shard math (runtime/shard.cpp) for every (rank, world, alignment) combination in one process.
#include <catch2/catch.hpp>

#include <numeric>

#include "runtime/error.h"
#include "runtime/shard.h"

using namespace zeroshard;

TEST_CASE("padded_numel rounds up to world_size * alignment") {
  CHECK(padded_numel(0, 4, 16) == 0);
  CHECK(padded_numel(1, 4, 16) == 64);
  CHECK(padded_numel(64, 4, 16) == 64);
  CHECK(padded_numel(65, 4, 16) == 128);
  CHECK(padded_numel(7, 1, 1) == 7);
  CHECK_THROWS_AS(padded_numel(-1, 2, 16), Error);
  CHECK_THROWS_AS(padded_numel(10, 0, 16), Error);
  CHECK_THROWS_AS(padded_numel(10, 2, 0), Error);
}

TEST_CASE("shards tile the padded buffer for every rank, world and alignment") {
  const std::vector<std::vector<int64_t>> shapes = {
      {1}, {17}, {5, 3, 1000, 2}, {64, 64, 1}, {0, 9, 0, 31}, {1000003}};
  for (int64_t world = 1; world <= 8; ++world) {
    for (int64_t align : {1, 2, 16, 128}) {
      for (const auto& numels : shapes) {
        const FlatLayout L = make_flat_layout(numels, world, align);
        const int64_t total = std::accumulate(numels.begin(), numels.end(), int64_t(0));
        REQUIRE(L.total_numel == total);
        REQUIRE(L.padded_numel >= total);
        REQUIRE(L.padded_numel % (world * align) == 0);
        REQUIRE(L.padded_numel - total < world * align);
        // Every element of every tensor is owned by exactly one rank, at the right coordinates.
        std::vector<int> owners(size_t(total), 0);
        int64_t covered_padding = 0;
        for (int64_t rank = 0; rank < world; ++rank) {
          const ShardRange r = shard_range(L.padded_numel, rank, world);
          REQUIRE(r.numel() == L.shard_numel());
          REQUIRE(r.begin % align == 0);
          int64_t in_tensors = 0;
          for (const Intersection& x : intersect(L, r)) {
            REQUIRE(x.numel > 0);
            REQUIRE(x.buffer_begin == L.offsets[size_t(x.index)] + x.tensor_begin);
            REQUIRE(x.buffer_begin >= r.begin);
            REQUIRE(x.buffer_begin + x.numel <= r.end);
            REQUIRE(x.tensor_begin + x.numel <= L.numels[size_t(x.index)]);
            for (int64_t k = 0; k < x.numel; ++k) ++owners[size_t(x.buffer_begin + k)];
            in_tensors += x.numel;
          }
          covered_padding += r.numel() - in_tensors;
        }
        for (int n : owners) REQUIRE(n == 1);
        REQUIRE(covered_padding == L.padded_numel - total);
      }
    }
  }
}

TEST_CASE("shard_range rejects ranks outside the world") {
  CHECK_THROWS_AS(shard_range(64, 4, 4), Error);
  CHECK_THROWS_AS(shard_range(64, -1, 4), Error);
  CHECK_THROWS_AS(shard_range(63, 0, 4), Error);
}

TEST_CASE("chunk layouts give every element of every tensor to exactly one rank") {
  for (int64_t world = 1; world <= 8; ++world) {
    const std::vector<int64_t> numels = {1, 7, 0, 64, 1001, 3};
    const ChunkLayout L = make_chunk_layout(numels, world);
    int64_t offset = 0;
    for (size_t i = 0; i < numels.size(); ++i) {
      REQUIRE(L.local_offsets[i] == offset);
      REQUIRE(L.chunks[i] * world >= numels[i]);
      REQUIRE(L.chunks[i] * world - numels[i] < world);
      int64_t held = 0;
      for (int64_t r = 0; r < world; ++r) {
        REQUIRE(L.held_numel(int64_t(i), r) <= L.chunks[i]);
        held += L.held_numel(int64_t(i), r);
      }
      REQUIRE(held == numels[i]);
      offset += L.chunks[i];
    }
    REQUIRE(L.shard_numel == offset);
  }
}
