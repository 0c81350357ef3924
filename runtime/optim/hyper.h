// An optimizer's settings as plain data: the per-group hyperparameters (torch's param_group values,
// which schedulers and scripts edit between steps) and the settings fixed for the run. The config
// reader fills them from the "optimizer" block; the table (optim/table.h) says which fields each
// optimizer reads.
#pragma once
#include <string>
#include <vector>

namespace zeroshard {

// One parameter group's hyperparameters for one step. The config block's defaults per optimizer
// are DeepSpeed's (config/optimizer.cpp); the initializers here are only what a client optimizer's
// group gets for a key its class does not have (DeepSpeedCPUAdagrad has no lr_decay: 0).
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

// The param_group keys GroupHyper holds (torch's names), each with its field: the one mapping
// between a group's dict and the struct. Exactly one of the member pointers is set, except that
// a pair ("betas") sets `number` and `second`.
struct HyperKey {
  const char* name;
  double GroupHyper::*number = nullptr;
  double GroupHyper::*second = nullptr;
  bool GroupHyper::*flag = nullptr;
};
const std::vector<HyperKey>& hyper_keys();
// The key named `name`; an InternalError for any other (the table's rows name only these).
const HyperKey& hyper_key(const std::string& name);

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
