// Flat groups (zero/flat_group.cpp) and their optimizer shards (zero/optimizer_shard.cpp): the
// pieces of each tensor a rank owns tile the tensor once over the ranks and point at its values,
// at stages 0-2 (a slice of the flat buffer) and stage 3 (per-tensor chunks), for every world size
// and rank; the shard's master holds the caller's fp32 values of those pieces.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include "runtime/memory.h"
#include "zero/flat_group.h"
#include "zero/full_values.h"
#include "zero/optimizer_shard.h"

using namespace zeroshard;

// ZeRO-2 (sharded master, state and gradients) or ZeRO-3 (partitioned too) for one rank.
static GroupSpec sharded_spec(int64_t world, int64_t rank, bool partitioned) {
  GroupSpec spec;
  spec.world_size = world;
  spec.rank = rank;
  spec.shard_state = true;
  spec.full_grads = false;
  spec.partition_params = partitioned;
  return spec;
}

static OptimizerConfig adam() {
  OptimizerConfig c;
  c.present = true;
  c.type = "Adam";
  return c;
}

// g's shard with one sub-group per tensor piece, all on the device (host_ratio 0) or all in host
// memory (host_ratio 1, offload_optimizer).
static std::unique_ptr<OptimizerShard> shard_of(const FlatGroup& g, const std::vector<at::Tensor>& params,
                                                MemoryAccount& memory, double host_ratio = 0.0) {
  auto plan = plan_sub_groups({owned_piece_begins(g)}, {g.owned().numel()}, 1, host_ratio);
  return make_shard(g, params, {}, adam(), std::move(plan[0]), HostPool(false, c10::Device(at::kCPU), memory),
                    memory);
}

TEST_CASE("owned pieces tile every tensor once over the ranks and hold its values") {
  const std::vector<int64_t> numels = {5, 3, 100, 2, 17};
  std::vector<at::Tensor> params;
  for (int64_t n : numels) params.push_back(at::randn({n}));
  const std::pair<bool, at::ScalarType> cases[] = {
      {false, at::kFloat}, {false, at::kBFloat16}, {true, at::kFloat}, {true, at::kBFloat16}};
  for (const auto& [partitioned, dtype] : cases) {
    for (int64_t world = 1; world <= 4; ++world) {
      std::vector<std::vector<int>> hits(numels.size());
      for (size_t i = 0; i < numels.size(); ++i) hits[i].assign(size_t(numels[i]), 0);
      for (int64_t rank = 0; rank < world; ++rank) {
       for (const double host_ratio : {0.0, 1.0}) {
        GroupSpec spec = sharded_spec(world, rank, partitioned);
        spec.model_dtype = dtype;
        MemoryAccount memory;
        FlatGroup g(params, spec, memory);
        const auto shard = shard_of(g, params, memory, host_ratio);
        // fp32 training on the device keeps one copy: the master is the model copy's owned
        // slice. Offloaded, the master is a host copy of its own.
        const bool shared = dtype == at::kFloat && host_ratio == 0.0;
        REQUIRE(shard->shares_model_copy(0, g.owned().numel()) == shared);
        REQUIRE(memory.bytes(MemoryCategory::master_weights) ==
                (shared || host_ratio == 1.0 ? 0 : g.owned().numel() * 4));
        REQUIRE(memory.bytes(MemoryCategory::host_master_weights) == (host_ratio == 1.0 ? g.owned().numel() * 4 : 0));
        for (size_t i = 0; i < numels.size(); ++i) {
          if (const auto piece = g.owned_piece(int64_t(i))) {
            const Intersection& p = *piece;
            REQUIRE(p.numel > 0);
            REQUIRE(p.buffer_begin + p.numel <= g.owned().numel());
            REQUIRE(at::equal(shard->master(p.buffer_begin, p.numel),
                              params[i].narrow(0, p.tensor_begin, p.numel)));
            if (host_ratio == 0.0) {
              for (int64_t e = p.tensor_begin; e < p.tensor_begin + p.numel; ++e) ++hits[i][size_t(e)];
            }
            // Gradients not written yet read as zeros (stage 3 allocates no segment for it).
            at::Tensor out = at::full({p.numel}, 7.0f);
            g.copy_owned_grads(p.buffer_begin, p.numel, out);
            REQUIRE(out.abs().sum().item<float>() == 0.0f);
          }
        }
       }
      }
      for (size_t i = 0; i < numels.size(); ++i) {
        for (int h : hits[i]) REQUIRE(h == 1);
      }
    }
  }
}

TEST_CASE("write_tensor_values puts one tensor's values in the parameters and the owned master copy") {
  const std::vector<int64_t> numels = {5, 3, 100, 2, 17};
  std::vector<at::Tensor> params;
  for (int64_t n : numels) params.push_back(at::randn({n}));
  const at::Tensor values = at::randn({100}) * 3;
  // Stage 0 in fp32 (every rank owns everything; the master values are the parameters), and
  // stages 2 (its master offloaded to host memory) and 3 in bf16.
  for (int stage : {0, 2, 3}) {
    const bool partitioned = stage == 3;
    for (int64_t rank = 0; rank < 3; ++rank) {
      GroupSpec spec = sharded_spec(3, rank, partitioned);
      if (stage == 0) {
        spec.shard_state = false;
        spec.full_grads = true;
      } else {
        spec.model_dtype = at::kBFloat16;
      }
      MemoryAccount memory;
      FlatGroup g(params, spec, memory);
      const auto shard = shard_of(g, params, memory, stage == 2 ? 1.0 : 0.0);
      const at::Tensor before = g.params().clone();
      const at::Tensor master_before = shard->master_values().clone();
      write_tensor_values(g, shard.get(), 2, values);
      const auto piece = g.owned_piece(2);
      REQUIRE(piece.has_value());  // 100 elements: every rank owns some at world 3
      const at::Tensor mine = values.narrow(0, piece->tensor_begin, piece->numel);
      if (stage == 0) REQUIRE(piece->numel == 100);
      // The master copy takes the fp32 values exactly; bf16 parameters their rounding.
      REQUIRE(at::equal(shard->master(piece->buffer_begin, piece->numel), mine));
      at::Tensor written = partitioned ? g.params().narrow(0, piece->buffer_begin, piece->numel)
                                       : g.params().narrow(0, g.layout().offsets[2], 100);
      REQUIRE(at::equal(written, (partitioned ? mine : values).to(spec.model_dtype)));
      // Nothing else changed: the parameters and master values outside tensor 2.
      written.copy_(before.narrow(0, written.storage_offset(), written.numel()));
      REQUIRE(at::equal(g.params(), before));
      shard->master(piece->buffer_begin, piece->numel)
          .copy_(master_before.narrow(0, piece->buffer_begin, piece->numel));
      REQUIRE(at::equal(shard->master_values(), master_before));
      REQUIRE_THROWS_WITH(g.write_tensor(2, at::zeros({99})),
                          Catch::Contains("99 values for tensor 2 of 100 elements"));
    }
  }
}
