// Lamb through the ZeRO optimizer in one process (ranks as threads of the in-process world): at
// stages 1-3 a rank holds pieces of tensors, and each tensor's trust ratio must come from the
// whole tensor's norms, summed across ranks. Checked against FusedLamb written out on whole
// tensors at stages 0-3 and world 1-4, with tensors whose pieces' norms differ from the whole's,
// in two parameter groups with different learning rates (tensors are numbered across groups).
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/in_process_world.h"
#include "zero/optimizer.h"

// c10's logging header defines its own CHECK (a fatal log, not a Catch2 assertion): REQUIRE here.

using namespace zeroshard;

namespace {

const std::vector<int64_t> kNumels = {40, 7, 33, 1, 24};
const std::vector<size_t> kGroupOf = {0, 0, 0, 1, 1};
const double kLrs[] = {0.05, 0.02};
constexpr double kDecay = 0.01, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8;
constexpr double kMaxCoeff = 10.0, kMinCoeff = 0.01;
constexpr int kSteps = 4;

// Values that grow along each tensor, so a piece's norms are not the whole tensor's.
at::Tensor initial(size_t i) {
  return at::linspace(0.0, 2.0, kNumels[i], at::kFloat).pow_(3).mul_(double(i + 1));
}

at::Tensor gradient(size_t i, int rank, int step) {
  return at::sin(at::arange(kNumels[i], at::kFloat).mul_(0.7 * double(i + 1)).add_(0.3 * rank + step))
      .mul_(1.0 + double(i));
}

std::vector<at::Tensor> train(int stage, int rank, std::shared_ptr<Comm> comm) {
  const std::string json = std::string("{\"train_micro_batch_size_per_gpu\": 1, ") +
      "\"optimizer\": {\"type\": \"Lamb\"}, \"zero_optimization\": {\"stage\": " + std::to_string(stage) +
      ", \"reduce_bucket_size\": 20, \"stage3_param_persistence_threshold\": 0}}";
  const Config cfg = parse_config(json, "<test_lamb>");
  std::vector<std::vector<at::Tensor>> groups(2);
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < kNumels.size(); ++i) groups[kGroupOf[i]].push_back(initial(i));
  ZeroOptimizer opt(comm, cfg, cfg.optimizer, groups, at::kFloat);
  if (opt.strategy().partitions_params()) {
    for (const auto& g : groups) {
      for (const auto& v : g) params.push_back(v.clone());
    }
    opt.coordinator().gatherer().attach(params);
  }
  std::vector<GroupHyper> hypers(2);
  for (size_t g = 0; g < 2; ++g) {
    GroupHyper& h = hypers[g];
    h.lr = kLrs[g], h.weight_decay = kDecay, h.beta1 = kBeta1, h.beta2 = kBeta2, h.eps = kEps;
    h.max_coeff = kMaxCoeff, h.min_coeff = kMinCoeff;
  }
  for (int step = 0; step < kSteps; ++step) {
    opt.before_backward(true);
    for (size_t i = kNumels.size(); i-- > 0;) opt.grad_ready(int64_t(i), gradient(i, rank, step));
    opt.after_backward(true);
    opt.step(hypers, comm->world_size());
  }
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < kNumels.size(); ++i) out.push_back(opt.full_values().get(int64_t(i), "fp32_param"));
  return out;
}

// FusedLamb on whole tensors, in double, with the mean gradient over the ranks.
std::vector<at::Tensor> reference(int world) {
  std::vector<at::Tensor> p, m, v;
  for (size_t i = 0; i < kNumels.size(); ++i) {
    p.push_back(initial(i).to(at::kDouble));
    m.push_back(at::zeros_like(p.back()));
    v.push_back(at::zeros_like(p.back()));
  }
  for (int step = 0; step < kSteps; ++step) {
    const double t = step + 1;
    for (size_t i = 0; i < kNumels.size(); ++i) {
      at::Tensor g = at::zeros_like(p[i]);
      for (int r = 0; r < world; ++r) g += gradient(i, r, step).to(at::kDouble);
      g /= world;
      m[i].mul_(kBeta1).add_(g, 1 - kBeta1);
      v[i].mul_(kBeta2).add_(g * g, 1 - kBeta2);
      const at::Tensor u = m[i] / (v[i].sqrt() + kEps) + kDecay * p[i];
      const double wn = p[i].norm().item<double>(), un = u.norm().item<double>();
      const double ratio = wn > 0 && un > 0 ? std::clamp(wn / un, kMinCoeff, kMaxCoeff) : 1.0;
      p[i].sub_(u, kLrs[kGroupOf[i]] * std::sqrt(1 - std::pow(kBeta2, t)) / (1 - std::pow(kBeta1, t)) * ratio);
    }
  }
  return p;
}

}  // namespace

TEST_CASE("Lamb at stages 0-3 takes each tensor's trust ratio from the whole tensor, world 1-4") {
  for (int stage = 0; stage <= 3; ++stage) {
    for (int world = 1; world <= 4; ++world) {
      CAPTURE(stage, world);
      const auto want = reference(world);
      const auto got = run_in_process_world<std::vector<at::Tensor>>(
          world, [&](int rank, std::shared_ptr<Comm> comm) { return train(stage, rank, comm); });
      for (int rank = 0; rank < world; ++rank) {
        for (size_t i = 0; i < kNumels.size(); ++i) {
          CAPTURE(rank, i);
          const double err = (got[size_t(rank)][i].to(at::kDouble) - want[i]).abs().max().item<double>();
          REQUIRE(err <= 1e-5 * want[i].abs().max().item<double>());
        }
      }
    }
  }
}
