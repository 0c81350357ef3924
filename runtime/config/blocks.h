// The readers of each config block, one file per concept; parse.cpp calls them in order on the
// top-level Block. Internal to runtime/config/.
#pragma once
#include "runtime/config/config.h"
#include "runtime/config/reader.h"

namespace zeroshard::config {

// training.cpp: batch keys, fp16/bf16 and the top-level scalars.
void read_batch(Block& top, Config& c);
void read_precision(Block& top, Config& c);
void read_training_scalars(Block& top, Config& c);
// optimizer.cpp: the optimizer block, one reader per optimizer table row.
void read_optimizer(Block& top, Config& c);
// Whether the optimizer block has a reader for the table row serving `type` (tests check every row).
bool has_optimizer_reader(const std::string& type);
// scheduler.cpp
void read_scheduler(Block& top, Config& c);
// zero.cpp: zero_optimization with its offload blocks, and aio.
void read_zero(Block& top, Config& c);
void read_aio(Block& top, Config& c);
// features.cpp: pipeline, checkpoint, data_types, monitors, activation checkpointing, profilers.
void read_features(Block& top, Config& c);
// unsupported.cpp: DeepSpeed blocks zeroshard does not implement (errors when enabled).
void read_unsupported(Block& top, Config& c);

// "fp32" | "fp16" | "bf16" from DeepSpeed's dtype spellings ("float16", "half", "torch.bfloat16"...).
std::string read_dtype(Block& b, const std::string& key);

}  // namespace zeroshard::config
