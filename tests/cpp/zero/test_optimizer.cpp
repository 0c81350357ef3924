// The ZeRO optimizer (zero/optimizer.cpp) with its reducers and, at stage 3, its parameter
// coordinator, in one process: ranks as threads of the in-process world, stages 0-3, world 1-4,
// gradient accumulation 1 and 2, against AdamW written out on whole tensors; gradient_clipping
// against torch.nn.utils.clip_grad_norm_'s coefficient.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/error.h"
#include "runtime/in_process_world.h"
#include "zero/optimizer.h"

using namespace zeroshard;

namespace {

const std::vector<std::vector<int64_t>> kShapes = {{5, 3}, {7}, {4, 4}, {1}};
constexpr double kLr = 0.01, kDecay = 0.1, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8;
constexpr int kSteps = 3;

at::Tensor initial(size_t i) {
  const int64_t n = c10::multiply_integers(kShapes[i]);
  return at::linspace(-1.0, 1.0, n, at::kFloat).mul_(double(i + 1)).view(kShapes[i]);
}

// Rank `rank`'s gradient of tensor i at micro-step `micro` of step `step`.
at::Tensor gradient(size_t i, int rank, int step, int micro) {
  const int64_t n = c10::multiply_integers(kShapes[i]);
  return at::sin(at::arange(n, at::kFloat).mul_(double(i + 1)).add_(0.3 * rank + step + 0.1 * micro))
      .view(kShapes[i]);
}

Config config(int stage) {
  const std::string json = std::string("{\"train_micro_batch_size_per_gpu\": 1, ") +
      "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01, \"weight_decay\": 0.1}}, "
      "\"zero_optimization\": {\"stage\": " + std::to_string(stage) +
      ", \"reduce_bucket_size\": 20, \"stage3_param_persistence_threshold\": 0}}";
  return parse_config(json, "<test_optimizer>");
}

// What the engine's gradient hook does: stages 0/1 accumulate in the flat buffer's view (a fresh
// gradient after the step is copied in), stages 2/3 hand every gradient over.
void hand_over(ZeroOptimizer& opt, size_t i, const at::Tensor& grad, bool first_micro) {
  if (opt.strategy().keeps_full_grads() && !first_micro) {
    opt.grad_views()[0][i].add_(grad);
    opt.grad_ready(int64_t(i), at::Tensor());
  } else {
    opt.grad_ready(int64_t(i), grad);
  }
}

// One rank's run; returns every tensor's whole fp32 master value after the steps, and at stage 3
// the values the coordinator gathers into the parameters.
std::vector<at::Tensor> train(int stage, int gas, int rank, std::shared_ptr<Comm> comm) {
  const Config cfg = config(stage);
  std::vector<at::Tensor> values;
  for (size_t i = 0; i < kShapes.size(); ++i) values.push_back(initial(i));
  ZeroOptimizer opt(comm, cfg, cfg.optimizer, {values}, at::kFloat);
  std::vector<at::Tensor> params;
  if (opt.strategy().partitions_params()) {
    for (const auto& v : values) params.push_back(v.clone());
    opt.coordinator().gatherer().attach(params);
  }
  GroupHyper h;
  h.lr = kLr, h.weight_decay = kDecay, h.beta1 = kBeta1, h.beta2 = kBeta2, h.eps = kEps;
  for (int step = 0; step < kSteps; ++step) {
    for (int micro = 0; micro < gas; ++micro) {
      const bool boundary = micro == gas - 1;
      opt.before_backward(boundary);
      for (size_t i = kShapes.size(); i-- > 0;) {  // backward order
        hand_over(opt, i, gradient(i, rank, step, micro), micro == 0);
      }
      opt.after_backward(boundary);
    }
    // Asserted in the calling thread: a step not applied leaves the values the reference rejects.
    opt.step({h}, comm->world_size());
  }
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < kShapes.size(); ++i) out.push_back(opt.full_values().get(int64_t(i), "fp32_param"));
  if (opt.strategy().partitions_params()) {
    std::vector<int64_t> all = {0, 1, 2, 3};
    opt.coordinator().gatherer().fetch_params(all);
    for (const auto& p : params) out.push_back(p.clone());
    opt.coordinator().gatherer().release_params(all);
  }
  return out;
}

// torch.optim.AdamW on whole tensors with the mean over ranks of each step's summed micro-steps.
std::vector<at::Tensor> reference(int world, int gas) {
  std::vector<at::Tensor> p, m, v;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    p.push_back(initial(i).to(at::kDouble));
    m.push_back(at::zeros_like(p.back()));
    v.push_back(at::zeros_like(p.back()));
  }
  for (int step = 0; step < kSteps; ++step) {
    const double t = step + 1;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      at::Tensor g = at::zeros_like(p[i]);
      for (int r = 0; r < world; ++r) {
        for (int micro = 0; micro < gas; ++micro) g += gradient(i, r, step, micro).to(at::kDouble);
      }
      g /= world;
      p[i].mul_(1 - kLr * kDecay);
      m[i].mul_(kBeta1).add_(g, 1 - kBeta1);
      v[i].mul_(kBeta2).add_(g * g, 1 - kBeta2);
      const at::Tensor denom = (v[i] / (1 - std::pow(kBeta2, t))).sqrt_().add_(kEps);
      p[i].sub_(m[i] / (1 - std::pow(kBeta1, t)) / denom * kLr);
    }
  }
  return p;
}

// Adam's eps at the scale of the gradients, so that its step, unlike plain Adam's, changes with
// the gradient's scale and shows a clip coefficient.
constexpr double kClipAdamEps = 1.0;

struct ClipResult {
  std::vector<at::Tensor> values;  // every tensor's fp32 master value after one step
  double grad_norm = 0.0;
};

ClipResult clipped_step(int stage, const std::string& type, double clip, int rank,
                        std::shared_ptr<Comm> comm) {
  const std::string json = std::string("{\"train_micro_batch_size_per_gpu\": 1, ") +
      "\"gradient_clipping\": " + std::to_string(clip) + ", \"optimizer\": {\"type\": \"" + type +
      "\"}, \"zero_optimization\": {\"stage\": " + std::to_string(stage) +
      ", \"reduce_bucket_size\": 20, \"stage3_param_persistence_threshold\": 0}}";
  const Config cfg = parse_config(json, "<test_optimizer>");
  std::vector<at::Tensor> values, params;
  for (size_t i = 0; i < kShapes.size(); ++i) values.push_back(initial(i));
  ZeroOptimizer opt(comm, cfg, cfg.optimizer, {values}, at::kFloat);
  if (opt.strategy().partitions_params()) {
    for (const auto& v : values) params.push_back(v.clone());
    opt.coordinator().gatherer().attach(params);
  }
  GroupHyper h;
  h.lr = kLr, h.weight_decay = 0.0, h.eps = kClipAdamEps;
  opt.before_backward(true);
  for (size_t i = kShapes.size(); i-- > 0;) hand_over(opt, i, gradient(i, rank, 0, 0), true);
  opt.after_backward(true);
  ClipResult out;
  out.grad_norm = opt.step({h}, comm->world_size()).grad_norm;
  for (size_t i = 0; i < kShapes.size(); ++i) out.values.push_back(opt.full_values().get(int64_t(i), "fp32_param"));
  return out;
}

}  // namespace

TEST_CASE("the ZeRO step at stages 0-3 matches AdamW on the mean gradient at world 1-4") {
  for (int stage = 0; stage <= 3; ++stage) {
    for (int gas = 1; gas <= 2; ++gas) {
      for (int world = 1; world <= 4; ++world) {
        CAPTURE(stage, gas, world);
        const auto want = reference(world, gas);
        auto got = run_in_process_world<std::vector<at::Tensor>>(
            world, [&](int rank, std::shared_ptr<Comm> comm) { return train(stage, gas, rank, comm); });
        for (int rank = 0; rank < world; ++rank) {
          CAPTURE(rank);
          const auto& mine = got[size_t(rank)];
          REQUIRE(mine.size() == (stage == 3 ? 2 : 1) * kShapes.size());
          for (size_t k = 0; k < mine.size(); ++k) {
            const at::Tensor& w = want[k % kShapes.size()];
            CAPTURE(k);
            REQUIRE(mine[k].sizes() == w.sizes());
            const double err = (mine[k].to(at::kDouble) - w).abs().max().item<double>();
            REQUIRE(err <= 1e-5 * w.abs().max().item<double>());
          }
        }
      }
    }
  }
}

TEST_CASE("stages 2 and 3 refuse a second gradient for one parameter in one backward") {
  for (int stage = 2; stage <= 3; ++stage) {
    CAPTURE(stage);
    auto got = run_in_process_world<std::string>(2, [&](int rank, std::shared_ptr<Comm> comm) {
      const Config cfg = config(stage);
      std::vector<at::Tensor> values;
      for (size_t i = 0; i < kShapes.size(); ++i) values.push_back(initial(i));
      ZeroOptimizer opt(comm, cfg, cfg.optimizer, {values}, at::kFloat);
      opt.before_backward(true);
      opt.grad_ready(0, gradient(0, rank, 0, 0));
      std::string message;
      try {
        opt.grad_ready(0, gradient(0, rank, 0, 1));  // reentrant checkpointing's second pass
      } catch (const Error& e) {
        message = e.what();
      }
      opt.abort_backward();
      return message;
    });
    for (const auto& message : got) {
      REQUIRE_THAT(message, Catch::Contains("gradient of parameter 0 arrived twice in one backward") &&
                                Catch::Contains("use_reentrant=False"));
    }
  }
}

TEST_CASE("gradient_clipping scales the step by clip_grad_norm_'s coefficient at stages 0-3") {
  for (const std::string type : {"SGD", "AdamW"}) {
    for (const double clip : {0.5, 100.0}) {
      for (int world = 1; world <= 4; ++world) {
        // The mean gradient, its global L2 norm, and torch.nn.utils.clip_grad_norm_'s coefficient.
        std::vector<at::Tensor> mean;
        double sum_sq = 0.0;
        for (size_t i = 0; i < kShapes.size(); ++i) {
          at::Tensor g = at::zeros(kShapes[i], at::kDouble);
          for (int r = 0; r < world; ++r) g += gradient(i, r, 0, 0).to(at::kDouble);
          mean.push_back(g / world);
          sum_sq += mean.back().pow(2).sum().item<double>();
        }
        const double norm = std::sqrt(sum_sq);
        const double coef = std::min(1.0, clip / (norm + 1e-6));
        // The small clip must clip, the large one must not.
        REQUIRE((clip < 1.0 ? coef < 0.5 : coef == 1.0));
        for (int stage = 0; stage <= 3; ++stage) {
          CAPTURE(type, clip, world, stage, norm, coef);
          auto got = run_in_process_world<ClipResult>(world, [&](int rank, std::shared_ptr<Comm> comm) {
            return clipped_step(stage, type, clip, rank, comm);
          });
          for (int rank = 0; rank < world; ++rank) {
            CAPTURE(rank);
            const ClipResult& mine = got[size_t(rank)];
            // Reported before clipping (StepResult::grad_norm).
            REQUIRE(std::abs(mine.grad_norm - norm) <= 1e-5 * norm);
            for (size_t i = 0; i < kShapes.size(); ++i) {
              CAPTURE(i);
              const at::Tensor g = mean[i] * coef;
              // One step from zero state: SGD's lr * g; Adam's bias-corrected m / (sqrt(v) + eps)
              // is g / (|g| + eps).
              const at::Tensor update = type == "SGD" ? g * kLr : g / (g.abs() + kClipAdamEps) * kLr;
              const at::Tensor want = initial(i).to(at::kDouble) - update;
              const double err = (mine.values[i].to(at::kDouble) - want).abs().max().item<double>();
              REQUIRE(err <= 1e-6 * want.abs().max().item<double>());
            }
          }
        }
      }
    }
  }
}
