// Flat groups (zero/flat_group.cpp): the pieces of each tensor a rank owns tile the tensor once
// over the ranks and point at its values, at stages 0-2 (a slice of the flat buffer) and stage 3
// (per-tensor chunks), for every world size and rank.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "runtime/memory.h"
#include "zero/flat_group.h"

using namespace zeroshard;

TEST_CASE("owned pieces tile every tensor once over the ranks and hold its values") {
  const std::vector<int64_t> numels = {5, 3, 100, 2, 17};
  std::vector<at::Tensor> params;
  for (int64_t n : numels) params.push_back(at::randn({n}));
  for (bool partitioned : {false, true}) {
    for (int64_t world = 1; world <= 4; ++world) {
      std::vector<std::vector<int>> hits(numels.size());
      for (size_t i = 0; i < numels.size(); ++i) hits[i].assign(size_t(numels[i]), 0);
      for (int64_t rank = 0; rank < world; ++rank) {
        GroupSpec spec;
        spec.world_size = world;
        spec.rank = rank;
        spec.shard_state = true;
        spec.full_grads = false;
        spec.partition_params = partitioned;
        MemoryAccount memory;
        FlatGroup g(params, spec, memory);
        for (size_t i = 0; i < numels.size(); ++i) {
          if (const auto piece = g.owned_piece(int64_t(i))) {
            const Intersection& p = *piece;
            REQUIRE(p.numel > 0);
            REQUIRE(p.buffer_begin + p.numel <= g.owned().numel());
            REQUIRE(at::equal(g.master().narrow(0, p.buffer_begin, p.numel),
                              params[i].narrow(0, p.tensor_begin, p.numel)));
            for (int64_t e = p.tensor_begin; e < p.tensor_begin + p.numel; ++e) ++hits[i][size_t(e)];
            // Gradients not written yet read as zeros (stage 3 allocates no segment for it).
            at::Tensor out = at::full({p.numel}, 7.0f);
            g.copy_owned_grads(p.buffer_begin, p.numel, out);
            REQUIRE(out.abs().sum().item<float>() == 0.0f);
          }
        }
      }
      for (size_t i = 0; i < numels.size(); ++i) {
        for (int h : hits[i]) REQUIRE(h == 1);
      }
    }
  }
}
