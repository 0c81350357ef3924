// The param_group keys; see hyper.h.
#include "runtime/optim/hyper.h"

#include "runtime/error.h"

namespace zeroshard {

const std::vector<HyperKey>& hyper_keys() {
  static const std::vector<HyperKey> keys = {
      {"lr", &GroupHyper::lr},
      {"weight_decay", &GroupHyper::weight_decay},
      {"betas", &GroupHyper::beta1, &GroupHyper::beta2},
      {"eps", &GroupHyper::eps},
      {"momentum", &GroupHyper::momentum},
      {"dampening", &GroupHyper::dampening},
      {"nesterov", nullptr, nullptr, &GroupHyper::nesterov},
      {"lr_decay", &GroupHyper::lr_decay},
      {"max_coeff", &GroupHyper::max_coeff},
      {"min_coeff", &GroupHyper::min_coeff},
  };
  return keys;
}

const HyperKey& hyper_key(const std::string& name) {
  for (const HyperKey& k : hyper_keys()) {
    if (name == k.name) return k;
  }
  ZS_CHECK(false, "hyper_key: \"", name, "\" is not a GroupHyper field");
  throw InternalError("unreachable");
}

}  // namespace zeroshard
