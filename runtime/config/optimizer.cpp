// The "optimizer" block: its type (one of the optimizer table's, optim/table.h) and that
// optimizer's params with DeepSpeed's defaults for it. One reader per table row.
#include <algorithm>
#include <cctype>
#include <map>

#include "runtime/config/blocks.h"
#include "runtime/error.h"
#include "runtime/optim/table.h"

namespace zeroshard {

namespace config {

namespace {

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// betas: exactly two numbers in [0, 1), as torch.optim checks.
void read_betas(Block& p, double def1, double def2, GroupHyper& h) {
  p.note_if_auto("betas", json::array({def1, def2}));
  const json* v = p.raw("betas");
  h.beta1 = def1, h.beta2 = def2;
  if (v) {
    if (!v->is_array() || v->size() != 2 || !(*v)[0].is_number() || !(*v)[1].is_number())
      p.fail("betas", "got " + show_typed(*v) + ", expected an array of 2 numbers");
    h.beta1 = (*v)[0].get<double>(), h.beta2 = (*v)[1].get<double>();
    if (!(h.beta1 >= 0 && h.beta1 < 1 && h.beta2 >= 0 && h.beta2 < 1))
      p.fail("betas", "got " + show(*v) + ", expected 2 numbers in [0, 1)");
  }
  p.out()["betas"] = json::array({h.beta1, h.beta2});
}

void read_adam(Block& top, Block& p, OptimizerConfig& o) {
  GroupHyper& h = o.hyper;
  // DeepSpeed builds FusedAdam/DeepSpeedCPUAdam (weight_decay 0) unless torch_adam picks
  // torch.optim.Adam/AdamW, whose AdamW default is 0.01.
  o.torch_adam = p.get_bool("torch_adam", false);
  h.lr = p.get_number("lr", 1e-3, 0);
  read_betas(p, 0.9, 0.999, h);
  h.eps = p.get_number("eps", 1e-8, 0);
  h.weight_decay = p.get_number("weight_decay", o.type == "AdamW" && o.torch_adam ? 1e-2 : 0.0, 0);
  o.bias_correction = p.get_bool("bias_correction", true);
  o.adam_w_mode = p.get_bool("adam_w_mode", true);
  if (o.type == "AdamW" && !o.adam_w_mode) {
    // DeepSpeed forces decoupled decay for "AdamW" whatever adam_w_mode says; do the same, visibly.
    top.ctx().note("warning: " + p.path_of("adam_w_mode") +
                   ": got false, accepted and ignored: \"AdamW\" always decouples weight decay "
                   "(use \"Adam\" with adam_w_mode false for L2)");
    o.adam_w_mode = true;
    p.out()["adam_w_mode"] = true;
  }
  p.reject_unless_default("amsgrad", false, "AMSGrad");
  o.amsgrad = false;
}

void read_sgd(Block&, Block& p, OptimizerConfig& o) {
  GroupHyper& h = o.hyper;
  h.lr = p.get_number("lr", 1e-3, 0);
  h.momentum = p.get_number("momentum", 0.0, 0);
  h.dampening = p.get_number("dampening", 0.0);
  h.weight_decay = p.get_number("weight_decay", 0.0, 0);
  h.nesterov = p.get_bool("nesterov", false);
  if (h.nesterov && (h.momentum <= 0 || h.dampening != 0))
    p.fail("nesterov", "got true, expected false unless momentum > 0 and dampening is 0");
}

void read_adagrad(Block&, Block& p, OptimizerConfig& o) {
  GroupHyper& h = o.hyper;
  h.lr = p.get_number("lr", 1e-2, 0);
  h.lr_decay = p.get_number("lr_decay", 0.0, 0);
  h.weight_decay = p.get_number("weight_decay", 0.0, 0);
  o.initial_accumulator_value = p.get_number("initial_accumulator_value", 0.0, 0);
  h.eps = p.get_number("eps", 1e-10, 0);
}

void read_lion(Block&, Block& p, OptimizerConfig& o) {
  GroupHyper& h = o.hyper;
  h.lr = p.get_number("lr", 1e-4, 0);
  read_betas(p, 0.9, 0.99, h);
  h.weight_decay = p.get_number("weight_decay", 0.0, 0);
}

// DeepSpeed's FusedLamb(lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
// eps_inside_sqrt=False, weight_decay=0, max_coeff=10, min_coeff=0.01).
void read_lamb(Block&, Block& p, OptimizerConfig& o) {
  GroupHyper& h = o.hyper;
  h.lr = p.get_number("lr", 1e-3, 0);
  read_betas(p, 0.9, 0.999, h);
  h.eps = p.get_number("eps", 1e-8, 0);
  h.weight_decay = p.get_number("weight_decay", 0.0, 0);
  o.bias_correction = p.get_bool("bias_correction", true);
  o.eps_inside_sqrt = p.get_bool("eps_inside_sqrt", false);
  h.max_coeff = p.get_number("max_coeff", 10.0, 0);
  h.min_coeff = p.get_number("min_coeff", 0.01, 0);
  if (h.min_coeff > h.max_coeff)
    p.fail("min_coeff", "got " + show(p.out()["min_coeff"]) + ", expected at most max_coeff (" +
                            show(p.out()["max_coeff"]) + ")");
  p.reject_unless_default("amsgrad", false, "AMSGrad");
}

using Reader = void (*)(Block& top, Block& params, OptimizerConfig& o);
// One reader per table row, keyed by the row's first type.
const std::map<std::string, Reader>& readers() {
  static const std::map<std::string, Reader> r = {
      {"Adam", read_adam}, {"SGD", read_sgd}, {"Adagrad", read_adagrad},
      {"Lion", read_lion}, {"Lamb", read_lamb}};
  return r;
}

}  // namespace

bool has_optimizer_reader(const std::string& type) {
  return readers().count(optimizer_row(type).types.front()) > 0;
}

void read_optimizer(Block& top, Config& c) {
  Block ob = top.child("optimizer");
  OptimizerConfig& o = c.optimizer;
  if (!ob.present()) {
    top.out()["optimizer"] = nullptr;
    return;
  }
  o.present = true;
  const std::vector<std::string> supported = optimizer_types();
  // DeepSpeed optimizers that zeroshard does not implement: named so the error says so.
  static const std::vector<std::string> kDeepSpeedOnly = {
      "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "MuAdam", "MuAdamW", "MuSGD", "Muon"};
  const json* t = ob.raw("type");
  if (!t) ob.fail("type", "missing, expected one of " + quoted_list(supported));
  if (!t->is_string()) ob.fail("type", "got " + show_typed(*t) + ", expected one of " + quoted_list(supported));
  std::string name = lower(t->get<std::string>());
  auto match = [&](const std::vector<std::string>& names) {
    return std::find_if(names.begin(), names.end(), [&](const std::string& n) { return lower(n) == name; });
  };
  if (auto it = match(supported); it != supported.end()) {
    o.type = *it;
  } else if (auto it2 = match(kDeepSpeedOnly); it2 != kDeepSpeedOnly.end()) {
    ob.fail("type", "got " + show(*t) + ", expected one of " + quoted_list(supported) + " (" + *it2 +
                        ": not supported by zeroshard)");
  } else {
    ob.fail("type", "got " + show(*t) + ", expected one of " + quoted_list(supported));
  }
  ob.out()["type"] = o.type;
  // legacy_fusion picks DeepSpeed's old fused fp16 optimizer path; there is no such path here.
  if (ob.get_bool("legacy_fusion", false))
    top.ctx().warn_ignored(ob.path_of("legacy_fusion"), true, "zeroshard has one fp16 optimizer path");

  Block p = ob.child("params");
  if (p.present() && p.raw("max_grad_norm")) {
    p.fail("max_grad_norm", "not an optimizer parameter; use the top-level \"gradient_clipping\"");
  }
  o.hyper.beta1 = o.hyper.beta2 = 0;  // set by the readers that read betas; unused by the others
  readers().at(optimizer_row(o.type).types.front())(top, p, o);
  // A parameter of another optimizer (betas for SGD) is a likelier mistake than a typo: say so.
  std::vector<std::string> all_params;
  for (const OptimizerRow* row : optimizer_rows()) {
    all_params.insert(all_params.end(), row->group_keys.begin(), row->group_keys.end());
    all_params.insert(all_params.end(), row->config_keys.begin(), row->config_keys.end());
  }
  for (const auto& k : all_params)
    if (!p.out().contains(k) && p.has(k)) {
      std::vector<std::string> takes;
      for (auto it = p.out().begin(); it != p.out().end(); ++it) takes.push_back(it.key());
      p.fail(k, "not a parameter of " + o.type + "; expected one of " + quoted_list(takes));
    }
  p.finish();
  ob.finish();
}

}  // namespace config

}  // namespace zeroshard
