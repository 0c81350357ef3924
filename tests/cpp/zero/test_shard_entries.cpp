// What a rank holds, as checkpoint entries (zero/shard_entries.cpp through
// ZeroOptimizer::shard_entries), in one process at world 1-4, stages 0-3, fp32 and bf16 models,
// two parameter groups and two frozen parameters: each parameter's kinds ("param", "master" for
// 16-bit models, the optimizer state after a step or with with_state), entries that tile each
// tensor once over the ranks (or are whole on every rank where replicated), values equal to the
// live storage, and views through which a load's writes reach what the next step uses.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/in_process_world.h"
#include "zero/optimizer.h"

// c10's logging header defines its own CHECK (a fatal log, not a Catch2 assertion): REQUIRE here.

using namespace zeroshard;

namespace {

// Trainable 0-1 (group 0) and 2-3 (group 1), then frozen 4-5. The 1-element tensor leaves every
// rank but one without a piece of it at world > 1.
const std::vector<std::vector<int64_t>> kShapes = {{5, 3}, {7}, {4, 4}, {1}, {3, 3}, {2}};
const std::vector<size_t> kGroupOf = {0, 0, 1, 1};
constexpr int64_t kTrainable = 4;
const std::vector<std::string> kStateNames = {"exp_avg", "exp_avg_sq"};  // AdamW's
constexpr double kLr = 0.01, kBeta2 = 0.999;

int64_t numel_of(size_t i) { return c10::multiply_integers(kShapes[i]); }

at::Tensor initial(size_t i) {
  return at::linspace(-1.0, 1.0, numel_of(i), at::kFloat).mul_(double(i + 1)).view(kShapes[i]);
}

at::Tensor gradient(size_t i, int rank) {
  return at::sin(at::arange(numel_of(i), at::kFloat).mul_(double(i + 1)).add_(0.3 * rank)).view(kShapes[i]);
}

// Values a test writes through the views, exact in bf16: the master ("param" of an fp32 model),
// the 16-bit model copy, and exp_avg_sq (exp_avg is written as zeros).
at::Tensor master_marker(size_t i) { return at::arange(numel_of(i), at::kFloat).mul_(0.25).add_(double(i) + 0.5); }
at::Tensor model_marker(size_t i) { return master_marker(i).neg(); }
at::Tensor sq_marker(size_t i) { return at::arange(numel_of(i), at::kFloat).mul_(0.5).add_(1.0); }

Config config(int stage, at::ScalarType dtype) {
  const std::string json = std::string("{\"train_micro_batch_size_per_gpu\": 1, ") +
      (dtype == at::kBFloat16 ? "\"bf16\": {\"enabled\": true}, " : "") +
      "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01}}, "
      "\"zero_optimization\": {\"stage\": " + std::to_string(stage) +
      ", \"reduce_bucket_size\": 20, \"stage3_param_persistence_threshold\": 0}}";
  return parse_config(json, "<test_shard_entries>");
}

// One rank's optimizer over the trainable tensors in two groups, with the frozen ones, and at
// stage 3 the Parameters attached (as the engine does).
struct Run {
  Config cfg;
  std::unique_ptr<ZeroOptimizer> opt;
  std::vector<at::Tensor> params;
  Run(int stage, at::ScalarType dtype, std::shared_ptr<Comm> comm) : cfg(config(stage, dtype)) {
    std::vector<std::vector<at::Tensor>> groups(2);
    std::vector<at::Tensor> frozen;
    for (size_t i = 0; i < kShapes.size(); ++i) {
      if (int64_t(i) < kTrainable) groups[kGroupOf[i]].push_back(initial(i));
      else frozen.push_back(initial(i).to(dtype));
    }
    opt = std::make_unique<ZeroOptimizer>(comm, cfg, cfg.optimizer, groups, dtype,
                                          std::vector<std::vector<ChunkedShape>>{}, frozen);
    if (opt->strategy().partitions_params()) {
      for (size_t i = 0; i < kShapes.size(); ++i) params.push_back(initial(i).to(dtype));
      opt->coordinator().gatherer().attach(params);
    }
  }
  // One step; `zero_grads` makes AdamW's update m / (sqrt(v) + eps) exactly zero once exp_avg is.
  void step(int rank, int world_size, bool zero_grads, at::ScalarType dtype) {
    GroupHyper h;
    h.lr = kLr, h.beta2 = kBeta2, h.weight_decay = 0.0;
    opt->before_backward(true);
    for (int64_t i = kTrainable; i-- > 0;) {  // backward order
      const at::Tensor g = gradient(size_t(i), rank).to(dtype);
      opt->grad_ready(i, zero_grads ? at::zeros_like(g) : g);
    }
    opt->after_backward(true);
    opt->step({h, h}, world_size);
  }
};

// An entry as the caller thread checks it: the view's values copied out.
struct Seen {
  std::string kind;
  int64_t index = 0;
  int64_t tensor_begin = 0;
  at::Tensor values;
  bool replicated = false;
  bool one_dim = false;
};

std::vector<Seen> seen(const std::vector<ShardEntry>& entries) {
  std::vector<Seen> out;
  for (const ShardEntry& e : entries) {
    out.push_back({e.kind, e.index, e.tensor_begin, e.values.clone(), e.replicated, e.values.dim() == 1});
  }
  return out;
}

// What a rank saw: its entries, and each parameter's whole values as FullValues assembles them
// from the live storage (every rank makes the same collective calls): by (index, kind), "param"
// the model copy (the master's rounding for trainable tensors).
struct RankResult {
  std::vector<Seen> entries;
  std::map<std::pair<int64_t, std::string>, at::Tensor> whole;
  // The model copy of each parameter, flattened: param_views() at stages 0-2 (trainable ones),
  // the gathered Parameters at stage 3 (frozen ones too).
  std::vector<at::Tensor> model;
};

// `state_from_storage`: the state's whole values from FullValues (a collective on every rank);
// else torch's initial ones (AdamW: zeros), as shard_entries(true) creates them before a step.
void read_whole(Run& run, bool has_state, bool state_from_storage, at::ScalarType dtype, RankResult& r) {
  ZeroOptimizer& opt = *run.opt;
  const bool partitioned = opt.strategy().partitions_params();
  for (int64_t i = 0; i < int64_t(kShapes.size()); ++i) {
    if (i >= kTrainable && !partitioned) break;  // stages 0-2 leave frozen parameters to the model
    const at::Tensor fp32 = opt.full_values().get(i, "fp32_param").reshape({-1});
    r.whole[{i, "param"}] = fp32.to(dtype);
    if (i >= kTrainable) continue;
    r.whole[{i, "master"}] = fp32;
    if (!has_state) continue;
    for (const auto& name : kStateNames) {
      r.whole[{i, name}] = state_from_storage ? opt.full_values().get(i, name).reshape({-1})
                                              : at::zeros({numel_of(size_t(i))}, at::kFloat);
    }
  }
  if (!partitioned) {
    for (const auto& g : opt.param_views())
      for (const auto& v : g) r.model.push_back(v.reshape({-1}).clone());
    return;
  }
  std::vector<int64_t> all(kShapes.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = int64_t(i);
  opt.coordinator().gatherer().fetch_params(all);
  for (const auto& p : run.params) r.model.push_back(p.reshape({-1}).clone());
  opt.coordinator().gatherer().release_params(all);
}

// The kinds of parameter i, in entry order, for this scenario.
std::vector<std::string> kinds_of(int64_t i, at::ScalarType dtype, bool has_state) {
  std::vector<std::string> out = {"param"};
  if (i >= kTrainable) return out;
  if (dtype != at::kFloat) out.push_back("master");
  if (has_state) out.insert(out.end(), kStateNames.begin(), kStateNames.end());
  return out;
}

// The ranks' entries of each (index, kind) are whole on every rank where replicated, else tile
// [0, numel) exactly once; every entry holds the live values; each rank's kinds of one parameter
// come in order and cover one range (stage 3's "param" too).
void check_entries(const std::vector<RankResult>& ranks, int stage, at::ScalarType dtype, bool has_state) {
  const int world = int(ranks.size());
  const int64_t num_params = stage == 3 ? int64_t(kShapes.size()) : kTrainable;
  for (int64_t i = 0; i < num_params; ++i) {
    const int64_t numel = numel_of(size_t(i));
    for (const std::string& kind : kinds_of(i, dtype, has_state)) {
      CAPTURE(i, kind);
      const bool replicated = stage == 0 || (kind == "param" && stage < 3);
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (int rank = 0; rank < world; ++rank) {
        CAPTURE(rank);
        int count = 0;
        for (const Seen& e : ranks[size_t(rank)].entries) {
          if (e.index != i || e.kind != kind) continue;
          ++count;
          REQUIRE(e.one_dim);
          REQUIRE(e.replicated == replicated);
          REQUIRE(e.values.scalar_type() == (kind == "param" ? dtype : at::kFloat));
          REQUIRE(e.values.numel() > 0);
          const at::Tensor& whole = ranks[size_t(rank)].whole.at({i, kind});
          REQUIRE(at::equal(e.values, whole.narrow(0, e.tensor_begin, e.values.numel())));
          ranges.emplace_back(e.tensor_begin, e.tensor_begin + e.values.numel());
        }
        REQUIRE(count <= 1);
        if (replicated) REQUIRE(count == 1);
      }
      std::sort(ranges.begin(), ranges.end());
      if (replicated) {
        for (const auto& r : ranges) REQUIRE(r == std::make_pair(int64_t(0), numel));
        continue;
      }
      int64_t covered = 0;
      for (const auto& r : ranges) {
        REQUIRE(r.first == covered);
        covered = r.second;
      }
      REQUIRE(covered == numel);
    }
  }
  for (int rank = 0; rank < world; ++rank) {
    CAPTURE(rank);
    const auto& entries = ranks[size_t(rank)].entries;
    for (size_t k = 0; k < entries.size(); ++k) {
      const Seen& e = entries[k];
      CAPTURE(k, e.index, e.kind);
      REQUIRE(e.index >= 0);
      REQUIRE(e.index < num_params);
      // By parameter, trainable first: frozen ones (stage 3) come after every trainable one.
      if (k > 0) REQUIRE(entries[k - 1].index <= e.index);
      const auto kinds = kinds_of(e.index, dtype, has_state);
      REQUIRE(std::find(kinds.begin(), kinds.end(), e.kind) != kinds.end());
      // A parameter's kinds in order; those sharded on this rank over one range.
      if (k > 0 && entries[k - 1].index == e.index) {
        const Seen& prev = entries[k - 1];
        REQUIRE(std::find(kinds.begin(), kinds.end(), prev.kind) < std::find(kinds.begin(), kinds.end(), e.kind));
        if (!prev.replicated || stage == 0) {
          REQUIRE(prev.tensor_begin == e.tensor_begin);
          REQUIRE(prev.values.numel() == e.values.numel());
        }
      }
    }
  }
}

enum class When { before_step, before_step_with_state, after_step };

}  // namespace

TEST_CASE("shard_entries tile every parameter over the ranks and hold the live values, stages 0-3, world 1-4") {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int stage = 0; stage <= 3; ++stage) {
      for (int world = 1; world <= 4; ++world) {
        for (const When when : {When::before_step, When::before_step_with_state, When::after_step}) {
          CAPTURE(dtype, stage, world, int(when));
          const bool has_state = when != When::before_step;
          auto ranks = run_in_process_world<RankResult>(world, [&](int rank, std::shared_ptr<Comm> comm) {
            Run run(stage, dtype, comm);
            if (when == When::after_step) run.step(rank, world, false, dtype);
            RankResult r;
            r.entries = seen(run.opt->shard_entries(when == When::before_step_with_state));
            read_whole(run, has_state, when == When::after_step, dtype, r);
            return r;
          });
          check_entries(ranks, stage, dtype, has_state);
          for (int rank = 0; rank < world; ++rank) {
            CAPTURE(rank);
            const RankResult& r = ranks[size_t(rank)];
            REQUIRE(int64_t(r.model.size()) == (stage == 3 ? int64_t(kShapes.size()) : kTrainable));
            for (size_t m = 0; m < r.model.size(); ++m) {  // "param" is the model copy itself
              REQUIRE(at::equal(r.model[m], r.whole.at({int64_t(m), "param"})));
            }
            if (when == When::after_step) continue;
            // Before any step: the initial values, the model copy their rounding, zero state.
            for (const auto& [key, whole] : r.whole) {
              const size_t i = size_t(key.first);
              CAPTURE(i, key.second);
              at::Tensor want = initial(i).reshape({-1});
              if (key.second == "param") want = want.to(dtype);
              else if (key.second != "master") want = at::zeros_like(want);
              REQUIRE(at::equal(whole, want));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("writes through shard_entries' views are what FullValues reads and the next step uses") {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    for (int stage = 0; stage <= 3; ++stage) {
      for (int world = 1; world <= 4; ++world) {
        CAPTURE(dtype, stage, world);
        struct Result {
          RankResult written;  // read back after the writes
          RankResult stepped;  // after a step with zero gradients
        };
        auto ranks = run_in_process_world<Result>(world, [&](int rank, std::shared_ptr<Comm> comm) {
          Run run(stage, dtype, comm);
          run.step(rank, world, false, dtype);  // state exists and differs from what is written next
          // What a load does: every rank writes its entries' ranges of the same whole values.
          for (const ShardEntry& e : run.opt->shard_entries(false)) {
            const size_t i = size_t(e.index);
            at::Tensor whole;
            if (e.kind == "master" || (e.kind == "param" && dtype == at::kFloat && e.index < kTrainable)) {
              whole = master_marker(i);
            } else if (e.kind == "param") {
              whole = model_marker(i);
            } else if (e.kind == "exp_avg") {
              whole = at::zeros({numel_of(i)}, at::kFloat);
            } else {
              whole = sq_marker(i);
            }
            e.values.copy_(whole.narrow(0, e.tensor_begin, e.values.numel()));
          }
          run.opt->after_load();
          Result out;
          read_whole(run, true, true, dtype, out.written);
          run.step(rank, world, true, dtype);
          out.stepped.entries = seen(run.opt->shard_entries(false));
          read_whole(run, true, true, dtype, out.stepped);
          return out;
        });
        const int64_t num_params = stage == 3 ? int64_t(kShapes.size()) : kTrainable;
        for (int rank = 0; rank < world; ++rank) {
          CAPTURE(rank);
          const Result& r = ranks[size_t(rank)];
          for (int64_t i = 0; i < num_params; ++i) {
            CAPTURE(i);
            const size_t t = size_t(i);
            const auto& w = r.written.whole;
            const auto& s = r.stepped.whole;
            if (i >= kTrainable) {  // frozen (stage 3): the model copy only, which no step changes
              REQUIRE(at::equal(w.at({i, "param"}), model_marker(t).to(dtype)));
              REQUIRE(at::equal(r.written.model[t], model_marker(t).to(dtype)));
              REQUIRE(at::equal(s.at({i, "param"}), model_marker(t).to(dtype)));
              REQUIRE(at::equal(r.stepped.model[t], model_marker(t).to(dtype)));
              continue;
            }
            REQUIRE(at::equal(w.at({i, "master"}), master_marker(t)));
            REQUIRE(at::equal(w.at({i, "exp_avg"}), at::zeros({numel_of(t)}, at::kFloat)));
            REQUIRE(at::equal(w.at({i, "exp_avg_sq"}), sq_marker(t)));
            // The model copy as written (the master itself for fp32), gathered from the written
            // chunks at stage 3.
            REQUIRE(at::equal(r.written.model[t], dtype == at::kFloat ? master_marker(t) : model_marker(t).to(dtype)));
            // The step started from the written state: exp_avg 0 makes the update exactly 0, the
            // written exp_avg_sq decays by beta2, and the model copy is the master's again.
            REQUIRE(at::equal(s.at({i, "master"}), master_marker(t)));
            REQUIRE(at::equal(s.at({i, "exp_avg"}), at::zeros({numel_of(t)}, at::kFloat)));
            REQUIRE(at::allclose(s.at({i, "exp_avg_sq"}), sq_marker(t) * kBeta2, 1e-6, 0.0));
            REQUIRE(at::equal(r.stepped.model[t], master_marker(t).to(dtype)));
          }
        }
        // The entries after that step hold those live values too, tiled as before.
        std::vector<RankResult> stepped;
        for (const Result& r : ranks) stepped.push_back(r.stepped);
        check_entries(stepped, stage, dtype, true);
      }
    }
  }
}

// Without this, FullValues::get of a state is a collective some ranks skip (they return "no state
// yet") between a load and the first step: a rank whose owned range of a group is only alignment
// padding (here stage 1-2, world 3-4, group 1) must create that group's state as well.
TEST_CASE("shard_entries(with_state) creates the optimizer state of every group on every rank") {
  for (int stage = 0; stage <= 3; ++stage) {
    for (int world = 1; world <= 4; ++world) {
      CAPTURE(stage, world);
      auto got = run_in_process_world<std::vector<int64_t>>(world, [&](int, std::shared_ptr<Comm> comm) {
        Run run(stage, at::kFloat, comm);
        run.opt->shard_entries(true);
        int64_t shard_numel = 0;
        for (int64_t g = 0; g < 2; ++g) shard_numel += run.opt->master(g).numel();
        const int64_t want = shard_numel * int64_t(sizeof(float)) * int64_t(kStateNames.size());
        return std::vector<int64_t>{run.opt->memory().bytes(MemoryCategory::optimizer_state), want};
      });
      for (int rank = 0; rank < world; ++rank) {
        CAPTURE(rank);
        REQUIRE(got[size_t(rank)][0] == got[size_t(rank)][1]);
      }
    }
  }
}
