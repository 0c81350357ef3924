// Blocks around training rather than in it: pipeline, checkpoint, data_types, the monitors,
// activation_checkpointing, flops_profiler, comms_logger and zeroshard's trace. The Python side
// (zeroshard/observe/) acts on the reporting blocks, reading their values from the resolved config.
#include "runtime/config/blocks.h"

#include <algorithm>

namespace zeroshard::config {

namespace {

void read_pipeline(Block& top, Config& c) {
  Block p = top.child("pipeline");
  PipelineConfig& pc = c.pipeline;
  if (const json* v = p.raw("stages")) {
    auto n = as_integer(*v);
    if (!n || *n < 1) p.fail("stages", "got " + show_typed(*v) + ", expected \"auto\" or an integer >= 1");
    pc.stages = std::to_string(*n);
    p.out()["stages"] = *n;
  } else {
    p.out()["stages"] = "auto";
  }
  pc.partition = p.get_string("partition", pc.partition);
  pc.seed_layers = p.get_bool("seed_layers", pc.seed_layers);
  pc.activation_checkpoint_interval = p.get_int("activation_checkpoint_interval", pc.activation_checkpoint_interval, 0);
  pc.pipe_partitioned = p.get_bool("pipe_partitioned", pc.pipe_partitioned);
  pc.grad_partitioned = p.get_bool("grad_partitioned", pc.grad_partitioned);
  pc.schedule = p.get_enum("schedule", pc.schedule, {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"});
  pc.virtual_stages = p.get_int("virtual_stages", pc.virtual_stages, 1);
  // DeepSpeed picks its reentrant or non-reentrant checkpoint with it; zeroshard's is one
  // function, non-reentrant, with the same gradients either way.
  if (p.has("use_reentrant")) {
    const bool reentrant = p.get_bool("use_reentrant", true);
    top.ctx().note(p.path_of("use_reentrant") + ": " + (reentrant ? "true" : "false") +
                   " is read; zeroshard's activation checkpointing is non-reentrant in both cases (the "
                   "same gradients; it also takes integer inputs and zero bubble's split)");
  } else {
    p.out()["use_reentrant"] = true;
  }
  if (pc.virtual_stages > 1 && pc.schedule != "interleaved_1f1b")
    p.fail("virtual_stages", "got " + std::to_string(pc.virtual_stages) + " with schedule \"" + pc.schedule +
                                 "\"; several model chunks per rank need \"schedule\": \"interleaved_1f1b\" (else 1)");
  p.finish();
}

void read_checkpoint(Block& top, Config& c) {
  Block k = top.child("checkpoint");
  c.checkpoint.tag_validation = k.get_enum("tag_validation", c.checkpoint.tag_validation, {"Ignore", "Warn", "Fail"});
  c.checkpoint.load_universal = k.get_bool("load_universal", c.checkpoint.load_universal);
  c.checkpoint.use_node_local_storage = k.get_bool("use_node_local_storage", c.checkpoint.use_node_local_storage);
  Block pw = k.child("parallel_write");
  c.checkpoint.parallel_write_pipeline_stage = pw.get_bool("pipeline_stage", c.checkpoint.parallel_write_pipeline_stage);
  if (c.checkpoint.parallel_write_pipeline_stage) {
    top.ctx().note(pw.path_of("pipeline_stage") +
                   ": true changes nothing here: every rank already writes its own shard file in parallel");
  }
  pw.finish();
  k.finish();
}

void read_data_types(Block& top, Config& c) {
  Block d = top.child("data_types");
  c.grad_accum_dtype = read_dtype(d, "grad_accum_dtype");
  d.finish();
}

MonitorConfig read_monitor(Block& top, const std::string& name) {
  Block m = top.child(name);
  MonitorConfig mc;
  mc.enabled = m.get_bool("enabled", mc.enabled);
  if (name == "tensorboard" || name == "csv_monitor") {
    mc.output_path = m.get_string("output_path", mc.output_path);
    mc.job_name = m.get_string("job_name", mc.job_name);
  } else if (name == "wandb") {
    mc.group = m.get_opt_string("group").value_or("");
    mc.team = m.get_opt_string("team").value_or("");
    mc.project = m.get_string("project", "deepspeed");
  } else {  // comet
    m.get_int("samples_log_interval", 100, 1);
    mc.project = m.get_opt_string("project").value_or("");
    for (const char* key : {"workspace", "api_key", "experiment_name", "experiment_key", "mode"})
      m.get_opt_string(key);
    if (m.has("online")) m.get_bool("online", true);
    m.known("online");
  }
  m.finish();
  return mc;
}

void read_activation_checkpointing(Block& top, Config& c) {
  Block a = top.child("activation_checkpointing");
  ActivationCheckpointingConfig& ac = c.activation_checkpointing;
  // Partitioning splits each checkpointed input over the tensor-parallel ranks, and contiguous
  // buffers hold the pieces (DeepSpeed needs the first for the second). zeroshard's engines run
  // with one tensor-parallel rank, where the one piece is the whole activation, as it is in
  // DeepSpeed there: accepted, said to change nothing. zeroshard.checkpointing.configure refuses
  // an mpu with more tensor-parallel ranks.
  const bool partition = a.get_bool("partition_activations", false);
  if (partition)
    top.ctx().warn_ignored(a.path_of("partition_activations"), true,
                           "one tensor-parallel rank, so each activation stays whole");
  // DeepSpeed's config reader takes contiguous buffers without partitioning (only its
  // checkpointing.configure asserts the pair, as zeroshard's does).
  if (a.get_bool("contiguous_memory_optimization", false))
    top.ctx().warn_ignored(a.path_of("contiguous_memory_optimization"), true,
                           "zeroshard keeps no preallocated activation buffers");
  // zeroshard.checkpointing keeps checkpointed inputs in host memory with it (engine or configure()).
  ac.cpu_checkpointing = a.get_bool("cpu_checkpointing", ac.cpu_checkpointing);
  ac.number_checkpoints = a.get_opt_int("number_checkpoints", 0);
  ac.synchronize_checkpoint_boundary = a.get_bool("synchronize_checkpoint_boundary", ac.synchronize_checkpoint_boundary);
  if (ac.synchronize_checkpoint_boundary)
    top.ctx().warn_ignored(a.path_of("synchronize_checkpoint_boundary"), true,
                           "zeroshard does not synchronize the device at checkpoint boundaries (timing only)");
  ac.profile = a.get_bool("profile", ac.profile);
  if (ac.profile)
    top.ctx().warn_ignored(a.path_of("profile"), true, "zeroshard does not profile activation checkpointing");
  a.finish();
}

void read_flops_profiler(Block& top, Config& c) {
  Block f = top.child("flops_profiler");
  FlopsProfilerConfig& fc = c.flops_profiler;
  fc.enabled = f.get_bool("enabled", fc.enabled);
  const double recompute = f.get_number("recompute_fwd_factor", 0.0, 0);
  if (recompute != 0.0)
    top.ctx().warn_ignored(f.path_of("recompute_fwd_factor"), recompute,
                           "zeroshard counts the backward's FLOPs as it runs, recomputed forwards included, "
                           "instead of estimating them from the forward's");
  fc.profile_step = f.get_int("profile_step", fc.profile_step, 1);
  fc.module_depth = f.get_int("module_depth", fc.module_depth, -1);
  fc.top_modules = f.get_int("top_modules", fc.top_modules, 1);
  fc.detailed = f.get_bool("detailed", fc.detailed);
  fc.output_file = f.get_opt_string("output_file").value_or("");
  f.finish();
}

// A collective kind of prof_ops: zeroshard's names, and DeepSpeed's for the same collectives.
std::string comm_kind(Block& l, const std::string& name) {
  static const std::vector<std::pair<std::string, std::string>> kinds = {
      {"all_reduce", "all_reduce"},          {"all_reduce_max", "all_reduce_max"},
      {"all_gather", "all_gather"},          {"all_gather_into_tensor", "all_gather"},
      {"all_gather_base", "all_gather"},     {"reduce_scatter", "reduce_scatter"},
      {"reduce_scatter_tensor", "reduce_scatter"}, {"reduce_scatter_base", "reduce_scatter"},
      {"broadcast", "broadcast"},            {"send", "send"},
      {"recv", "recv"},                      {"isend", "send"},
      {"irecv", "recv"}};
  std::string allowed;
  for (const auto& [alias, kind] : kinds) {
    if (alias == name) return kind;
    allowed += (allowed.empty() ? "" : ", ") + alias;
  }
  l.fail("prof_ops", "unknown collective \"" + name + "\", expected some of " + allowed);
}

void read_comms_logger(Block& top, Config& c) {
  Block l = top.child("comms_logger");
  CommsLoggerConfig& lc = c.comms_logger;
  lc.enabled = l.get_bool("enabled", lc.enabled);
  lc.verbose = l.get_bool("verbose", lc.verbose);
  lc.prof_all = l.get_bool("prof_all", lc.prof_all);
  lc.debug = l.get_bool("debug", lc.debug);
  if (const json* ops = l.raw("prof_ops")) {
    bool ok = ops->is_array();
    if (ok)
      for (const auto& op : *ops) ok = ok && op.is_string();
    if (!ok) l.fail("prof_ops", "got " + show_typed(*ops) + ", expected a list of strings");
    for (const auto& op : *ops) lc.prof_ops.push_back(comm_kind(l, op.get<std::string>()));
  }
  l.out()["prof_ops"] = lc.prof_ops;
  l.finish();
}

void read_trace(Block& top, Config& c) {
  Block t = top.child("trace");
  TraceConfig& tc = c.trace;
  tc.enabled = t.get_bool("enabled", tc.enabled);
  tc.output_path = t.get_string("output_path", tc.output_path);
  if (const json* steps = t.raw("steps")) {
    bool ok = steps->is_array();
    if (ok)
      for (const auto& s : *steps) ok = ok && s.is_number_integer() && s.get<int64_t>() >= 1;
    // One window of consecutive steps (zeroshard/observe/trace.py's consecutive() for the env).
    if (ok) {
      std::vector<int64_t> sorted = steps->get<std::vector<int64_t>>();
      std::sort(sorted.begin(), sorted.end());
      for (size_t i = 1; i < sorted.size(); ++i) ok = ok && sorted[i] == sorted[i - 1] + 1;
    }
    if (!ok)
      t.fail("steps", "got " + show_typed(*steps) +
                          ", expected consecutive step numbers >= 1 such as [3, 4] ([] traces every step)");
    tc.steps = steps->get<std::vector<int64_t>>();
  }
  t.out()["steps"] = tc.steps;
  tc.max_events = t.get_int("max_events", tc.max_events, 1000);
  t.finish();
}

}  // namespace

void read_features(Block& top, Config& c) {
  read_pipeline(top, c);
  read_checkpoint(top, c);
  read_data_types(top, c);
  c.tensorboard = read_monitor(top, "tensorboard");
  c.csv_monitor = read_monitor(top, "csv_monitor");
  c.wandb = read_monitor(top, "wandb");
  c.comet = read_monitor(top, "comet");
  read_activation_checkpointing(top, c);
  read_flops_profiler(top, c);
  read_comms_logger(top, c);
  read_trace(top, c);
}

}  // namespace zeroshard::config
