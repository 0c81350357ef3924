// Adam and AdamW (DeepSpeed's FusedAdam / DeepSpeedCPUAdam arithmetic, torch.optim's results).
#include "kernels/ops.h"
#include "runtime/optim/table.h"

namespace zeroshard {

namespace {
void update(const UpdatePiece& p, const GroupHyper& h, const OptimizerConfig& c,
            const UpdateScalars& s, kernels::GradStats* stats) {
  // The fused step reads 16-bit (or fp32) gradients and unscales and clips through grad_scale.
  kernels::AdamParams ap{float(h.lr), float(h.beta1), float(h.beta2), float(h.eps),
                         float(h.weight_decay),
                         // DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false.
                         c.type == "AdamW" || c.adam_w_mode, c.bias_correction, s.step};
  ap.grad_scale = float(s.grad_scale);
  ops::adam_step(p.master, p.grad, p.state[0], p.state[1], ap, p.param16, stats);
}
}  // namespace

const OptimizerRow& adam_row() {
  static const OptimizerRow row{{"Adam", "AdamW"},
                                {"exp_avg", "exp_avg_sq"},
                                {"lr", "betas", "eps", "weight_decay"},
                                {"adam_w_mode", "bias_correction", "amsgrad", "torch_adam"},
                                [](const OptimizerConfig&) { return 0.0; },
                                update,
                                /*fuses_grad_stats=*/true};
  return row;
}

}  // namespace zeroshard
