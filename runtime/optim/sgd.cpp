// SGD with momentum, dampening and Nesterov, as torch.optim.SGD.
#include "kernels/ops.h"
#include "runtime/optim/table.h"

namespace zeroshard {

namespace {
void update(const UpdatePiece& p, const GroupHyper& h, const OptimizerConfig&,
            const UpdateScalars& s, kernels::GradStats*) {
  ops::sgd_step(p.master, scaled_fp32_grad(p, s), p.state[0],
                {float(h.lr), float(h.momentum), float(h.dampening), float(h.weight_decay),
                 h.nesterov, s.fresh_state},
                p.param16);
}
}  // namespace

const OptimizerRow& sgd_row() {
  static const OptimizerRow row{{"SGD"},
                                {"momentum_buffer"},
                                {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
                                {},
                                [](const OptimizerConfig&) { return 0.0; },
                                update};
  return row;
}

}  // namespace zeroshard
