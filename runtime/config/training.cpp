// Top-level training keys: the batch triplet (and DeepSpeed's reconciliation of it),
// fp16/bf16 and the scalar knobs. Defaults are DeepSpeed's code defaults (runtime/constants.py).
#include <algorithm>
#include <cctype>

#include "runtime/config/blocks.h"
#include "runtime/error.h"

namespace zeroshard {

namespace config {

namespace {

const char* kBatchKeys[] = {"train_batch_size", "train_micro_batch_size_per_gpu",
                            "gradient_accumulation_steps"};

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

}  // namespace

void read_batch(Block& top, Config& c) {
  std::optional<int64_t>* slots[] = {&c.batch_as_written.train_batch_size,
                                     &c.batch_as_written.train_micro_batch_size_per_gpu,
                                     &c.batch_as_written.gradient_accumulation_steps};
  for (int i = 0; i < 3; ++i) {
    // "auto" behaves as absent: the key is derived from the others by resolve_batch.
    if (top.is_auto(kBatchKeys[i])) c.batch_auto.push_back(kBatchKeys[i]);
    *slots[i] = top.get_opt_int(kBatchKeys[i], 1);
  }
  c.batch = c.batch_as_written;
}

void read_precision(Block& top, Config& c) {
  Block f = top.child("fp16");
  c.fp16.enabled = f.get_bool("enabled", c.fp16.enabled);
  c.fp16.auto_cast = f.get_bool("auto_cast", c.fp16.auto_cast);
  c.fp16.loss_scale = f.get_number("loss_scale", c.fp16.loss_scale, 0);
  c.fp16.initial_scale_power = f.get_int("initial_scale_power", c.fp16.initial_scale_power, 0, 127);
  c.fp16.loss_scale_window = f.get_int("loss_scale_window", c.fp16.loss_scale_window, 1);
  c.fp16.hysteresis = f.get_int("hysteresis", c.fp16.hysteresis, 1);
  c.fp16.consecutive_hysteresis = f.get_bool("consecutive_hysteresis", c.fp16.consecutive_hysteresis);
  c.fp16.min_loss_scale = f.get_number("min_loss_scale", c.fp16.min_loss_scale, 0);
  f.reject_unless_default("fp16_master_weights_and_grads", false, "fp16 master weights");
  f.finish();

  // "bfloat16" is DeepSpeed's old name for the block; both at once would be ambiguous.
  const json* bf16 = top.raw("bf16");
  const json* old = top.raw("bfloat16");
  if (bf16 && old) top.fail("bfloat16", "given together with \"bf16\"; it is the old name of the same block, keep one");
  Block b(bf16 ? bf16 : old, bf16 ? "bf16" : (old ? "bfloat16" : "bf16"), top.ctx(), top.out()["bf16"]);
  c.bf16.enabled = b.get_bool("enabled", c.bf16.enabled);
  c.bf16.immediate_grad_update = b.get_bool("immediate_grad_update", c.bf16.immediate_grad_update);
  b.reject_unless_default("check_grad_overflow", false, "bf16 overflow checking");
  b.reject_unless_default("bf16_master_weights_and_grads", false, "bf16 master weights");
  b.reject_unless_default("bf16_optimizer_states", false, "bf16 optimizer states");
  b.finish();
  if (c.fp16.enabled && c.bf16.enabled)
    b.fail("enabled", "got true, expected false when fp16.enabled is true (fp16 and bf16 are mutually exclusive)");
}

void read_training_scalars(Block& top, Config& c) {
  c.gradient_clipping = top.get_number("gradient_clipping", c.gradient_clipping, 0);
  // DeepSpeed's code default is None (never print); 10 is its documented default and more useful.
  c.steps_per_print = top.get_int("steps_per_print", c.steps_per_print, 1);
  c.prescale_gradients = top.get_bool("prescale_gradients", c.prescale_gradients);
  c.gradient_predivide_factor = top.get_number("gradient_predivide_factor", c.gradient_predivide_factor, 0);
  if (c.gradient_predivide_factor == 0)
    top.fail("gradient_predivide_factor", "got 0, expected a number > 0");
  c.communication_data_type = read_dtype(top, "communication_data_type");
  c.zero_allow_untested_optimizer = top.get_bool("zero_allow_untested_optimizer", c.zero_allow_untested_optimizer);
  c.zero_force_ds_cpu_optimizer = top.get_bool("zero_force_ds_cpu_optimizer", c.zero_force_ds_cpu_optimizer);
  c.dataloader_drop_last = top.get_bool("dataloader_drop_last", c.dataloader_drop_last);
  top.reject_unless_default("sparse_gradients", false, "sparse gradients");
  // Reporting switches, acted on by zeroshard/observe/ (per-phase times, memory after each step).
  c.wall_clock_breakdown = top.get_bool("wall_clock_breakdown", c.wall_clock_breakdown);
  c.memory_breakdown = top.get_bool("memory_breakdown", c.memory_breakdown);
  // Accepted so DeepSpeed configs load, noted so nobody waits for output.
  c.dump_state = top.get_bool("dump_state", c.dump_state);
  if (c.dump_state) top.ctx().warn_ignored("dump_state", true, "zeroshard does not dump engine state");
}

std::string read_dtype(Block& b, const std::string& key) {
  static const std::vector<std::string> kCanonical = {"fp32", "fp16", "bf16"};
  b.note_if_auto(key, nullptr);
  const json* v = b.raw(key);
  if (!v) {
    b.out()[key] = nullptr;
    return "";
  }
  if (!v->is_string()) b.fail(key, "got " + show_typed(*v) + ", expected one of " + quoted_list(kCanonical));
  // DeepSpeed's DtypeEnum spellings.
  std::string s = lower(v->get<std::string>());
  std::string r = s == "fp32" || s == "float32" || s == "float" || s == "torch.float32"   ? "fp32"
                  : s == "fp16" || s == "float16" || s == "half" || s == "torch.float16"  ? "fp16"
                  : s == "bf16" || s == "bfloat16" || s == "torch.bfloat16"               ? "bf16"
                                                                                          : "";
  if (r.empty()) b.fail(key, "got " + show(*v) + ", expected one of " + quoted_list(kCanonical));
  b.out()[key] = r;
  return r;
}

}  // namespace config

ResolvedBatch Config::resolve_batch(int64_t dp_world_size) {
  auto fail = [&](const std::string& what) { throw ConfigError(config::source_prefix(source) + what); };
  if (dp_world_size < 1)
    fail("data-parallel world size: got " + std::to_string(dp_world_size) + ", expected an integer >= 1");
  const auto w = dp_world_size;
  const std::string W = "data-parallel world size " + std::to_string(w);
  auto tbs = batch_as_written.train_batch_size;
  auto mbs = batch_as_written.train_micro_batch_size_per_gpu;
  auto gas = batch_as_written.gradient_accumulation_steps;
  std::string T = tbs ? "train_batch_size " + std::to_string(*tbs) : "";
  std::string M = mbs ? "train_micro_batch_size_per_gpu " + std::to_string(*mbs) : "";
  std::string G = gas ? "gradient_accumulation_steps " + std::to_string(*gas) : "";
  auto divisible = [&](int64_t divisor, const std::string& what) {
    if (*tbs % divisor != 0)
      fail(T + " is not divisible by " + what + " = " + std::to_string(divisor));
  };
  std::vector<std::string> defaulted;  // keys that took the fallback value 1
  // DeepSpeed's rules (runtime/config.py, _set_batch_related_parameters), with the remainders it
  // drops through integer division reported instead.
  if (tbs && mbs && gas) {
    if (*tbs != *mbs * *gas * w)
      fail(T + " != " + M + " * " + G + " * " + W + " = " + std::to_string(*mbs * *gas * w));
  } else if (tbs && mbs) {
    divisible(*mbs * w, M + " * " + W);
    gas = *tbs / (*mbs * w);
  } else if (tbs && gas) {
    divisible(*gas * w, G + " * " + W);
    mbs = *tbs / (*gas * w);
  } else if (mbs && gas) {
    tbs = *mbs * *gas * w;
  } else if (tbs) {
    divisible(w, W);
    gas = 1, mbs = *tbs / w;
    defaulted.push_back("gradient_accumulation_steps");
  } else if (mbs || std::count(batch_auto.begin(), batch_auto.end(), "train_micro_batch_size_per_gpu")) {
    // An "auto" micro batch with nothing to derive it from takes the default 1.
    if (!mbs) mbs = 1, defaulted.push_back("train_micro_batch_size_per_gpu");
    if (!gas) gas = 1, defaulted.push_back("gradient_accumulation_steps");
    tbs = *mbs * *gas * w;
  } else {
    fail("train_batch_size or train_micro_batch_size_per_gpu must be given (" +
         (gas ? G + " alone is not enough" : std::string("neither is set")) + ")");
  }
  batch = {tbs, mbs, gas};
  const int64_t values[] = {*tbs, *mbs, *gas};
  config::Context ctx(source, &notes);
  for (int i = 0; i < 3; ++i) {
    resolved[config::kBatchKeys[i]] = values[i];
    if (std::count(batch_auto.begin(), batch_auto.end(), config::kBatchKeys[i])) {
      bool dflt = std::count(defaulted.begin(), defaulted.end(), config::kBatchKeys[i]) > 0;
      ctx.note("\"" + std::string(config::kBatchKeys[i]) + "\": \"auto\" -> " + std::to_string(values[i]) +
               (dflt ? " (default)" : " (derived)"));
    }
  }
  return {*tbs, *mbs, *gas};
}

}  // namespace zeroshard
