// An optimizer's settings as plain data: the per-group hyperparameters (torch's param_group values,
// which schedulers and scripts edit between steps) and the settings fixed for the run. The config
// reader fills them from the "optimizer" block; the table (optim/table.h) says which fields each
// optimizer reads.
#pragma once
#include <string>

namespace zeroshard {

// One parameter group's hyperparameters for one step. The initializers are what a group gets for
// a key its dict lacks; the config block's defaults per optimizer are DeepSpeed's (config/optimizer.cpp).
struct GroupHyper {
  double lr = 1e-3;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999;     // param_group key "betas"
  double eps = 1e-8;
  double momentum = 0.0, dampening = 0.0;
  bool nesterov = false;
  double lr_decay = 0.0;
  double max_coeff = 10.0, min_coeff = 0.01;  // Lamb's trust-ratio bounds
};

struct OptimizerConfig {
  bool present = false;
  std::string type;          // canonical: a type of the optimizer table (optim/table.h)
  GroupHyper hyper;          // every group's starting values
  bool adam_w_mode = true;   // DeepSpeed's "Adam" is decoupled (AdamW) unless adam_w_mode=false
  bool bias_correction = true;
  bool amsgrad = false;
  bool torch_adam = false;
  bool eps_inside_sqrt = false;  // Lamb: sqrt(v + eps) instead of sqrt(v) + eps
  double initial_accumulator_value = 0.0;
};

}  // namespace zeroshard
