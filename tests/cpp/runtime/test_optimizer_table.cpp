// The optimizer table (runtime/optim): every row can be named in a config and has a reader, names
// are unique, and Lamb's two phases over a tensor split into pieces (as ZeRO shards it) give the
// update of DeepSpeed's FusedLamb on the whole tensor.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <set>

#include "runtime/config/blocks.h"
#include "runtime/config/config.h"
#include "runtime/error.h"
#include "runtime/optim/table.h"

// c10's logging header defines its own CHECK (a fatal log, not a Catch2 assertion): REQUIRE here.

using namespace zeroshard;

TEST_CASE("every optimizer row has a config reader and unique names") {
  std::set<std::string> seen;
  for (const OptimizerRow* row : optimizer_rows()) {
    REQUIRE(!row->types.empty());
    REQUIRE(!row->state_names.empty());
    REQUIRE(row->update != nullptr);
    for (const auto& t : row->types) {
      REQUIRE(seen.insert(t).second);
      REQUIRE(&optimizer_row(t) == row);
      REQUIRE(config::has_optimizer_reader(t));
      // The row's keys are what its config reader fills: the resolved params block.
      const Config c = parse_config(R"({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": ")" + t +
                                        R"("}})", "<table>");
      std::set<std::string> resolved, listed;
      for (const auto& [k, v] : c.resolved["optimizer"]["params"].items()) resolved.insert(k);
      listed.insert(row->group_keys.begin(), row->group_keys.end());
      listed.insert(row->config_keys.begin(), row->config_keys.end());
      REQUIRE(resolved == listed);
    }
    for (const auto& k : row->group_keys) REQUIRE(std::string(hyper_key(k).name) == k);
    // A row with per-tensor norms computes them before the update: it cannot fuse the statistics.
    REQUIRE(!(row->fuses_grad_stats && row->tensor_norms));
  }
  REQUIRE_THROWS_WITH(optimizer_row("Adamax"),
                      "optimizer.type: got \"Adamax\", expected one of Adam, AdamW, SGD, Adagrad, Lion, Lamb");
}

namespace {
struct LambRef {
  double lr = 2e-2, beta1 = 0.9, beta2 = 0.99, eps = 1e-6, wd = 0.01, max_coeff = 10, min_coeff = 0.01;
  bool eps_inside_sqrt = false;
};

// FusedLamb on one whole tensor, in double: moments, update = m / (sqrt(v) + eps) + wd * w, the
// clamped trust ratio ||w|| / ||update||, w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * ratio * update.
void lamb_reference(at::Tensor& w, at::Tensor& m, at::Tensor& v, const at::Tensor& g, int64_t t,
                    const LambRef& r) {
  m.mul_(r.beta1).add_(g, 1 - r.beta1);
  v.mul_(r.beta2).addcmul_(g, g, 1 - r.beta2);
  const at::Tensor denom = r.eps_inside_sqrt ? (v + r.eps).sqrt() : v.sqrt() + r.eps;
  const at::Tensor u = m / denom + r.wd * w;
  const double wn = w.norm().item<double>(), un = u.norm().item<double>();
  double ratio = 1.0;
  if (wn > 0 && un > 0) ratio = std::min(r.max_coeff, std::max(r.min_coeff, wn / un));
  const double step = r.lr * std::sqrt(1 - std::pow(r.beta2, double(t))) / (1 - std::pow(r.beta1, double(t)));
  w.sub_(u, step * ratio);
}
}  // namespace

TEST_CASE("Lamb's two phases over pieces of a tensor match FusedLamb on the whole tensor") {
  at::manual_seed(3);
  const OptimizerRow& row = optimizer_row("Lamb");
  REQUIRE(row.tensor_norms != nullptr);
  const int64_t n = 1000;
  // The common case, then large weights and small gradients (the ratio clamped at max_coeff); eps
  // outside and inside the square root.
  for (const auto& [weight_scale, inside] : {std::pair{1.0, false}, {1e4, false}, {1.0, true}}) {
    OptimizerConfig config;
    config.type = "Lamb";
    config.eps_inside_sqrt = inside;
    LambRef r;
    r.eps_inside_sqrt = inside;
    r.eps = inside ? 1e-3 : r.eps;  // large enough to change the result when misplaced
    GroupHyper h;
    h.lr = r.lr, h.beta1 = r.beta1, h.beta2 = r.beta2, h.eps = r.eps, h.weight_decay = r.wd;
    at::Tensor w = at::randn({n}, at::kDouble) * weight_scale;
    at::Tensor m = at::zeros({n}, at::kDouble), v = at::zeros({n}, at::kDouble);
    at::Tensor master = w.to(at::kFloat);
    at::Tensor m32 = at::zeros({n}, at::kFloat), v32 = at::zeros({n}, at::kFloat);
    at::Tensor p16 = at::zeros({n}, at::kBFloat16);
    for (int64_t t = 1; t <= 5; ++t) {
      const at::Tensor g = at::randn({n}, at::kDouble) * 1e-2;
      lamb_reference(w, m, v, g, t, r);
      // Three uneven pieces, as three ranks' shards of the tensor.
      const int64_t cuts[] = {0, 170, 555, n};
      UpdateScalars s;
      s.step = t;
      s.grad_scale = 0.5;  // the gradient arrives scaled by 2 (a loss scale)
      at::Tensor sums = at::zeros({2}, at::kDouble);
      std::vector<UpdatePiece> pieces;
      for (int k = 0; k < 3; ++k) {
        const int64_t b = cuts[k], len = cuts[k + 1] - cuts[k];
        UpdatePiece p;
        p.master = master.narrow(0, b, len);
        p.grad = (g.narrow(0, b, len) * 2).to(at::kFloat);
        p.state = {m32.narrow(0, b, len), v32.narrow(0, b, len)};
        p.param16 = p16.narrow(0, b, len);
        row.tensor_norms(p, h, config, s, sums);
        pieces.push_back(p);
      }
      s.w_sq = sums[0].item<double>();
      s.u_sq = sums[1].item<double>();
      for (const auto& p : pieces) row.update(p, h, config, s, nullptr);
    }
    REQUIRE(at::allclose(master.to(at::kDouble), w, 1e-5, 1e-6 * weight_scale));
    REQUIRE(at::equal(p16, master.to(at::kBFloat16)));
  }
}
