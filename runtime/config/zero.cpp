// "zero_optimization" (every key of DeepSpeed's DeepSpeedZeroConfig, runtime/zero/config.py, with
// its stage3_* aliases and deprecated keys), its offload blocks (offload_config.py) and "aio".
// The parser accepts stage 0-3 and any offload device: the engine decides what it can run.
#include "runtime/config/blocks.h"

namespace zeroshard::config {

namespace {

// DeepSpeed's pydantic fields named X with alias stage3_X accept both spellings; here too.
// Giving both is ambiguous, so it is an error. Returns the name the value is under.
std::string alias(Block& z, const std::string& prefixed) {
  std::string bare = prefixed.substr(std::string("stage3_").size());
  z.known(bare);
  if (z.has(prefixed) && z.has(bare))
    z.fail(bare, "given together with \"" + prefixed + "\"; they are the same key, keep one");
  return z.has(bare) || z.is_auto(bare) ? bare : prefixed;
}

int64_t aliased_int(Block& z, const std::string& prefixed, int64_t def) {
  std::string name = alias(z, prefixed);
  int64_t v = z.get_int(name, def, 0);
  z.known(prefixed);
  z.out().erase(name);
  z.out()[prefixed] = v;  // resolved output always uses DeepSpeed's documented (stage3_) name
  return v;
}

bool aliased_bool(Block& z, const std::string& prefixed, bool def) {
  std::string name = alias(z, prefixed);
  bool v = z.get_bool(name, def);
  z.known(prefixed);
  z.out().erase(name);
  z.out()[prefixed] = v;
  return v;
}

const std::vector<std::string> kDevices = {"none", "cpu", "nvme"};

void require_nvme_path(Block& b, const std::string& device, const std::string& nvme_path) {
  if (device == "nvme" && nvme_path.empty())
    b.fail("nvme_path", "missing, required when device is \"nvme\"");
}

void read_offload_param(Block& z, ZeroConfig& zc, bool deprecated_cpu, bool deprecated_pin) {
  Block b = z.child("offload_param");
  OffloadParamConfig& o = zc.offload_param;
  o.device = b.get_enum("device", deprecated_cpu ? "cpu" : "none", kDevices);
  o.nvme_path = b.get_opt_string("nvme_path").value_or("");
  o.buffer_count = b.get_int("buffer_count", o.buffer_count, 0);
  o.buffer_size = b.get_int("buffer_size", o.buffer_size, 0);
  o.max_in_cpu = b.get_int("max_in_cpu", o.max_in_cpu, 0);
  o.pin_memory = b.get_bool("pin_memory", deprecated_pin);
  require_nvme_path(b, o.device, o.nvme_path);
  b.finish();
}

void read_offload_optimizer(Block& z, ZeroConfig& zc, bool deprecated_cpu, bool deprecated_pin) {
  Block b = z.child("offload_optimizer");
  OffloadOptimizerConfig& o = zc.offload_optimizer;
  o.device = b.get_enum("device", deprecated_cpu ? "cpu" : "none", kDevices);
  o.nvme_path = b.get_opt_string("nvme_path").value_or("");
  o.buffer_count = b.get_int("buffer_count", o.buffer_count, 0);
  o.pin_memory = b.get_bool("pin_memory", deprecated_pin);
  o.pipeline_read = b.get_bool("pipeline_read", o.pipeline_read);
  o.pipeline_write = b.get_bool("pipeline_write", o.pipeline_write);
  o.fast_init = b.get_bool("fast_init", o.fast_init);
  o.ratio = b.get_number("ratio", o.ratio, 0, 1);
  // Partial offload: the last `ratio` of the sub-groups step on the host, the rest on the device.
  if (o.ratio < 1.0 && o.device == "none")
    b.fail("ratio", "got " + show(b.out()["ratio"]) + " with device \"none\"; ratio is the share of the "
           "optimizer offloaded, so it needs device \"cpu\" (or leave it at 1)");
  b.reject_unless_default("super_offload", false, "SuperOffload");
  b.get_bool("convert_grad_on_cpu", true);          // newer DeepSpeed keys: placement details
  b.get_number("cpuadam_cores_perc", 0.8, 0, 1);    // of its CPU Adam, no effect here
  require_nvme_path(b, o.device, o.nvme_path);
  b.finish();
}

}  // namespace

void read_zero(Block& top, Config& c) {
  ZeroConfig& zc = c.zero_optimization;
  const json* raw = top.raw("zero_optimization");
  json legacy;
  if (raw && raw->is_boolean()) {
    // DeepSpeed's oldest form, "zero_optimization": true, means stage 1 (with a deprecation warning).
    legacy = json{{"stage", raw->get<bool>() ? 1 : 0}};
    top.ctx().note("warning: zero_optimization: got " + show(*raw) + ", deprecated form read as {\"stage\": " +
                   std::to_string(legacy["stage"].get<int>()) + "}");
    raw = &legacy;
  }
  Block z(raw, "zero_optimization", top.ctx(), top.out()["zero_optimization"]);
  zc.stage = z.get_int_choice("stage", 0, {0, 1, 2, 3});
  zc.contiguous_gradients = z.get_bool("contiguous_gradients", zc.contiguous_gradients);
  zc.reduce_scatter = z.get_bool("reduce_scatter", zc.reduce_scatter);
  zc.reduce_bucket_size = z.get_int("reduce_bucket_size", zc.reduce_bucket_size, 0);
  zc.use_multi_rank_bucket_allreduce = z.get_bool("use_multi_rank_bucket_allreduce", zc.use_multi_rank_bucket_allreduce);
  zc.allgather_partitions = z.get_bool("allgather_partitions", zc.allgather_partitions);
  zc.allgather_bucket_size = z.get_int("allgather_bucket_size", zc.allgather_bucket_size, 0);
  // DeepSpeed's None default: overlap is on for stage 3 (it prefetches anyway), off otherwise.
  {
    bool was_auto = z.is_auto("overlap_comm");
    const json* v = z.raw("overlap_comm");
    if (v && !v->is_boolean()) z.fail("overlap_comm", "got " + show_typed(*v) + ", expected a boolean");
    zc.overlap_comm = v ? v->get<bool>() : zc.stage == 3;
    if (was_auto) z.note_if_auto("overlap_comm", zc.overlap_comm);
    z.out()["overlap_comm"] = zc.overlap_comm;
  }
  zc.load_from_fp32_weights = z.get_bool("load_from_fp32_weights", zc.load_from_fp32_weights);
  zc.elastic_checkpoint = z.get_bool("elastic_checkpoint", zc.elastic_checkpoint);
  zc.sub_group_size = z.get_int("sub_group_size", zc.sub_group_size, 0);

  // Deprecated switches that DeepSpeed maps onto the offload blocks (and pin_memory in both).
  std::optional<bool> cpu_offload, cpu_offload_param, cpu_pin;
  struct Deprecated {
    const char* key;
    std::optional<bool>* slot;
    const char* replacement;
  };
  for (const Deprecated& d : {Deprecated{"cpu_offload", &cpu_offload, "offload_optimizer"},
                              Deprecated{"cpu_offload_param", &cpu_offload_param, "offload_param"},
                              Deprecated{"cpu_offload_use_pin_memory", &cpu_pin,
                                         "offload_param.pin_memory and offload_optimizer.pin_memory"}}) {
    if (z.has(d.key)) {
      *d.slot = z.get_bool(d.key, false);
      top.ctx().note(std::string("warning: zero_optimization.") + d.key + ": deprecated; read as " +
                     d.replacement);
    }
    z.known(d.key);
  }
  if (cpu_offload.value_or(false) && z.has("offload_optimizer"))
    z.fail("cpu_offload", "given together with \"offload_optimizer\"; keep offload_optimizer");
  if (cpu_offload_param.value_or(false) && z.has("offload_param"))
    z.fail("cpu_offload_param", "given together with \"offload_param\"; keep offload_param");
  read_offload_param(z, zc, cpu_offload_param.value_or(false), cpu_pin.value_or(false));
  read_offload_optimizer(z, zc, cpu_offload.value_or(false), cpu_pin.value_or(false));

  zc.stage3_prefetch_bucket_size = aliased_int(z, "stage3_prefetch_bucket_size", zc.stage3_prefetch_bucket_size);
  zc.stage3_param_persistence_threshold = aliased_int(z, "stage3_param_persistence_threshold", zc.stage3_param_persistence_threshold);
  zc.stage3_model_persistence_threshold =
      aliased_int(z, "stage3_model_persistence_threshold", std::numeric_limits<int64_t>::max());
  zc.stage3_max_live_parameters = aliased_int(z, "stage3_max_live_parameters", zc.stage3_max_live_parameters);
  zc.stage3_max_reuse_distance = aliased_int(z, "stage3_max_reuse_distance", zc.stage3_max_reuse_distance);
  zc.stage3_gather_16bit_weights_on_model_save =
      aliased_bool(z, "stage3_gather_16bit_weights_on_model_save", false);
  if (z.has("stage3_gather_fp16_weights_on_model_save")) {
    // Deprecated name of the key above; DeepSpeed copies it over.
    bool v = z.get_bool("stage3_gather_fp16_weights_on_model_save", false);
    zc.stage3_gather_16bit_weights_on_model_save = zc.stage3_gather_16bit_weights_on_model_save || v;
    z.out()["stage3_gather_16bit_weights_on_model_save"] = zc.stage3_gather_16bit_weights_on_model_save;
    top.ctx().note("warning: zero_optimization.stage3_gather_fp16_weights_on_model_save: deprecated; "
                   "use stage3_gather_16bit_weights_on_model_save (read as it)");
  }
  z.known("stage3_gather_fp16_weights_on_model_save");
  {
    // module_granularity_threshold may be negative in DeepSpeed (no ge=0); accept any integer.
    std::string name = alias(z, "stage3_module_granularity_threshold");
    zc.stage3_module_granularity_threshold = z.get_int(name, 0);
    z.known("stage3_module_granularity_threshold");
    z.out().erase(name);
    z.out()["stage3_module_granularity_threshold"] = zc.stage3_module_granularity_threshold;
  }
  zc.stage3_use_all_reduce_for_fetch_params = aliased_bool(z, "stage3_use_all_reduce_for_fetch_params", zc.stage3_use_all_reduce_for_fetch_params);
  zc.stage3_allgather_sequential = aliased_bool(z, "stage3_allgather_sequential", zc.stage3_allgather_sequential);
  zc.ignore_unused_parameters = z.get_bool("ignore_unused_parameters", zc.ignore_unused_parameters);
  zc.round_robin_gradients = z.get_bool("round_robin_gradients", zc.round_robin_gradients);
  zc.memory_efficient_linear = z.get_bool("memory_efficient_linear", zc.memory_efficient_linear);
  zc.log_trace_cache_warnings = z.get_bool("log_trace_cache_warnings", zc.log_trace_cache_warnings);
  zc.override_module_apply = z.get_bool("override_module_apply", zc.override_module_apply);
  zc.enable_sanity_checks = z.get_bool("enable_sanity_checks", zc.enable_sanity_checks);
  zc.pipeline_loading_checkpoint = z.get_bool("pipeline_loading_checkpoint", zc.pipeline_loading_checkpoint);

  // Features that change what is communicated or how it is sharded: errors, not silent no-ops.
  z.reject_unless_default("legacy_stage1", false, "the legacy ZeRO stage 1 implementation");
  zc.zero_hpz_partition_size = z.get_int("zero_hpz_partition_size", zc.zero_hpz_partition_size, 0);
  if (zc.zero_hpz_partition_size > 1)
    z.fail("zero_hpz_partition_size", "got " + std::to_string(zc.zero_hpz_partition_size) +
                                          ", expected 1 (ZeRO++ hierarchical partitioning: not supported by zeroshard)");
  z.reject_unless_default("zero_quantized_weights", false, "ZeRO++ quantized weights");
  z.reject_unless_default("zero_quantized_nontrainable_weights", false, "ZeRO++ quantized weights");
  z.reject_unless_default("zero_quantized_gradients", false, "ZeRO++ quantized gradients");
  z.reject_unless_default("zeropp_loco_param", nullptr, "ZeRO++ LoCo");
  zc.mics_shard_size = z.get_int("mics_shard_size", zc.mics_shard_size);
  if (zc.mics_shard_size > 0)
    z.fail("mics_shard_size", "got " + std::to_string(zc.mics_shard_size) + ", expected -1 (MiCS: not supported by zeroshard)");
  z.reject_unless_default("mics_hierarchical_params_gather", false, "MiCS");
  z.reject_unless_default("zenflow", nullptr, "ZenFlow");
  if (const json* leaf = z.raw("leaf_module"); leaf && !(leaf->is_object() && leaf->empty()))
    z.fail("leaf_module", "got " + show(*leaf) + ", expected {} (ZeRO-3 leaf modules: not supported by zeroshard)");
  z.finish();
}

void read_aio(Block& top, Config& c) {
  Block a = top.child("aio");
  // Its alignment and bounds are the I/O engine's to check (offload/aio_engine.h), when it runs.
  c.aio.block_size = a.get_int("block_size", c.aio.block_size, 1);
  c.aio.queue_depth = a.get_int("queue_depth", c.aio.queue_depth, 1);
  const bool has_parallelism = a.has("intra_op_parallelism");
  c.aio.intra_op_parallelism = a.get_int("intra_op_parallelism", c.aio.intra_op_parallelism, 1);
  c.aio.single_submit = a.get_bool("single_submit", c.aio.single_submit);
  c.aio.overlap_events = a.get_bool("overlap_events", c.aio.overlap_events);
  c.aio.use_gds = a.get_bool("use_gds", c.aio.use_gds);
  if (c.aio.use_gds)
    a.fail("use_gds", "got true, expected false: zeroshard does not use GPUDirect Storage (NVMe I/O goes "
           "through pinned host buffers)");
  if (a.has("thread_count")) {
    // DeepSpeed's docs still show thread_count; its code reads only intra_op_parallelism and
    // ignores it. Here it is what the docs say it is, with the real key named.
    const int64_t threads = a.get_int("thread_count", 1, 1);
    if (has_parallelism && threads != c.aio.intra_op_parallelism)
      a.fail("thread_count", "got " + std::to_string(threads) + " and intra_op_parallelism " +
             std::to_string(c.aio.intra_op_parallelism) + "; they are the same setting, keep intra_op_parallelism");
    c.aio.intra_op_parallelism = threads;
    top.ctx().note("warning: aio.thread_count: taken as aio.intra_op_parallelism, the key DeepSpeed's "
                   "code reads (it ignores thread_count); rename it");
  }
  a.known("thread_count");
  a.finish();
}

}  // namespace zeroshard::config
