// The optimizer table's index; each row lives in its own file (see table.h).
#include "runtime/optim/table.h"

#include <ATen/ATen.h>

#include "runtime/error.h"

namespace zeroshard {

const std::vector<const OptimizerRow*>& optimizer_rows() {
  static const std::vector<const OptimizerRow*> rows = {&adam_row(), &sgd_row(), &adagrad_row(),
                                                        &lion_row(), &lamb_row()};
  return rows;
}

std::vector<std::string> optimizer_types() {
  std::vector<std::string> out;
  for (const OptimizerRow* r : optimizer_rows()) out.insert(out.end(), r->types.begin(), r->types.end());
  return out;
}

const OptimizerRow& optimizer_row(const std::string& type) {
  for (const OptimizerRow* r : optimizer_rows()) {
    for (const auto& t : r->types) {
      if (t == type) return *r;
    }
  }
  std::string allowed;
  for (const auto& t : optimizer_types()) allowed += (allowed.empty() ? "" : ", ") + t;
  throw ConfigError(detail::cat("optimizer.type: got \"", type, "\", expected one of ", allowed));
}

at::Tensor scaled_fp32_grad(const UpdatePiece& piece, const UpdateScalars& s) {
  if (piece.grad.scalar_type() == at::kFloat && s.grad_scale == 1.0) return piece.grad;
  return piece.grad.to(at::kFloat).mul_(s.grad_scale);
}

}  // namespace zeroshard
