// DeepSpeed features zeroshard does not implement. Each is accepted while off, so existing configs
// that carry a disabled block still load, and is an error when on, because running without it
// would silently change the math or the memory. Contents of a disabled block are not validated:
// they configure a feature that does not run.
#include "runtime/config/blocks.h"

namespace zeroshard::config {

namespace {

// {"enabled": true, ...} -> error; absent, {} or enabled false -> accepted (resolved as disabled).
void reject_if_enabled(Block& top, const std::string& key, const std::string& feature) {
  const json* v = top.raw(key);
  if (!v) return;
  if (!v->is_object()) top.fail(key, "got " + show_typed(*v) + ", expected an object");
  auto it = v->find("enabled");
  if (it != v->end() && !it->is_boolean() && !it->is_null())
    top.ctx().fail(key + ".enabled", "got " + show_typed(*it) + ", expected a boolean");
  if (it != v->end() && it->is_boolean() && it->get<bool>())
    top.ctx().fail(key + ".enabled", "got true, expected false (" + feature + ": not supported by zeroshard)");
  top.out()[key] = json{{"enabled", false}};
}

// Blocks with no on/off switch: their presence turns the feature on.
void reject_if_present(Block& top, const std::string& key, const std::string& feature) {
  const json* v = top.raw(key);
  if (v && !(v->is_object() && v->empty()))
    top.fail(key, "got " + show(*v) + ", expected no \"" + key + "\" block (" + feature +
                      ": not supported by zeroshard)");
}

}  // namespace

void read_unsupported(Block& top, Config& /*c*/) {
  reject_if_enabled(top, "amp", "Apex AMP");
  reject_if_enabled(top, "elasticity", "elastic training");
  reject_if_enabled(top, "curriculum_learning", "curriculum learning");
  reject_if_enabled(top, "data_efficiency", "data efficiency");
  reject_if_enabled(top, "progressive_layer_drop", "progressive layer drop");
  reject_if_enabled(top, "hybrid_engine", "the hybrid engine");
  reject_if_enabled(top, "eigenvalue", "eigenvalue computation");
  reject_if_enabled(top, "quantize_training", "quantized training (MoQ)");
  reject_if_enabled(top, "torch_autocast", "torch autocast");
  reject_if_enabled(top, "autotuning", "autotuning");
  reject_if_enabled(top, "nebula", "Nebula checkpointing");
  reject_if_present(top, "compression_training", "compression training");
  reject_if_present(top, "sparse_attention", "sparse attention");
  reject_if_present(top, "weight_quantization", "weight quantization");

  if (const json* tp = top.raw("tensor_parallel")) {
    Block t(tp, "tensor_parallel", top.ctx(), top.out()["tensor_parallel"]);
    t.get_int("autotp_size", 0, 0, 1);  // 0 or 1 means no tensor parallelism
    for (const char* key : {"tp", "tp_grain_size", "partition_config", "injection_policy_tuple", "keep_module_on_host"})
      t.raw(key), t.known(key);
    t.finish();
  }
  top.get_int("sequence_parallel_size", 1, 1, 1);
  top.reject_unless_default("disable_allgather", false, "disabling the all-gather");
  top.reject_unless_default("use_data_before_expert_parallel_", false, "expert parallelism");
  top.reject_unless_default("gradient_allreduce_op", "avg", "a gradient all-reduce op other than avg");
  // Accepted without effect: DeepSpeed itself only warns about (vocabulary_size), or only uses for
  // features above (seq_parallel_communication_data_type), or for logging (log_level, timers).
  top.get_opt_int("vocabulary_size", 0);
  read_dtype(top, "seq_parallel_communication_data_type");
  top.get_opt_string("log_level");
  if (const json* timers = top.raw("timers"))
    top.ctx().warn_ignored("timers", *timers, "zeroshard has no throughput timer");
  if (top.get_bool("graph_harvesting", false))
    top.ctx().warn_ignored("graph_harvesting", true, "zeroshard does not capture CUDA graphs");
  if (const json* trackio = top.raw("trackio"); trackio && trackio->is_object() && trackio->contains("enabled") &&
                                                 trackio->at("enabled") == true)
    top.ctx().warn_ignored("trackio.enabled", true, "zeroshard does not write trackio events (reporting only)");
}

}  // namespace zeroshard::config
