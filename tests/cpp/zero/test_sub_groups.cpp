// Sub-group planning (zero/sub_groups.cpp) and the sub-group runner (zero/sub_group_runner.cpp):
// sub-groups tile each owned range at tensor-piece starts within sub_group_size, the last ones
// over all groups are host resident as DeepSpeed's ratio rule says, and an update staged through
// host memory gives bit for bit what the same update in place gives.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <algorithm>

#include "runtime/copy_stream.h"
#include "runtime/host_pool.h"
#include "runtime/optim/table.h"
#include "zero/flat_group.h"
#include "zero/optimizer_shard.h"
#include "zero/sub_group_runner.h"
#include "zero/sub_groups.h"

using namespace zeroshard;

TEST_CASE("sub-groups close before the piece that would overfill them and tile the owned range") {
  // Pieces start at 0, 10, 30, 35, 80; the range ends at 96 (padding after the last piece).
  const auto plan = plan_sub_groups({{0, 10, 30, 35, 80}}, {96}, 40, 0.0);
  REQUIRE(plan.size() == 1);
  const std::vector<std::pair<int64_t, int64_t>> expect = {{0, 35}, {35, 45}, {80, 16}};
  REQUIRE(plan[0].size() == expect.size());
  for (size_t i = 0; i < expect.size(); ++i) {
    CHECK(plan[0][i].begin == expect[i].first);
    CHECK(plan[0][i].numel == expect[i].second);
    CHECK(plan[0][i].residency == Residency::device);
  }
  // A piece larger than the limit is a sub-group alone; the default limit makes one sub-group.
  CHECK(plan_sub_groups({{0, 10}}, {200}, 5, 0.0)[0].size() == 2);
  CHECK(plan_sub_groups({{0, 10, 30}}, {96}, 1000000000, 0.0)[0].size() == 1);
  CHECK(plan_sub_groups({{}}, {0}, 10, 1.0)[0].empty());
}

TEST_CASE("the last sub-groups over all groups are host resident: i >= int((1 - ratio) * count)") {
  // Two groups of 3 and 2 sub-groups (one per piece with limit 1).
  const std::vector<std::vector<int64_t>> begins = {{0, 4, 8}, {0, 4}};
  const std::vector<int64_t> numels = {12, 8};
  for (const auto& [ratio, host_count] : {std::pair{0.0, 0}, std::pair{0.4, 2}, std::pair{0.5, 3},
                                          std::pair{1.0, 5}}) {
    const auto plan = plan_sub_groups(begins, numels, 1, ratio);
    int host = 0, i = 0;
    for (const auto& group : plan) {
      for (const SubGroup& sg : group) {
        const bool expect_host = i++ >= 5 - host_count;
        CHECK((sg.residency == Residency::host) == expect_host);
        host += sg.residency == Residency::host;
      }
    }
    CHECK(host == host_count);
  }
  const auto plan = plan_sub_groups(begins, numels, 1, 0.4);
  CHECK(host_split(plan[0], 12) == 12);
  CHECK(host_split(plan[1], 8) == 0);
}

TEST_CASE("an update staged through host memory equals the update in place, bit for bit") {
  // A stage-2 layout (sharded state and gradients) in bf16 and fp32, world 2, every rank, with
  // sub-groups of one piece each, split between device and host at ratio 0, 0.5 and 1.
  const std::vector<int64_t> numels = {50, 7, 130, 3, 64};
  std::vector<at::Tensor> params;
  for (int64_t n : numels) params.push_back(at::randn({n}));
  OptimizerConfig cfg;
  cfg.present = true;
  cfg.type = "AdamW";
  GroupHyper h;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    for (int64_t rank = 0; rank < 2; ++rank) {
      std::vector<at::Tensor> results;
      for (const double ratio : {0.0, 0.5, 1.0}) {
        GroupSpec spec;
        spec.world_size = 2;
        spec.rank = rank;
        spec.shard_state = true;
        spec.full_grads = false;
        spec.model_dtype = dtype;
        MemoryAccount memory;
        FlatGroup g(params, spec, memory);
        HostPool pool(false, c10::Device(at::kCPU), memory);
        CopyStream copies(c10::Device(at::kCPU));
        auto plan = plan_sub_groups({owned_piece_begins(g)}, {g.owned().numel()}, 1, ratio);
        auto shard = make_shard(g, params, {}, cfg, std::move(plan[0]), pool, memory);
        SubGroupRunner runner({&g}, {shard.get()}, pool, copies);
        at::manual_seed(7);
        const OptimizerRow& row = optimizer_row(cfg.type);
        for (int64_t step = 1; step <= 3; ++step) {
          g.grads().copy_(at::randn({g.grads().numel()}));
          // Step 2: the gradients come down early, as a reducer reports them final, in two
          // ranges that split sub-groups.
          const int64_t n = g.owned().numel();
          if (step == 2) {
            runner.gradients_final(0, 0, n / 3);
            runner.gradients_final(0, n / 3, n - n / 3);
          }
          shard->create_state();
          UpdateScalars s;
          s.step = step;
          runner.run([&](size_t, const UpdatePiece& p) { row.update(p, h, cfg, s, nullptr); });
          CHECK(runner.last_times().early_sub_groups ==
                (step == 2 ? int64_t(std::count_if(shard->sub_groups().begin(), shard->sub_groups().end(),
                                                   [](const SubGroup& sg) { return sg.residency == Residency::host; }))
                           : 0));
        }
        if (ratio > 0.0) CHECK(memory.bytes(MemoryCategory::host_buffers) > 0);
        results.push_back(at::cat({shard->master_values(), g.owned_params().to(at::kFloat)}));
      }
      CHECK(at::equal(results[0], results[1]));
      CHECK(at::equal(results[0], results[2]));
    }
  }
}
