// Lion (the sign of an interpolated momentum), as DeepSpeed's CPU/fused Lion.
#include "kernels/ops.h"
#include "runtime/optim/table.h"

namespace zeroshard {

namespace {
void update(const UpdatePiece& p, const GroupHyper& h, const OptimizerConfig&,
            const UpdateScalars& s, kernels::GradStats*) {
  ops::lion_step(p.master, scaled_fp32_grad(p, s), p.state[0],
                 {float(h.lr), float(h.beta1), float(h.beta2), float(h.weight_decay)}, p.param16);
}
}  // namespace

const OptimizerRow& lion_row() {
  static const OptimizerRow row{{"Lion"},
                                {"exp_avg"},
                                {"lr", "betas", "weight_decay"},
                                {},
                                [](const OptimizerConfig&) { return 0.0; },
                                update};
  return row;
}

}  // namespace zeroshard
