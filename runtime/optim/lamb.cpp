// Lamb, as DeepSpeed's FusedLamb: Adam's moments, and a trust ratio per tensor computed from the
// whole tensor's norms (the caller sums the pieces' first-phase sums over the ranks).
#include "kernels/ops.h"
#include "runtime/optim/table.h"

namespace zeroshard {

namespace {
kernels::LambParams params(const GroupHyper& h, const OptimizerConfig& c, const UpdateScalars& s) {
  kernels::LambParams lp;
  lp.lr = float(h.lr);
  lp.beta1 = float(h.beta1);
  lp.beta2 = float(h.beta2);
  lp.eps = float(h.eps);
  lp.weight_decay = float(h.weight_decay);
  lp.bias_correction = c.bias_correction;
  lp.eps_inside_sqrt = c.eps_inside_sqrt;
  lp.max_coeff = float(h.max_coeff);
  lp.min_coeff = float(h.min_coeff);
  lp.step = s.step;
  lp.grad_scale = float(s.grad_scale);
  return lp;
}

void norms(const UpdatePiece& p, const GroupHyper& h, const OptimizerConfig& c,
           const UpdateScalars& s, at::Tensor sums) {
  // The kernel applies grad_scale itself; the gradient only needs widening.
  const at::Tensor g = p.grad.scalar_type() == at::kFloat ? p.grad : p.grad.to(at::kFloat);
  ops::lamb_moments(p.master, g, p.state[0], p.state[1], params(h, c, s), std::move(sums));
}

void update(const UpdatePiece& p, const GroupHyper& h, const OptimizerConfig& c,
            const UpdateScalars& s, kernels::GradStats*) {
  const kernels::LambParams lp = params(h, c, s);
  ops::lamb_apply(p.master, p.state[0], p.state[1], lp, kernels::lamb_trust_ratio(s.w_sq, s.u_sq, lp),
                  p.param16);
}
}  // namespace

const OptimizerRow& lamb_row() {
  static const OptimizerRow row{{"Lamb"},
                                {"exp_avg", "exp_avg_sq"},
                                {"lr", "betas", "eps", "weight_decay", "max_coeff", "min_coeff"},
                                {"bias_correction", "eps_inside_sqrt", "amsgrad"},
                                [](const OptimizerConfig&) { return 0.0; },
                                update,
                                /*fuses_grad_stats=*/false,
                                norms};
  return row;
}

}  // namespace zeroshard
