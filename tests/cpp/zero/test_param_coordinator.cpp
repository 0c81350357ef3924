// The ZeRO-3 parameter coordinator (zero/param_coordinator.cpp) in one process at world 1-4:
// gathers and releases by module, parameters read outside their module's forward
// (read_in_forward, add_external), the fetch order recorded again without a warning when a
// module joins, and a backward gather that waits for its own backward's gradients.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <memory>
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

// A stage-3 optimizer over kNumels with its parameters attached to the coordinator.
struct Setup {
  std::unique_ptr<ZeroOptimizer> opt;
  std::vector<at::Tensor> values, params;
};

Setup make_setup(std::shared_ptr<Comm> comm) {
  const Config cfg = parse_config(
      "{\"train_micro_batch_size_per_gpu\": 1, \"optimizer\": {\"type\": \"AdamW\"}, "
      "\"zero_optimization\": {\"stage\": 3, \"stage3_param_persistence_threshold\": 0}}",
      "<test_param_coordinator>");
  Setup s;
  for (size_t i = 0; i < kNumels.size(); ++i) s.values.push_back(initial(i));
  s.opt = std::make_unique<ZeroOptimizer>(comm, cfg, cfg.optimizer,
                                          std::vector<std::vector<at::Tensor>>{s.values}, at::kFloat);
  for (const auto& v : s.values) s.params.push_back(v.clone());
  s.opt->coordinator().gatherer().attach(s.params);
  return s;
}

// The sizes of the parameters' tensors (0 when released), then the live gathered count.
void record_sizes(const Setup& s, std::vector<int64_t>& seen) {
  for (const auto& p : s.params) seen.push_back(p.numel());
  seen.push_back(s.opt->coordinator().gatherer().counters().live_numel);
}

// What one rank saw, step by step: sizes and the results of the calls under test.
std::vector<int64_t> scenario(int, std::shared_ptr<Comm> comm) {
  Setup setup = make_setup(std::move(comm));
  ParamCoordinator& c = setup.opt->coordinator();
  const auto& values = setup.values;
  const auto& params = setup.params;
  std::vector<int64_t> seen;
  auto sizes = [&] { record_sizes(setup, seen); };
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
    seen.push_back(c.read_in_forward(iteration == 0 ? -1 : 3, 0));  // joins as module 3
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
  seen.push_back(c.add_external(-1, 2));        // joins as module 4
  seen.push_back(c.add_external(4, 2));         // once
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

// A module that calls itself takes a parameter in the inner call: it stays gathered until the
// outer call ends, where the outer call reads it again.
std::vector<int64_t> recursion(int, std::shared_ptr<Comm> comm) {
  Setup setup = make_setup(std::move(comm));
  ParamCoordinator& c = setup.opt->coordinator();
  std::vector<int64_t> seen;
  c.register_module(0, {3});
  c.begin_forward(true);
  c.fetch(0, false);
  c.fetch(0, false);
  seen.push_back(c.read_in_forward(0, 1));
  c.release(0);
  record_sizes(setup, seen);
  seen.push_back(c.read_in_forward(0, 1));
  c.release(0);
  record_sizes(setup, seen);
  c.release_all();
  return seen;
}

}  // namespace

TEST_CASE("the coordinator gathers, takes external parameters and releases at world 1-4") {
  const int64_t a = kNumels[0], b = kNumels[1], p2 = kNumels[2], p3 = kNumels[3];
  // Per iteration: sizes with module 0 running (iteration 1: module 3 holds parameter 0 too),
  // its values, the four read results, sizes with modules 1 and 3 running, sizes at the end.
  const std::vector<int64_t> iteration = {a, 0, 0, 0, a, 1, 3, -1, -1, -1, a, b, 0, 0, a + b,
                                          0, 0, 0, 0, 0};
  std::vector<int64_t> want = iteration;
  want.insert(want.end(), iteration.begin(), iteration.end());
  // Iteration 2: module 3 holds parameter 0 from its own fetch, so its first read takes nothing.
  want[20 + 6] = -1;
  want.push_back(0);  // no trace invalidation: the joining module restarted the recording
  const std::vector<int64_t> rest = {4, -1,              // add_external: joined, then once only
                                     0, 0, 0, 0, 0,      // nothing gathered by it
                                     0, 0, p2, 0, p2,    // module 4's forward gathers it
                                     0, 0, p2, p3, p2 + p3,  // module 2 gathered for backward
                                     0, 0, p2, p3, p2 + p3,  // kept: p2's early gradient is stale
                                     0, 0, 0, 0, 0,      // released by its own backward's gradients
                                     0};                 // joining invalidated nothing
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

TEST_CASE("a parameter taken in a module's inner call stays gathered for its outer call") {
  const int64_t b = kNumels[1], p3 = kNumels[3];
  // Taken by module 0, whole after the inner call's end (one reference per call under way),
  // found whole by the outer call's read, released by the outer call's end.
  const std::vector<int64_t> want = {0, 0, b, 0, p3, b + p3, -1, 0, 0, 0, 0, 0};
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    auto got = run_in_process_world<std::vector<int64_t>>(world, recursion);
    for (const auto& seen : got) REQUIRE(seen == want);
  }
}
