// The ZeRO-3 parameter coordinator (zero/param_coordinator.cpp) in one process at world 1-4:
// gathers and releases by module, parameters read outside their module's forward
// (read_in_forward, add_external), the fetch order recorded again without a warning when a
// module joins, and a backward gather that waits for its own backward's gradients.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/in_process_world.h"
#include "zero/optimizer.h"

using namespace zeroshard;

namespace {

const std::vector<int64_t> kNumels = {15, 7, 16, 1};

at::Tensor initial(size_t i) {
  return at::linspace(-1.0, 1.0, kNumels[i], at::kFloat).mul_(double(i + 1));
}

// What one rank saw, step by step: the sizes of the parameters' tensors (0 when released), the
// live gathered count and the results of the calls under test.
std::vector<int64_t> scenario(int rank, std::shared_ptr<Comm> comm) {
  (void)rank;
  const Config cfg = parse_config(
      "{\"train_micro_batch_size_per_gpu\": 1, \"optimizer\": {\"type\": \"AdamW\"}, "
      "\"zero_optimization\": {\"stage\": 3, \"stage3_param_persistence_threshold\": 0}}",
      "<test_param_coordinator>");
  std::vector<at::Tensor> values, params;
  for (size_t i = 0; i < kNumels.size(); ++i) values.push_back(initial(i));
  ZeroOptimizer opt(comm, cfg, cfg.optimizer, {values}, at::kFloat);
  for (const auto& v : values) params.push_back(v.clone());
  ParamCoordinator& c = opt.coordinator();
  c.attach(params);
  std::vector<int64_t> seen;
  auto sizes = [&] {
    for (const auto& p : params) seen.push_back(p.numel());
    seen.push_back(c.live_gathered_numel());
  };
  c.register_module(0, {0});
  c.register_module(1, {1});
  c.register_module(2, {2, 3});
  for (int iteration = 0; iteration < 2; ++iteration) {
    c.begin_forward(true);
    if (iteration == 1) c.fetch(3, false);      // the module that joined gathers what it read
    c.fetch(0, false);
    sizes();                                     // module 0 (and 3) running
    seen.push_back(at::equal(params[0], values[0]));
    c.release(0);
    // Module 3 (the root, say) reads parameter 0 in its forward: taken as external once.
    seen.push_back(c.read_in_forward(3, 0));
    seen.push_back(c.read_in_forward(3, 0));     // held by module 3 now
    c.fetch(1, false);
    seen.push_back(c.read_in_forward(1, 1));     // its own module holds it
    seen.push_back(c.read_in_forward(1, 0));     // module 3, running, holds it
    sizes();
    c.release(1);
    c.release(3);
    sizes();                                     // everything released
    c.release_all();
  }
  seen.push_back(c.trace_invalidations());
  // register_external_parameter outside a forward: gathered from the module's next forward.
  seen.push_back(c.add_external(4, 2, false));
  seen.push_back(c.add_external(4, 2, false));  // once
  sizes();
  c.fetch(4, false);
  sizes();
  c.release(4);
  // Backward: a gradient that arrived before module 1's backward gather (another autograd pass,
  // reentrant checkpointing's) does not release it; its own backward's gradient does.
  c.grad_done(2);
  c.fetch(2, true);
  sizes();
  c.grad_done(3);  // module 2's other parameter: parameter 2's own gradient is still to come
  sizes();
  c.grad_done(2);
  sizes();
  c.release_all();
  seen.push_back(c.trace_invalidations());
  return seen;
}

}  // namespace

TEST_CASE("the coordinator gathers, takes external parameters and releases at world 1-4") {
  const int64_t a = kNumels[0], b = kNumels[1], p2 = kNumels[2], p3 = kNumels[3];
  // Per iteration: sizes with module 0 running (iteration 1: module 3 holds parameter 0 too),
  // its values, the four read results, sizes with modules 1 and 3 running, sizes at the end.
  const std::vector<int64_t> iteration = {a, 0, 0, 0, a, 1, 1, 0, 0, 0, a, b, 0, 0, a + b,
                                          0, 0, 0, 0, 0};
  std::vector<int64_t> want = iteration;
  want.insert(want.end(), iteration.begin(), iteration.end());
  // Iteration 2: module 3 holds parameter 0 from its own fetch, so its first read takes nothing.
  want[20 + 6] = 0;
  want.push_back(0);  // no trace invalidation: the joining module restarted the recording
  const std::vector<int64_t> rest = {1, 0,               // add_external: joined, then once only
                                     0, 0, 0, 0, 0,      // nothing gathered by it
                                     0, 0, p2, 0, p2,    // module 4's forward gathers it
                                     0, 0, p2, p3, p2 + p3,  // module 2 gathered for backward
                                     0, 0, p2, p3, p2 + p3,  // kept: p2's early gradient is stale
                                     0, 0, 0, 0, 0,      // released by its own backward's gradients
                                     0};                 // module 4 joining invalidated nothing
  want.insert(want.end(), rest.begin(), rest.end());
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    auto got = run_in_process_world<std::vector<int64_t>>(world, scenario);
    for (int rank = 0; rank < world; ++rank) {
      CAPTURE(rank);
      REQUIRE(got[size_t(rank)] == want);
    }
  }
}
