// The four gradient reducers (zero/grad_reducer.cpp for stages 0/1, zero/sharded_grad_reducer.cpp
// and zero/scatter_grad_reducer.cpp over zero/staged_reducer.cpp for stages 2/3), made by each
// stage strategy's make_reducer and run at world 1-4 in one process: the gradient each rank keeps
// must be the mean over ranks, sliced as runtime/shard.h says that rank holds it.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/in_process_world.h"
#include "runtime/memory.h"
#include "runtime/shard.h"
#include "zero/flat_group.h"
#include "zero/grad_reducer.h"
#include "zero/strategy.h"

using namespace zeroshard;

namespace {

// Two parameter groups. With 20-element buckets the first forms buckets {15} {7} {16, 1} and the
// second {33} {5}; 33 is larger than a bucket, so stages 2 and 3 reduce it in pieces; the
// 1-element tensor leaves stage 3's ranks above 0 without a chunk of it.
const std::vector<std::vector<int64_t>> kGroupNumels = {{15, 7, 16, 1}, {33, 5}};
constexpr int64_t kNumParams = 6;
constexpr int kWindows = 2;              // accumulation windows, zero_grad (the step) between
constexpr int kAbortedMicro = 9;         // gradients of the backward that raises

// A parameter's number in the reducer (groups in order) -> its group and index in the group.
std::pair<size_t, size_t> locate(int64_t index) {
  size_t g = 0;
  while (index >= int64_t(kGroupNumels[g].size())) index -= int64_t(kGroupNumels[g++].size());
  return {g, size_t(index)};
}

int64_t numel_of(int64_t index) {
  const auto [g, i] = locate(index);
  return kGroupNumels[g][i];
}

struct Scenario {
  const char* name = "";
  int64_t bucket_numel = 20;
  bool overlap_comm = true;
  at::ScalarType model_dtype = at::kFloat;
  at::ScalarType comm_dtype = at::ScalarType::Undefined;
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  int micro_steps = 1;      // per accumulation window
  int64_t missing = -1;     // a parameter that gets no gradient...
  int missing_micro = -1;   // ...in this micro-step (-1: in every one)...
  int missing_window = -1;  // ...of this window (-1: of every one)
  bool abort_first = false;  // each window starts with a backward that raises half-way
  std::vector<int64_t> order;  // the order gradients arrive in; empty: backward's (last first)
};

Scenario scenario(const char* name, const std::function<void(Scenario&)>& edit) {
  Scenario s;
  s.name = name;
  edit(s);
  return s;
}

const std::vector<Scenario> kScenarios = {
    scenario("one bucket per group", [](Scenario& s) { s.bucket_numel = 1000; }),
    scenario("several buckets", [](Scenario&) {}),
    scenario("several buckets, no overlap_comm", [](Scenario& s) { s.overlap_comm = false; }),
    // Every tensor larger than 3 elements is reduced in pieces.
    scenario("3-element buckets, 2 micro-steps", [](Scenario& s) {
      s.bucket_numel = 3;
      s.micro_steps = 2;
    }),
    scenario("gradients in forward order", [](Scenario& s) { s.order = {0, 1, 2, 3, 4, 5}; }),
    // Stages 2/3: both groups' buckets fill at once, so the one staging buffer of a pool without
    // overlap_comm is not enough and the pool grows.
    scenario("one bucket per group, groups interleaved, no overlap_comm", [](Scenario& s) {
      s.bucket_numel = 1000;
      s.overlap_comm = false;
      s.order = {0, 4, 1, 5, 2, 3};
    }),
    scenario("comm fp16", [](Scenario& s) { s.comm_dtype = at::kHalf; }),
    scenario("comm bf16, no overlap_comm", [](Scenario& s) {
      s.comm_dtype = at::kBFloat16;
      s.overlap_comm = false;
    }),
    scenario("gradient_predivide_factor 2", [](Scenario& s) { s.gradient_predivide_factor = 2.0; }),
    scenario("prescale_gradients", [](Scenario& s) { s.prescale_gradients = true; }),
    scenario("model fp16", [](Scenario& s) { s.model_dtype = at::kHalf; }),
    scenario("model bf16", [](Scenario& s) { s.model_dtype = at::kBFloat16; }),
    scenario("model fp16, gradient_predivide_factor 4", [](Scenario& s) {
      s.model_dtype = at::kHalf;
      s.gradient_predivide_factor = 4.0;
    }),
    scenario("model bf16, comm fp32", [](Scenario& s) {
      s.model_dtype = at::kBFloat16;
      s.comm_dtype = at::kFloat;
    }),
    scenario("2 micro-steps", [](Scenario& s) { s.micro_steps = 2; }),
    scenario("2 micro-steps, no overlap_comm, comm bf16", [](Scenario& s) {
      s.micro_steps = 2;
      s.overlap_comm = false;
      s.comm_dtype = at::kBFloat16;
    }),
    scenario("2 micro-steps, prescale_gradients, model bf16", [](Scenario& s) {
      s.micro_steps = 2;
      s.prescale_gradients = true;
      s.model_dtype = at::kBFloat16;
    }),
    scenario("a parameter with no gradient", [](Scenario& s) { s.missing = 2; }),
    // Its flat-buffer view at stages 0/1 still holds the first window's gradient.
    scenario("a parameter with no gradient in the second window", [](Scenario& s) {
      s.missing = 2;
      s.missing_window = 1;
    }),
    scenario("a parameter with no gradient in the first of 2 micro-steps", [](Scenario& s) {
      s.micro_steps = 2;
      s.missing = 2;
      s.missing_micro = 0;
    }),
    scenario("a parameter with no gradient in the last of 2 micro-steps", [](Scenario& s) {
      s.micro_steps = 2;
      s.missing = 2;
      s.missing_micro = 1;
    }),
    scenario("abort, then a clean backward", [](Scenario& s) { s.abort_first = true; }),
    scenario("abort, then a clean backward, no overlap_comm, 2 micro-steps", [](Scenario& s) {
      s.abort_first = true;
      s.overlap_comm = false;
      s.micro_steps = 2;
    }),
};

bool gets_gradient(const Scenario& s, int64_t index, int window, int micro) {
  return index != s.missing || (s.missing_micro >= 0 && s.missing_micro != micro) ||
         (s.missing_window >= 0 && s.missing_window != window);
}

// Rank `rank`'s gradient of parameter `index` in micro-step `micro` of window `window`, as
// autograd would hand it over: in the model dtype.
at::Tensor gradient(const Scenario& s, int64_t index, int rank, int window, int micro) {
  return at::sin(at::arange(numel_of(index), at::kDouble)
                     .mul_(0.37 * double(index + 1))
                     .add_(0.3 * rank + 1.1 * window + 0.5 * micro + 0.2 * double(index)))
      .to(s.model_dtype);
}

ZeroConfig zero_config(int stage) {
  ZeroConfig z;
  z.stage = stage;
  return z;
}

// What the engine's gradient hook does (python/zeroshard/engine.py): at stages 0/1 a parameter's
// first gradient since zero_grad is handed over and copied into its flat-buffer view, which then
// is param.grad, so later backwards add into the view and hand nothing; stages 2/3 hand every
// gradient over.
struct Hook {
  std::vector<at::Tensor> views;  // stages 0/1: each parameter's gradient view
  std::vector<bool> grad_is_view;

  void operator()(Reducer& reducer, int64_t index, const at::Tensor& grad) {
    if (views.empty()) {
      reducer.grad_ready(index, grad);
    } else if (grad_is_view[size_t(index)]) {
      views[size_t(index)].add_(grad);  // autograd accumulating into param.grad
      reducer.grad_ready(index, at::Tensor());
    } else {
      reducer.grad_ready(index, grad);
      grad_is_view[size_t(index)] = true;
    }
  }
  // The engine's zero_grad (and step) sets param.grad to None.
  void zero_grad() { grad_is_view.assign(views.size(), false); }
};

struct RankResult {
  std::vector<std::vector<at::Tensor>> held;  // [window][group]: the reduced gradient kept, fp64
  int64_t num_buckets = 0;
};

// The gradient this rank keeps of a group: the full flat buffer (stages 0/1), the owned slice
// (stage 2), or the chunk shard assembled from stage 3's segments.
at::Tensor held_gradient(const FlatGroup& g) {
  if (g.full_grads()) return g.grads().to(at::kDouble);
  if (!g.partitioned()) return g.owned_grads().to(at::kDouble);
  at::Tensor out = at::empty({g.owned().numel()}, at::kDouble);
  g.copy_owned_grads(0, g.owned().numel(), out);
  return out;
}

RankResult run_rank(const Scenario& s, int stage, int rank, std::shared_ptr<Comm> comm) {
  const auto strategy = make_strategy(zero_config(stage));
  MemoryAccount memory;  // outlives the groups and the reducer, which account in it
  GroupSpec spec;
  spec.model_dtype = s.model_dtype;
  spec.world_size = comm->world_size();
  spec.rank = rank;
  spec.alignment_numel = kAlignmentNumel;
  spec.shard_state = strategy->shards_optimizer_state();
  spec.full_grads = strategy->keeps_full_grads();
  spec.partition_params = strategy->partitions_params();
  std::vector<std::unique_ptr<FlatGroup>> groups;
  std::vector<FlatGroup*> raw;
  for (const auto& numels : kGroupNumels) {
    std::vector<at::Tensor> params;
    for (int64_t n : numels) params.push_back(at::zeros({n}, at::kFloat));
    groups.push_back(std::make_unique<FlatGroup>(params, spec, memory));
    raw.push_back(groups.back().get());
  }
  ReduceOptions options;
  options.bucket_numel = s.bucket_numel;
  options.overlap_comm = s.overlap_comm;
  options.prescale_gradients = s.prescale_gradients;
  options.gradient_predivide_factor = s.gradient_predivide_factor;
  options.comm_dtype = s.comm_dtype;
  const auto reducer = strategy->make_reducer(raw, comm, options, memory);
  Hook hook;
  if (strategy->keeps_full_grads()) {
    for (const auto& g : groups) {
      for (const auto& view : g->grad_views()) hook.views.push_back(view);
    }
  }
  hook.zero_grad();

  RankResult out;
  out.num_buckets = reducer->num_buckets();
  for (int window = 0; window < kWindows; ++window) {
    if (s.abort_first) {
      // Backward raises after the later half of the parameters' gradients (some buckets started).
      reducer->begin_backward(true);
      for (int64_t i = kNumParams; i-- > kNumParams / 2;) {
        hook(*reducer, i, gradient(s, i, rank, window, kAbortedMicro));
      }
      reducer->abort();
      // What the aborted backward reduced stays in the gradients until zero_grad (reducer.h), so
      // the clean backward comes after one.
      reducer->zero_grad();
      hook.zero_grad();
    }
    for (int micro = 0; micro < s.micro_steps; ++micro) {
      const bool boundary = micro == s.micro_steps - 1;
      reducer->begin_backward(boundary);
      for (int64_t k = 0; k < kNumParams; ++k) {
        const int64_t i = s.order.empty() ? kNumParams - 1 - k : s.order[size_t(k)];
        if (gets_gradient(s, i, window, micro)) hook(*reducer, i, gradient(s, i, rank, window, micro));
      }
      // As ZeroOptimizer::after_backward: full gradients are reduced at the boundary only.
      if (boundary || !strategy->keeps_full_grads()) reducer->finish();
    }
    std::vector<at::Tensor> held;
    for (const auto& g : groups) held.push_back(held_gradient(*g));
    out.held.push_back(held);
    reducer->zero_grad();  // the step
    hook.zero_grad();
  }
  return out;
}

// Each parameter's gradient summed over the window's micro-steps, averaged over ranks, from the
// tensors handed over, in fp64; and the largest element of any rank's sum (for tolerances).
struct Reference {
  std::vector<at::Tensor> mean;
  double max_rank_sum = 0.0;
};

Reference reference(const Scenario& s, int world, int window) {
  Reference ref;
  for (int64_t i = 0; i < kNumParams; ++i) {
    at::Tensor total = at::zeros({numel_of(i)}, at::kDouble);
    for (int r = 0; r < world; ++r) {
      at::Tensor sum = at::zeros_like(total);
      for (int micro = 0; micro < s.micro_steps; ++micro) {
        if (gets_gradient(s, i, window, micro)) sum += gradient(s, i, r, window, micro).to(at::kDouble);
      }
      ref.max_rank_sum = std::max(ref.max_rank_sum, sum.abs().max().item<double>());
      total += sum;
    }
    ref.mean.push_back(total / world);
  }
  return ref;
}

// What rank `rank` keeps of group g's mean gradient, by runtime/shard.h: every tensor packed
// into the padded flat buffer (full at stages 0/1, the rank's shard_range at stage 2), or the
// rank's chunk of each tensor, back to back (stage 3).
at::Tensor expected_held(const ZeroStrategy& strategy, size_t g, const Reference& ref, int world,
                         int rank) {
  const auto& numels = kGroupNumels[g];
  int64_t first = 0;
  for (size_t k = 0; k < g; ++k) first += int64_t(kGroupNumels[k].size());
  const auto mean = [&](size_t i) { return ref.mean[size_t(first) + i]; };
  if (strategy.partitions_params()) {
    const ChunkLayout L = make_chunk_layout(numels, world);
    at::Tensor shard = at::zeros({L.shard_numel}, at::kDouble);
    for (size_t i = 0; i < numels.size(); ++i) {
      const int64_t held = L.held_numel(int64_t(i), rank);
      if (held > 0) {
        shard.narrow(0, L.local_offsets[i], held).copy_(mean(i).narrow(0, rank * L.chunks[i], held));
      }
    }
    return shard;
  }
  const FlatLayout L = make_flat_layout(numels, world, kAlignmentNumel);
  at::Tensor flat = at::zeros({L.padded_numel}, at::kDouble);
  for (size_t i = 0; i < numels.size(); ++i) flat.narrow(0, L.offsets[i], L.numels[i]).copy_(mean(i));
  if (strategy.keeps_full_grads()) return flat;
  const ShardRange own = shard_range(L.padded_numel, rank, world);
  return flat.narrow(0, own.begin, own.numel());
}

// Half the gap between 1 and the next number of the dtype.
double unit_roundoff(at::ScalarType t) {
  if (t == at::kHalf) return std::ldexp(1.0, -11);
  if (t == at::kBFloat16) return std::ldexp(1.0, -8);
  return std::ldexp(1.0, -24);
}

// A bound on the rounding of a mean of `world` sums of `micro_steps` gradients computed in
// dtype `u`'s precision: the inputs' cast, each partial sum and each scaling rounds once.
double tolerance(double u, const Scenario& s, int world, const Reference& ref) {
  return u * ref.max_rank_sum * double(world + s.micro_steps + 4);
}

}  // namespace

TEST_CASE("each stage's reducer leaves every rank its slice of the mean gradient at world 1-4") {
  for (const Scenario& s : kScenarios) {
    for (int stage = 0; stage <= 3; ++stage) {
      const auto strategy = make_strategy(zero_config(stage));
      for (int world = 1; world <= 4; ++world) {
        CAPTURE(s.name, stage, world);
        const auto got = run_in_process_world<RankResult>(
            world, [&](int rank, std::shared_ptr<Comm> comm) { return run_rank(s, stage, rank, comm); });
        // A gradient that went through a narrower communication dtype must show its rounding.
        const bool casts = s.comm_dtype != at::ScalarType::Undefined &&
                           unit_roundoff(s.comm_dtype) > unit_roundoff(s.model_dtype);
        const double u = std::max(unit_roundoff(s.model_dtype),
                                  s.comm_dtype == at::ScalarType::Undefined ? 0.0 : unit_roundoff(s.comm_dtype));
        double cast_error = 0.0, fp32_bound = 0.0;
        for (int window = 0; window < kWindows; ++window) {
          const Reference ref = reference(s, world, window);
          const double bound = tolerance(u, s, world, ref);
          fp32_bound = std::max(fp32_bound, tolerance(unit_roundoff(at::kFloat), s, world, ref));
          for (int rank = 0; rank < world; ++rank) {
            CAPTURE(window, rank);
            const RankResult& mine = got[size_t(rank)];
            // Small buckets: 5 planned; stages 2 and 3 cut the 33-element tensor into pieces.
            REQUIRE(mine.num_buckets >= (s.bucket_numel < 33 ? 5 : 2));
            REQUIRE(mine.held.size() == size_t(kWindows));
            for (size_t g = 0; g < kGroupNumels.size(); ++g) {
              CAPTURE(g);
              const at::Tensor want = expected_held(*strategy, g, ref, world, rank);
              const at::Tensor& have = mine.held[size_t(window)][g];
              REQUIRE(have.sizes() == want.sizes());
              const double error = (have - want).abs().max().item<double>();
              CAPTURE(error, bound);
              REQUIRE(error <= bound);
              cast_error = std::max(cast_error, error);
            }
          }
        }
        if (casts) {
          // fp32 all the way would stay within fp32's bound; fp16 and bf16 round far above it.
          CAPTURE(cast_error, fp32_bound);
          REQUIRE(cast_error > 16 * fp32_bound);
        }
      }
    }
  }
}
