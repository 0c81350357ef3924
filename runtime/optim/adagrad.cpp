// Adagrad, as torch.optim.Adagrad.
#include "kernels/ops.h"
#include "runtime/optim/table.h"

namespace zeroshard {

namespace {
void update(const UpdatePiece& p, const GroupHyper& h, const OptimizerConfig&,
            const UpdateScalars& s, kernels::GradStats*) {
  ops::adagrad_step(p.master, scaled_fp32_grad(p, s), p.state[0],
                    {float(h.lr), float(h.lr_decay), float(h.eps), float(h.weight_decay), s.step},
                    p.param16);
}
}  // namespace

const OptimizerRow& adagrad_row() {
  static const OptimizerRow row{{"Adagrad"},
                                {"sum"},
                                {"lr", "lr_decay", "eps", "weight_decay"},
                                {"initial_accumulator_value"},
                                [](const OptimizerConfig& c) { return c.initial_accumulator_value; },
                                update};
  return row;
}

}  // namespace zeroshard
