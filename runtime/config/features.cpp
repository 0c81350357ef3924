// Blocks around training rather than in it: pipeline, checkpoint, data_types, the monitors,
// activation_checkpointing, flops_profiler and comms_logger. Monitors and profilers only affect
// reporting, so enabling one is a warning note, not an error.
#include "runtime/config/blocks.h"

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
  if (mc.enabled)
    top.ctx().warn_ignored(name + ".enabled", true, "zeroshard does not write " + name + " events (reporting only)");
  return mc;
}

void read_activation_checkpointing(Block& top, Config& c) {
  Block a = top.child("activation_checkpointing");
  ActivationCheckpointingConfig& ac = c.activation_checkpointing;
  // Activation partitioning and contiguous buffers change where activations live (memory) and
  // need tensor parallelism or DeepSpeed's buffers, which zeroshard.checkpointing does not have.
  a.reject_unless_default("partition_activations", false, "activation partitioning");
  a.reject_unless_default("contiguous_memory_optimization", false, "contiguous activation memory");
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
  f.get_number("recompute_fwd_factor", 0.0, 0);
  fc.profile_step = f.get_int("profile_step", fc.profile_step, 1);
  fc.module_depth = f.get_int("module_depth", fc.module_depth, -1);
  fc.top_modules = f.get_int("top_modules", fc.top_modules, 1);
  fc.detailed = f.get_bool("detailed", fc.detailed);
  fc.output_file = f.get_opt_string("output_file").value_or("");
  f.finish();
  if (fc.enabled) top.ctx().warn_ignored("flops_profiler.enabled", true, "zeroshard has no FLOPs profiler");
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
    lc.prof_ops = ops->get<std::vector<std::string>>();
  }
  l.out()["prof_ops"] = lc.prof_ops;
  l.finish();
  if (lc.enabled)
    top.ctx().warn_ignored("comms_logger.enabled", true, "zeroshard does not log collectives this way "
                                                         "(its debug mode reports collective sequence numbers)");
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
}

}  // namespace zeroshard::config
