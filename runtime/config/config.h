// The typed form of a DeepSpeed ds_config.json. parse_config() reads JSON text (comments allowed),
// checks every key at every level (unknown keys are errors with a did-you-mean), fills DeepSpeed's
// code defaults and resolves "auto". Field names follow the JSON keys; blocks mirror JSON blocks.
#pragma once
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/optim/hyper.h"

namespace zeroshard {

enum class Precision { fp32, fp16, bf16 };

struct BatchConfig {
  std::optional<int64_t> train_batch_size;
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
};

// The three batch keys after DeepSpeed's reconciliation for a given data-parallel world size.
struct ResolvedBatch {
  int64_t train_batch_size;
  int64_t train_micro_batch_size_per_gpu;
  int64_t gradient_accumulation_steps;
};


struct SchedulerConfig {
  bool present = false;
  std::string type;          // "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"
  nlohmann::json params = nlohmann::json::object();  // validated, defaults filled
};

struct Fp16Config {
  bool enabled = false;
  bool auto_cast = false;
  double loss_scale = 0.0;   // 0 = dynamic
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  bool fp16_master_weights_and_grads = false;
};

struct Bf16Config {
  bool enabled = false;
  bool immediate_grad_update = false;
};

struct OffloadParamConfig {
  std::string device = "none";   // none | cpu | nvme
  std::string nvme_path;
  int64_t buffer_count = 5;
  int64_t buffer_size = 100000000;
  int64_t max_in_cpu = 1000000000;
  bool pin_memory = false;
};

struct OffloadOptimizerConfig {
  std::string device = "none";   // none | cpu | nvme
  std::string nvme_path;
  int64_t buffer_count = 4;
  bool pin_memory = false;
  bool pipeline_read = false;
  bool pipeline_write = false;
  bool fast_init = false;
  double ratio = 1.0;
};

struct ZeroConfig {
  int64_t stage = 0;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  int64_t reduce_bucket_size = 500000000;
  bool use_multi_rank_bucket_allreduce = true;
  bool allgather_partitions = true;
  int64_t allgather_bucket_size = 500000000;
  bool overlap_comm = false;     // resolved: DeepSpeed's None -> true for stage 3, false otherwise
  bool load_from_fp32_weights = true;
  bool elastic_checkpoint = false;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
  int64_t sub_group_size = 1000000000;
  int64_t stage3_prefetch_bucket_size = 50000000;
  int64_t stage3_param_persistence_threshold = 100000;
  int64_t stage3_model_persistence_threshold = std::numeric_limits<int64_t>::max();
  int64_t stage3_max_live_parameters = 1000000000;
  int64_t stage3_max_reuse_distance = 1000000000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  int64_t stage3_module_granularity_threshold = 0;
  bool stage3_use_all_reduce_for_fetch_params = false;
  bool ignore_unused_parameters = true;
  bool round_robin_gradients = false;
  int64_t zero_hpz_partition_size = 1;
  bool zero_quantized_weights = false;
  bool zero_quantized_nontrainable_weights = false;
  bool zero_quantized_gradients = false;
  int64_t mics_shard_size = -1;
  bool memory_efficient_linear = true;
  bool log_trace_cache_warnings = false;
  bool stage3_allgather_sequential = false;
  bool override_module_apply = true;
  bool enable_sanity_checks = false;
  bool pipeline_loading_checkpoint = false;
};

struct AioConfig {                // NVMe I/O (runtime/swap_tensor/aio_config.py)
  int64_t block_size = 1048576;
  int64_t queue_depth = 8;
  int64_t intra_op_parallelism = 1;
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;
};

struct PipelineConfig {           // DeepSpeed's "pipeline" block (runtime/config.py)
  std::string stages = "auto";    // "auto" or a count, as written
  std::string partition = "best";
  bool seed_layers = false;
  int64_t activation_checkpoint_interval = 0;
  bool pipe_partitioned = true;
  bool grad_partitioned = true;
  // zeroshard's keys: which instruction lists run (pipeline/schedule.h's names) and, for
  // interleaved_1f1b, the model chunks per rank.
  std::string schedule = "1f1b";  // gpipe | 1f1b | interleaved_1f1b | zero_bubble
  int64_t virtual_stages = 1;
};

struct CheckpointConfig {
  std::string tag_validation = "Warn";  // Ignore | Warn | Fail
  bool load_universal = false;
  bool use_node_local_storage = false;
  bool parallel_write_pipeline_stage = false;
};

struct MonitorConfig {            // tensorboard / csv_monitor / wandb / comet (reporting only)
  bool enabled = false;
  std::string output_path;
  std::string job_name = "DeepSpeedJobName";
  std::string project;            // wandb default "deepspeed"; comet default unset
  std::string team, group;        // wandb
};

struct ActivationCheckpointingConfig {
  bool partition_activations = false;
  bool contiguous_memory_optimization = false;
  bool cpu_checkpointing = false;
  std::optional<int64_t> number_checkpoints;
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
};

struct FlopsProfilerConfig {
  bool enabled = false;
  int64_t profile_step = 1;
  int64_t module_depth = -1;
  int64_t top_modules = 1;
  bool detailed = true;
  std::string output_file;
};

struct CommsLoggerConfig {
  bool enabled = false;
  bool verbose = false;
  bool prof_all = true;
  bool debug = false;
  std::vector<std::string> prof_ops;
};

// zeroshard's own: the per-rank Chrome trace (zeroshard/observe/trace.py).
struct TraceConfig {
  bool enabled = false;
  std::string output_path = "zeroshard_trace";
  std::vector<int64_t> steps;     // global steps to record (1 = the first); empty: every step
  int64_t max_events = 2000000;   // per rank; later events are counted, not kept
};

struct Config {
  BatchConfig batch;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  Bf16Config bf16;
  ZeroConfig zero_optimization;
  double gradient_clipping = 0.0;
  int64_t steps_per_print = 10;          // DeepSpeed's code default is None (no prints); see README
  bool wall_clock_breakdown = false;
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  std::string communication_data_type;   // "" = the gradients' dtype; else fp32 | fp16 | bf16
  bool zero_allow_untested_optimizer = false;
  bool zero_force_ds_cpu_optimizer = true;
  bool dataloader_drop_last = false;
  std::string grad_accum_dtype;          // data_types.grad_accum_dtype; "" = default
  bool memory_breakdown = false;
  bool dump_state = false;
  AioConfig aio;
  PipelineConfig pipeline;
  CheckpointConfig checkpoint;
  MonitorConfig tensorboard, csv_monitor, wandb, comet;
  ActivationCheckpointingConfig activation_checkpointing;
  FlopsProfilerConfig flops_profiler;
  TraceConfig trace;
  CommsLoggerConfig comms_logger;
  // The batch keys as written (absent and "auto" are nullopt): resolve_batch starts from these so
  // it can be called again for another world size. batch_auto names the keys written as "auto".
  BatchConfig batch_as_written;
  std::vector<std::string> batch_auto;
  std::string source;                    // parse_config's `source`, for messages
  // The rest (aio, pipeline, checkpoint, monitors, ...) are added by their owners as fields here.

  Precision precision() const {
    return fp16.enabled ? Precision::fp16 : bf16.enabled ? Precision::bf16 : Precision::fp32;
  }
  // Applies DeepSpeed's batch-triplet rules for this data-parallel world size and stores the
  // result in `batch`; throws ConfigError showing the arithmetic when the keys disagree.
  ResolvedBatch resolve_batch(int64_t dp_world_size);
  // Every key with the value in force (defaults and "auto" resolved), for the start-up log.
  nlohmann::json resolved;
  // One line per "auto" resolution and per accepted-but-ignored key, in the order met.
  std::vector<std::string> notes;
};

// `source` names where the text came from ("ds_config.json", "<dict>") for error messages.
Config parse_config(const std::string& json_text, const std::string& source);

}  // namespace zeroshard
