// The optimizer table: one row per optimizer kind, the only place that says what an optimizer is.
// A row names the config types it serves, its state tensors (torch.optim's names), the
// param_group keys its step reads, and how it updates one piece of a rank's owned range through
// the kernels (kernels/ops.h: CPU kernels, CUDA kernels or ATen math by the tensors' device).
// Adding an optimizer: a kernel, a row file here, its line in table.cpp, and its config reader
// (runtime/config/optimizer.cpp).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu_optimizers.h"
#include "runtime/optim/hyper.h"

namespace zeroshard {

// One contiguous piece of the owned range: fp32 master values, the reduced gradients (model
// dtype or fp32), the optimizer state in the row's order, and optionally the 16-bit model copy
// the update also writes.
struct UpdatePiece {
  at::Tensor master;
  at::Tensor grad;
  std::vector<at::Tensor> state;
  at::Tensor param16;
};

struct UpdateScalars {
  int64_t step = 1;          // the group's applied steps, this one included
  double grad_scale = 1.0;   // 1 / loss scale times the clipping coefficient
  bool fresh_state = true;   // the state was created for this step (torch seeds SGD's momentum)
  // Per-tensor optimizers (Lamb): the whole tensor's sums of squares from the first phase,
  // summed over every rank's pieces.
  double w_sq = 0.0, u_sq = 0.0;
};

struct OptimizerRow {
  std::vector<std::string> types;         // config "type" names this row serves
  std::vector<std::string> state_names;   // torch.optim's state names, in UpdatePiece::state order
  std::vector<std::string> group_keys;    // the param_group keys the update reads (optim/hyper.h)
  std::vector<std::string> config_keys;   // the optimizer block's other params (fixed for the run)
  // The value every state element starts from.
  double (*state_init)(const OptimizerConfig& config);
  // Updates the piece. stats, when not null, receives the gradient's statistics as read (only
  // rows with fuses_grad_stats fill it; the caller asks only those).
  void (*update)(const UpdatePiece& piece, const GroupHyper& h, const OptimizerConfig& config,
                 const UpdateScalars& s, kernels::GradStats* stats);
  bool fuses_grad_stats = false;
  // Rows whose update needs whole-tensor norms (Lamb): the first phase over one tensor's piece,
  // adding the piece's sums of squares to sums[0] and sums[1] (float64, on the piece's device).
  // Null for elementwise optimizers; a row with it does not fuse the gradient statistics.
  void (*tensor_norms)(const UpdatePiece& piece, const GroupHyper& h, const OptimizerConfig& config,
                       const UpdateScalars& s, at::Tensor sums) = nullptr;
};

// Every row, in the order error messages list them.
const std::vector<const OptimizerRow*>& optimizer_rows();
// Every config type name, in table order ("Adam", "AdamW", ...).
std::vector<std::string> optimizer_types();
// The row serving `type` (canonical spelling); a ConfigError listing the types for any other.
const OptimizerRow& optimizer_row(const std::string& type);

// The rows (one file each).
const OptimizerRow& adam_row();
const OptimizerRow& sgd_row();
const OptimizerRow& adagrad_row();
const OptimizerRow& lion_row();
const OptimizerRow& lamb_row();

// Shared by the rows: the gradient in fp32 with grad_scale applied (the piece's own tensor when
// it is fp32 and the scale is 1).
at::Tensor scaled_fp32_grad(const UpdatePiece& piece, const UpdateScalars& s);

}  // namespace zeroshard
