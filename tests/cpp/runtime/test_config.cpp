// runtime/config: every example config loads; every error message is checked word for word
// (scenarios are rows of a table); batch triplet rules; "auto"; comments; duplicate keys.
#include <catch2/catch.hpp>

#include <dirent.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/error.h"

using zeroshard::Config;
using zeroshard::ConfigError;
using zeroshard::parse_config;

namespace {

std::string error_of(const std::string& text, const std::string& source = "ds_config.json",
                     int64_t world = 1) {
  try {
    Config c = parse_config(text, source);
    c.resolve_batch(world);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "<no error>";
}

// Most cases only need a valid batch so the error under test is the one reported.
std::string with_batch(const std::string& body) {
  return "{\"train_micro_batch_size_per_gpu\": 1" + (body.empty() ? "" : ", " + body) + "}";
}

}  // namespace

TEST_CASE("every example config in configs/ loads and resolves") {
  const std::string dir = std::string(ZEROSHARD_SOURCE_DIR) + "/configs";
  DIR* d = opendir(dir.c_str());
  REQUIRE(d != nullptr);
  std::vector<std::string> files;
  while (dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.size() > 5 && name.substr(name.size() - 5) == ".json") files.push_back(name);
  }
  closedir(d);
  REQUIRE(files.size() >= 5);
  for (const auto& name : files) {
    INFO(name);
    std::ifstream in(dir + "/" + name);
    std::stringstream text;
    text << in.rdbuf();
    Config c = parse_config(text.str(), name);
    auto r = c.resolve_batch(2);
    CHECK(r.train_batch_size == r.train_micro_batch_size_per_gpu * r.gradient_accumulation_steps * 2);
  }
}

TEST_CASE("demo_zero.json is what `make demo` expects") {
  std::ifstream in(std::string(ZEROSHARD_SOURCE_DIR) + "/configs/demo_zero.json");
  std::stringstream text;
  text << in.rdbuf();
  Config c = parse_config(text.str(), "demo_zero.json");
  // The main job: ZeRO-3 in bf16 (issue 2: once ZeRO-3 lands, the demo uses it).
  CHECK(c.zero_optimization.stage == 3);
  CHECK(c.precision() == zeroshard::Precision::bf16);
  CHECK(c.optimizer.type == "AdamW");
  CHECK(c.optimizer.hyper.lr == Approx(6e-4));
  CHECK(c.scheduler.type == "WarmupLR");
  CHECK(c.steps_per_print == 10);
  CHECK(c.gradient_clipping == 1.0);
  auto r = c.resolve_batch(1);
  CHECK(r.train_micro_batch_size_per_gpu == 8);
  CHECK(r.gradient_accumulation_steps == 1);
}

TEST_CASE("error messages, exactly") {
  struct Case {
    std::string json;
    std::string message;
  };
  const std::vector<Case> cases = {
      // values and types
      {with_batch(R"("zero_optimization": {"stage": 4})"),
       "ds_config.json: zero_optimization.stage: got 4, expected one of 0, 1, 2, 3"},
      {with_batch(R"("zero_optimization": {"stage": "two"})"),
       "ds_config.json: zero_optimization.stage: got \"two\" (string), expected one of 0, 1, 2, 3"},
      {with_batch(R"("gradient_clipping": "high")"),
       "ds_config.json: gradient_clipping: got \"high\" (string), expected a number"},
      {with_batch(R"("gradient_clipping": -1)"),
       "ds_config.json: gradient_clipping: got -1, expected a number >= 0"},
      {with_batch(R"("steps_per_print": 0)"),
       "ds_config.json: steps_per_print: got 0, expected an integer >= 1"},
      {with_batch(R"("zero_optimization": {"reduce_bucket_size": 2.5})"),
       "ds_config.json: zero_optimization.reduce_bucket_size: got 2.5, expected an integer"},
      {with_batch(R"("fp16": {"enabled": "yes"})"),
       "ds_config.json: fp16.enabled: got \"yes\" (string), expected a boolean"},
      {with_batch(R"("fp16": [1])"), "ds_config.json: fp16: got [1] (array), expected an object"},
      {"[1, 2]", "ds_config.json: got [1,2] (array), expected an object"},
      {R"({"train_batch_size": 0})", "ds_config.json: train_batch_size: got 0, expected an integer >= 1"},
      {with_batch(R"("communication_data_type": "int8")"),
       "ds_config.json: communication_data_type: got \"int8\", expected one of \"fp32\", \"fp16\", \"bf16\""},
      {with_batch(R"("checkpoint": {"tag_validation": "Strict"})"),
       "ds_config.json: checkpoint.tag_validation: got \"Strict\", expected one of \"Ignore\", \"Warn\", \"Fail\""},
      {with_batch(R"("zero_optimization": {"offload_optimizer": {"device": "gpu"}})"),
       "ds_config.json: zero_optimization.offload_optimizer.device: got \"gpu\", expected one of \"none\", \"cpu\", \"nvme\""},
      {with_batch(R"("zero_optimization": {"offload_param": {"device": "nvme"}})"),
       "ds_config.json: zero_optimization.offload_param.nvme_path: missing, required when device is \"nvme\""},
      {with_batch(R"("pipeline": {"stages": 0})"),
       "ds_config.json: pipeline.stages: got 0 (number), expected \"auto\" or an integer >= 1"},
      // optimizer
      {with_batch(R"("optimizer": {"type": "Adamm"})"),
       "ds_config.json: optimizer.type: got \"Adamm\", expected one of \"Adam\", \"AdamW\", \"SGD\", \"Adagrad\", \"Lion\", "
       "\"Lamb\""},
      {with_batch(R"("optimizer": {"type": "onebitadam"})"),
       "ds_config.json: optimizer.type: got \"onebitadam\", expected one of \"Adam\", \"AdamW\", \"SGD\", \"Adagrad\", "
       "\"Lion\", \"Lamb\" (OneBitAdam: not supported by zeroshard)"},
      {with_batch(R"("optimizer": {"type": "Lamb", "params": {"min_coeff": 2, "max_coeff": 1}})"),
       "ds_config.json: optimizer.params.min_coeff: got 2, expected at most max_coeff (1)"},
      {with_batch(R"("optimizer": {"type": "Lamb", "params": {"momentum": 0.9}})"),
       "ds_config.json: optimizer.params.momentum: not a parameter of Lamb; expected one of \"amsgrad\", \"betas\", "
       "\"bias_correction\", \"eps\", \"eps_inside_sqrt\", \"lr\", \"max_coeff\", \"min_coeff\", \"weight_decay\""},
      {with_batch(R"("optimizer": {"params": {"lr": 0.1}})"),
       "ds_config.json: optimizer.type: missing, expected one of \"Adam\", \"AdamW\", \"SGD\", \"Adagrad\", \"Lion\", "
       "\"Lamb\""},
      {with_batch(R"("optimizer": {"type": "Adam", "params": {"amsgrad": true}})"),
       "ds_config.json: optimizer.params.amsgrad: got true, expected false (AMSGrad: not supported by zeroshard)"},
      {with_batch(R"("optimizer": {"type": "Adam", "params": {"betas": [0.9]}})"),
       "ds_config.json: optimizer.params.betas: got [0.9] (array), expected an array of 2 numbers"},
      {with_batch(R"("optimizer": {"type": "Lion", "params": {"betas": [0.9, 1.5]}})"),
       "ds_config.json: optimizer.params.betas: got [0.9,1.5], expected 2 numbers in [0, 1)"},
      {with_batch(R"("optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}})"),
       "ds_config.json: optimizer.params.betas: not a parameter of Adagrad; expected one of \"eps\", "
       "\"initial_accumulator_value\", \"lr\", \"lr_decay\", \"weight_decay\""},
      {with_batch(R"("optimizer": {"type": "SGD", "params": {"nesterov": true}})"),
       "ds_config.json: optimizer.params.nesterov: got true, expected false unless momentum > 0 and dampening is 0"},
      {with_batch(R"("optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}})"),
       "ds_config.json: optimizer.params.max_grad_norm: not an optimizer parameter; use the top-level "
       "\"gradient_clipping\""},
      // scheduler
      {with_batch(R"("scheduler": {"type": "CosineLR"})"),
       "ds_config.json: scheduler.type: got \"CosineLR\", expected one of \"WarmupLR\", \"WarmupDecayLR\", "
       "\"WarmupCosineLR\", \"OneCycle\", \"LRRangeTest\""},
      {with_batch(R"("scheduler": {"type": "WarmupDecayLR", "params": {}})"),
       "ds_config.json: scheduler.params.total_num_steps: missing, required by WarmupDecayLR (an integer >= 1)"},
      {with_batch(R"("scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}})"),
       "ds_config.json: scheduler.params.cycle_min_lr: missing, required by OneCycle (a number >= 0)"},
      {with_batch(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}})"),
       "ds_config.json: scheduler.params.warmup_type: got \"cosine\", expected one of \"log\", \"linear\""},
      {with_batch(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}})"),
       "ds_config.json: scheduler.params.warmup_num_steps: got 0, expected an integer >= 1"},
      {with_batch(R"("scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "big"}})"),
       "ds_config.json: scheduler.params.warmup_max_lr: got \"big\" (string), expected a number >= 0 or a list "
       "of them (one per parameter group)"},
      {with_batch(R"("scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}})"),
       "ds_config.json: scheduler.params: unknown key \"total_num_steps\"; expected one of \"last_batch_iteration\", "
       "\"warmup_max_lr\", \"warmup_min_lr\", \"warmup_num_steps\", \"warmup_type\""},
      // precision
      {with_batch(R"("fp16": {"enabled": true}, "bf16": {"enabled": true})"),
       "ds_config.json: bf16.enabled: got true, expected false when fp16.enabled is true (fp16 and bf16 are "
       "mutually exclusive)"},
      {with_batch(R"("fp16": {"enabled": true}, "bfloat16": {"enabled": true})"),
       "ds_config.json: bfloat16.enabled: got true, expected false when fp16.enabled is true (fp16 and bf16 are "
       "mutually exclusive)"},
      {with_batch(R"("bf16": {"enabled": true}, "bfloat16": {"enabled": true})"),
       "ds_config.json: bfloat16: given together with \"bf16\"; it is the old name of the same block, keep one"},
      {with_batch(R"("fp16": {"loss_scale_window": 0})"),
       "ds_config.json: fp16.loss_scale_window: got 0, expected an integer >= 1"},
      {with_batch(R"("fp16": {"fp16_master_weights_and_grads": true})"),
       "ds_config.json: fp16.fp16_master_weights_and_grads: got true, expected false (fp16 master weights: not "
       "supported by zeroshard)"},
      // unknown keys, at every level
      {with_batch(R"("gradient_clipp1ng": 1.0)"),
       "ds_config.json: unknown key \"gradient_clipp1ng\"; did you mean \"gradient_clipping\"?"},
      {with_batch(R"("zero_optimization": {"stag": 1})"),
       "ds_config.json: zero_optimization: unknown key \"stag\"; did you mean \"stage\"?"},
      {with_batch(R"("zero_optimization": {"offload_optimizer": {"devce": "cpu"}})"),
       "ds_config.json: zero_optimization.offload_optimizer: unknown key \"devce\"; did you mean \"device\"?"},
      {with_batch(R"("optimizer": {"type": "AdamW", "params": {"weight_decey": 0.1}})"),
       "ds_config.json: optimizer.params: unknown key \"weight_decey\"; did you mean \"weight_decay\"?"},
      {with_batch(R"("checkpoint": {"parallel_write": {"pipeline_stages": true}})"),
       "ds_config.json: checkpoint.parallel_write: unknown key \"pipeline_stages\"; did you mean \"pipeline_stage\"?"},
      {with_batch(R"("aio": {"xyz": 1})"),
       "ds_config.json: aio: unknown key \"xyz\"; expected one of \"block_size\", \"intra_op_parallelism\", "
       "\"overlap_events\", \"queue_depth\", \"single_submit\", \"thread_count\", \"use_gds\""},
      // not supported by zeroshard
      {with_batch(R"("zero_optimization": {"zero_quantized_weights": true})"),
       "ds_config.json: zero_optimization.zero_quantized_weights: got true, expected false (ZeRO++ quantized "
       "weights: not supported by zeroshard)"},
      {with_batch(R"("zero_optimization": {"mics_shard_size": 8})"),
       "ds_config.json: zero_optimization.mics_shard_size: got 8, expected -1 (MiCS: not supported by zeroshard)"},
      {with_batch(R"("zero_optimization": {"zero_hpz_partition_size": 8})"),
       "ds_config.json: zero_optimization.zero_hpz_partition_size: got 8, expected 1 (ZeRO++ hierarchical "
       "partitioning: not supported by zeroshard)"},
      {with_batch(R"("zero_optimization": {"stage": 3, "offload_optimizer": {"ratio": 0.3}})"),
       "ds_config.json: zero_optimization.offload_optimizer.ratio: got 0.3 with device \"none\"; ratio is the "
       "share of the optimizer offloaded, so it needs device \"cpu\" (or leave it at 1)"},
      {with_batch(R"("zero_optimization": {"stage3_max_live_parameters": 1, "max_live_parameters": 2})"),
       "ds_config.json: zero_optimization.max_live_parameters: given together with "
       "\"stage3_max_live_parameters\"; they are the same key, keep one"},
      {with_batch(R"("amp": {"enabled": true})"),
       "ds_config.json: amp.enabled: got true, expected false (Apex AMP: not supported by zeroshard)"},
      {with_batch(R"("sparse_gradients": true)"),
       "ds_config.json: sparse_gradients: got true, expected false (sparse gradients: not supported by zeroshard)"},
      {with_batch(R"("elasticity": {"enabled": true, "max_train_batch_size": 64})"),
       "ds_config.json: elasticity.enabled: got true, expected false (elastic training: not supported by zeroshard)"},
      {with_batch(R"("progressive_layer_drop": {"enabled": true})"),
       "ds_config.json: progressive_layer_drop.enabled: got true, expected false (progressive layer drop: not "
       "supported by zeroshard)"},
      {with_batch(R"("hybrid_engine": {"enabled": true})"),
       "ds_config.json: hybrid_engine.enabled: got true, expected false (the hybrid engine: not supported by "
       "zeroshard)"},
      {with_batch(R"("compression_training": {"weight_quantization": {}})"),
       "ds_config.json: compression_training: got {\"weight_quantization\":{}}, expected no "
       "\"compression_training\" block (compression training: not supported by zeroshard)"},
      {with_batch(R"("pipeline": {"schedule": "1f1b", "virtual_stages": 2})"),
       "ds_config.json: pipeline.virtual_stages: got 2 with schedule \"1f1b\"; several model chunks per rank "
       "need \"schedule\": \"interleaved_1f1b\" (else 1)"},
      // batch triplet
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1})",
       "ds_config.json: train_batch_size 32 != train_micro_batch_size_per_gpu 8 * gradient_accumulation_steps 1 "
       "* data-parallel world size 1 = 8"},
      {R"({"gradient_accumulation_steps": 4})",
       "ds_config.json: train_batch_size or train_micro_batch_size_per_gpu must be given "
       "(gradient_accumulation_steps 4 alone is not enough)"},
      {"{}", "ds_config.json: train_batch_size or train_micro_batch_size_per_gpu must be given (neither is set)"},
      // JSON itself
      {"{\n  \"train_micro_batch_size_per_gpu\": 8,\n  \"fp16\": {\"enabled\": tru}\n}",
       "ds_config.json:3:26: invalid JSON: syntax error while parsing value - invalid literal; last read: "
       "'\"enabled\": tru}'"},
      {"{\"a\": 1,}", "ds_config.json:1:9: invalid JSON: syntax error while parsing object key - unexpected '}'; "
                      "expected string literal"},
      {with_batch(R"("zero_optimization": {"stage": 1, "stage": 2})"),
       "ds_config.json: zero_optimization: duplicate key \"stage\""},
      {R"({"train_micro_batch_size_per_gpu": 1, "train_micro_batch_size_per_gpu": 2})",
       "ds_config.json: duplicate key \"train_micro_batch_size_per_gpu\""},
  };
  for (const auto& c : cases) {
    INFO(c.json);
    CHECK(error_of(c.json) == c.message);
  }
}

TEST_CASE("the source prefixes messages only when it names a file") {
  const std::string bad = with_batch(R"("zero_optimization": {"stage": 4})");
  CHECK(error_of(bad, "<dict>") == "zero_optimization.stage: got 4, expected one of 0, 1, 2, 3");
  CHECK(error_of(bad, "") == "zero_optimization.stage: got 4, expected one of 0, 1, 2, 3");
  CHECK(error_of(bad, "/tmp/x.json") == "/tmp/x.json: zero_optimization.stage: got 4, expected one of 0, 1, 2, 3");
  // A syntax error always says where, pseudo-names included.
  CHECK(error_of("{", "<dict>").rfind("<dict>:1:2: invalid JSON: ", 0) == 0);
}

TEST_CASE("batch triplet: DeepSpeed's reconciliation matrix") {
  struct Row {
    const char* json;
    int64_t world, tbs, micro, gas;
  };
  const std::vector<Row> rows = {
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4})", 2, 32, 4, 4},
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 2, 32, 4, 4},
      {R"({"train_batch_size": 32, "gradient_accumulation_steps": 4})", 2, 32, 4, 4},
      {R"({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4})", 2, 32, 4, 4},
      {R"({"train_batch_size": 32})", 2, 32, 16, 1},
      {R"({"train_micro_batch_size_per_gpu": 4})", 2, 8, 4, 1},
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"})", 4, 32, 8, 1},
      {R"({"train_batch_size": 5e1, "train_micro_batch_size_per_gpu": 25})", 1, 50, 25, 2},
  };
  for (const auto& r : rows) {
    INFO(r.json << " world " << r.world);
    Config c = parse_config(r.json, "ds_config.json");
    auto out = c.resolve_batch(r.world);
    CHECK(out.train_batch_size == r.tbs);
    CHECK(out.train_micro_batch_size_per_gpu == r.micro);
    CHECK(out.gradient_accumulation_steps == r.gas);
    CHECK(c.batch.train_batch_size == r.tbs);
    CHECK(c.resolved["train_batch_size"] == r.tbs);
    CHECK(c.resolved["train_micro_batch_size_per_gpu"] == r.micro);
    CHECK(c.resolved["gradient_accumulation_steps"] == r.gas);
  }
  SECTION("indivisible derivations show the arithmetic") {
    CHECK(error_of(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})", "ds_config.json", 2) ==
          "ds_config.json: train_batch_size 30 is not divisible by train_micro_batch_size_per_gpu 4 * "
          "data-parallel world size 2 = 8");
    CHECK(error_of(R"({"train_batch_size": 30, "gradient_accumulation_steps": 4})", "ds_config.json", 2) ==
          "ds_config.json: train_batch_size 30 is not divisible by gradient_accumulation_steps 4 * "
          "data-parallel world size 2 = 8");
    CHECK(error_of(R"({"train_batch_size": 30})", "ds_config.json", 4) ==
          "ds_config.json: train_batch_size 30 is not divisible by data-parallel world size 4 = 4");
    CHECK(error_of(R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1})",
                   "ds_config.json", 2) ==
          "ds_config.json: train_batch_size 32 != train_micro_batch_size_per_gpu 8 * gradient_accumulation_steps 1 "
          "* data-parallel world size 2 = 16");
    CHECK(error_of(R"({"train_micro_batch_size_per_gpu": 1})", "ds_config.json", 0) ==
          "ds_config.json: data-parallel world size: got 0, expected an integer >= 1");
  }
  SECTION("resolve_batch can be called again for another world size") {
    Config c = parse_config(R"({"train_batch_size": 32})", "x.json");
    CHECK(c.resolve_batch(2).train_micro_batch_size_per_gpu == 16);
    CHECK(c.resolve_batch(4).train_micro_batch_size_per_gpu == 8);
  }
}

TEST_CASE("\"auto\" takes the default and says so") {
  Config c = parse_config(R"({
      "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto",
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}},
      "zero_optimization": {"stage": "auto", "stage3_prefetch_bucket_size": "auto"}})",
                          "hf.json");
  auto r = c.resolve_batch(2);
  CHECK(r.train_micro_batch_size_per_gpu == 1);
  CHECK(r.gradient_accumulation_steps == 1);
  CHECK(r.train_batch_size == 2);
  CHECK(c.gradient_clipping == 0.0);
  CHECK(c.optimizer.hyper.lr == 1e-3);
  CHECK(c.zero_optimization.stage == 0);
  const std::vector<std::string> expected = {
      "\"optimizer.params.lr\": \"auto\" -> 0.001 (default)",
      "\"optimizer.params.betas\": \"auto\" -> [0.9,0.999] (default)",
      "\"gradient_clipping\": \"auto\" -> 0 (default)",
      "\"zero_optimization.stage\": \"auto\" -> 0 (default)",
      "\"zero_optimization.stage3_prefetch_bucket_size\": \"auto\" -> 50000000 (default)",
      "\"train_batch_size\": \"auto\" -> 2 (derived)",
      "\"train_micro_batch_size_per_gpu\": \"auto\" -> 1 (default)",
      "\"gradient_accumulation_steps\": \"auto\" -> 1 (default)",
  };
  CHECK(c.notes == expected);
  // Resolving again does not repeat the notes.
  c.resolve_batch(2);
  CHECK(c.notes.size() == expected.size());
}

TEST_CASE("comments, defaults, aliases and the resolved config") {
  Config c = parse_config(R"({
    // a line comment
    "train_micro_batch_size_per_gpu": 2, /* a block comment */
    "bfloat16": {"enabled": true},
    "communication_data_type": "BFloat16",
    "data_types": {"grad_accum_dtype": "torch.float32"},
    "optimizer": {"type": "adagrad"},
    "zero_optimization": {"stage": 3, "max_live_parameters": 5e8, "offload_optimizer": {"device": "CPU"}}
  })",
                          "c.json");
  CHECK(c.precision() == zeroshard::Precision::bf16);
  CHECK(c.communication_data_type == "bf16");
  CHECK(c.grad_accum_dtype == "fp32");
  CHECK(c.optimizer.type == "Adagrad");
  CHECK(c.optimizer.hyper.lr == 1e-2);
  CHECK(c.optimizer.hyper.eps == 1e-10);
  CHECK(c.zero_optimization.overlap_comm);  // stage 3 default
  CHECK(c.zero_optimization.stage3_max_live_parameters == 500000000);
  CHECK(c.zero_optimization.stage3_prefetch_bucket_size == 50000000);
  CHECK(c.zero_optimization.offload_optimizer.device == "cpu");
  CHECK(c.steps_per_print == 10);
  CHECK(c.gradient_clipping == 0.0);
  CHECK(c.zero_force_ds_cpu_optimizer);
  CHECK(c.resolved["bf16"]["enabled"] == true);
  CHECK(c.resolved["zero_optimization"]["stage3_max_live_parameters"] == 500000000);
  CHECK(!c.resolved["zero_optimization"].contains("max_live_parameters"));
  CHECK(c.resolved["zero_optimization"]["overlap_comm"] == true);
  CHECK(c.resolved["steps_per_print"] == 10);
  CHECK(c.resolved["train_batch_size"].is_null());  // until resolve_batch
  CHECK(c.notes.empty());

  Config s1 = parse_config(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}})", "x");
  CHECK(!s1.zero_optimization.overlap_comm);
  Config lion = parse_config(R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "LION"}})", "x");
  CHECK(lion.optimizer.hyper.lr == 1e-4);
  CHECK(lion.optimizer.hyper.beta2 == 0.99);
  // DeepSpeed's FusedLamb defaults.
  Config lamb = parse_config(R"({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "lamb"}})", "x");
  CHECK(lamb.optimizer.type == "Lamb");
  CHECK(lamb.optimizer.hyper.lr == 1e-3);
  CHECK(lamb.optimizer.hyper.beta2 == 0.999);
  CHECK(lamb.optimizer.hyper.max_coeff == 10.0);
  CHECK(lamb.optimizer.hyper.min_coeff == 0.01);
  CHECK(!lamb.optimizer.eps_inside_sqrt);
  Config adamw = parse_config(R"({"train_micro_batch_size_per_gpu": 2,
      "optimizer": {"type": "AdamW", "params": {"torch_adam": true}}})", "x");
  CHECK(adamw.optimizer.hyper.weight_decay == 0.01);
}

TEST_CASE("aio: thread_count is intra_op_parallelism's alias; use_gds is refused") {
  auto err = [](const std::string& aio) {
    try {
      parse_config("{\"train_micro_batch_size_per_gpu\": 1, \"aio\": " + aio + "}", "x");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_THAT(err(R"({"use_gds": true})"), Catch::Contains("aio.use_gds") && Catch::Contains("GPUDirect Storage"));
  CHECK_THAT(err(R"({"thread_count": 2, "intra_op_parallelism": 3})"),
             Catch::Contains("aio.thread_count") && Catch::Contains("intra_op_parallelism 3"));
  CHECK(err(R"({"thread_count": 2, "intra_op_parallelism": 2})").empty());
}

TEST_CASE("reporting keys are read without a note; deprecated keys get one warning note each") {
  Config c = parse_config(R"({"train_micro_batch_size_per_gpu": 1,
      "tensorboard": {"enabled": true, "output_path": "/tmp/tb", "job_name": "j"},
      "wandb": {"enabled": true, "team": "t", "group": "g", "project": "p"},
      "csv_monitor": {"enabled": false},
      "flops_profiler": {"enabled": true},
      "comms_logger": {"enabled": true, "prof_all": false, "prof_ops": ["all_reduce", "all_gather_into_tensor"]},
      "wall_clock_breakdown": true, "memory_breakdown": true,
      "aio": {"thread_count": 4},
      "zero_optimization": {"cpu_offload": true, "stage3_gather_fp16_weights_on_model_save": true}})",
                          "x");
  const std::vector<std::string> expected = {
      "warning: zero_optimization.cpu_offload: deprecated; read as offload_optimizer",
      "warning: zero_optimization.stage3_gather_fp16_weights_on_model_save: deprecated; use "
      "stage3_gather_16bit_weights_on_model_save (read as it)",
      "warning: aio.thread_count: taken as aio.intra_op_parallelism, the key DeepSpeed's code reads (it "
      "ignores thread_count); rename it",
  };
  CHECK(c.notes == expected);
  CHECK(c.wall_clock_breakdown);
  CHECK(c.memory_breakdown);
  CHECK(c.flops_profiler.enabled);
  // The backward's FLOPs are counted, not estimated: a recomputation factor is said to be unused.
  Config f = parse_config(R"({"train_micro_batch_size_per_gpu": 1,
      "flops_profiler": {"enabled": true, "recompute_fwd_factor": 1.0}})", "x");
  REQUIRE(f.notes.size() == 1);
  CHECK_THAT(f.notes[0], Catch::Contains("flops_profiler.recompute_fwd_factor: got 1,") &&
                             Catch::Contains("recomputed forwards included"));
  // Activation partitioning over the one tensor-parallel rank zeroshard has: accepted, said.
  Config p = parse_config(R"({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing":
      {"partition_activations": true, "contiguous_memory_optimization": true}})", "x");
  REQUIRE(p.notes.size() == 2);
  CHECK_THAT(p.notes[0], Catch::Contains("activation_checkpointing.partition_activations: got true, accepted "
                                         "and ignored: one tensor-parallel rank"));
  CHECK_THAT(p.notes[1], Catch::Contains("contiguous_memory_optimization: got true, accepted and ignored"));
  // Contiguous buffers alone too: DeepSpeed's reader takes them (its configure() asserts the pair).
  Config q = parse_config(R"({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing":
      {"contiguous_memory_optimization": true}})", "x");
  REQUIRE(q.notes.size() == 1);
  CHECK_THAT(q.notes[0], Catch::Contains("contiguous_memory_optimization: got true, accepted and ignored"));
  // DeepSpeed's names for the same collectives are taken as zeroshard's.
  CHECK(c.comms_logger.prof_ops == std::vector<std::string>{"all_reduce", "all_gather"});
  CHECK(c.zero_optimization.offload_optimizer.device == "cpu");
  CHECK(c.aio.intra_op_parallelism == 4);
  CHECK(c.zero_optimization.stage3_gather_16bit_weights_on_model_save);
  CHECK(c.tensorboard.output_path == "/tmp/tb");
  CHECK(c.wandb.team == "t");
  // Disabled unsupported blocks load (HF and Megatron configs carry them).
  CHECK_NOTHROW(parse_config(R"({"train_micro_batch_size_per_gpu": 1, "amp": {"enabled": false, "opt_level": "O1"},
      "elasticity": {"enabled": false}, "zero_optimization": {"zero_quantized_weights": false}})", "x"));
  // The oldest boolean form of zero_optimization.
  Config old = parse_config(R"({"train_micro_batch_size_per_gpu": 1, "zero_optimization": true})", "x");
  CHECK(old.zero_optimization.stage == 1);
}

TEST_CASE("trace block and comms_logger.prof_ops: values and their errors") {
  Config c = parse_config(R"({"train_micro_batch_size_per_gpu": 1,
      "trace": {"enabled": true, "output_path": "/tmp/t", "steps": [3, 4]}})", "x");
  CHECK(c.trace.enabled);
  CHECK(c.trace.output_path == "/tmp/t");
  CHECK(c.trace.steps == std::vector<int64_t>{3, 4});
  CHECK(parse_config(R"({"train_micro_batch_size_per_gpu": 1})", "x").trace.steps.empty());
  auto err = [](const std::string& text) {
    try {
      parse_config(text, "x");
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK_THAT(err(R"({"trace": {"steps": [0]}})"), Catch::Contains("trace.steps") && Catch::Contains(">= 1"));
  CHECK_THAT(err(R"({"trace": {"steps": [3, 5]}})"), Catch::Contains("trace.steps") && Catch::Contains("consecutive"));
  CHECK_THAT(err(R"({"trace": {"step": [1]}})"), Catch::Contains("trace: unknown key \"step\"") && Catch::Contains("\"steps\""));
  CHECK_THAT(err(R"({"comms_logger": {"prof_ops": ["allgather"]}})"),
             Catch::Contains("comms_logger.prof_ops") && Catch::Contains("\"allgather\"") &&
                 Catch::Contains("all_gather_into_tensor"));
}

TEST_CASE("checkpoint block: the keys are read; parallel_write.pipeline_stage true says it changes nothing") {
  Config c = parse_config(R"({"train_micro_batch_size_per_gpu": 1, "checkpoint": {"tag_validation": "fail",
      "load_universal": false, "use_node_local_storage": true, "parallel_write": {"pipeline_stage": true}}})", "x");
  CHECK(c.checkpoint.tag_validation == "Fail");
  CHECK(c.checkpoint.use_node_local_storage);
  const std::vector<std::string> expected = {
      "checkpoint.parallel_write.pipeline_stage: true changes nothing here: every rank already writes its own "
      "shard file in parallel"};
  CHECK(c.notes == expected);
}
