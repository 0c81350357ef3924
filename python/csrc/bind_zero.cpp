// Bindings for zero/: the ZeRO optimizer that the Python engine drives.
#include <ATen/SequenceNumber.h>
#include <torch/csrc/utils/pybind.h>

#include "python/csrc/bindings.h"
#include "runtime/error.h"
#include "zero/frozen_release.h"
#include "zero/optimizer.h"

namespace py = pybind11;

namespace zeroshard::python {

namespace {
GroupHyper hyper_from_dict(const py::dict& d) {
  GroupHyper h;
  auto get = [&](const char* k, double dflt) {
    if (!d.contains(k)) return dflt;
    try {
      return d[k].cast<double>();
    } catch (const py::cast_error&) {
      throw ConfigError(detail::cat("optimizer.param_groups[...][\"", k, "\"]: got ",
                                    py::str(d[k]).cast<std::string>(), ", expected a number"));
    }
  };
  h.lr = get("lr", h.lr);
  h.weight_decay = get("weight_decay", h.weight_decay);
  if (d.contains("betas")) {
    auto b = d["betas"].cast<std::pair<double, double>>();
    h.beta1 = b.first;
    h.beta2 = b.second;
  }
  h.eps = get("eps", h.eps);
  h.momentum = get("momentum", h.momentum);
  h.dampening = get("dampening", h.dampening);
  h.nesterov = d.contains("nesterov") && d["nesterov"].cast<bool>();
  h.lr_decay = get("lr_decay", h.lr_decay);
  return h;
}
OptimizerConfig optimizer_from_dict(const py::dict& d) {
  OptimizerConfig o;
  o.present = true;
  o.type = d["type"].cast<std::string>();
  if (d.contains("adam_w_mode")) o.adam_w_mode = d["adam_w_mode"].cast<bool>();
  if (d.contains("bias_correction")) o.bias_correction = d["bias_correction"].cast<bool>();
  if (d.contains("initial_accumulator_value"))
    o.initial_accumulator_value = d["initial_accumulator_value"].cast<double>();
  return o;
}

py::dict optimizer_to_dict(const OptimizerConfig& o) {
  py::dict d;
  d["present"] = o.present;
  d["type"] = o.type;
  d["lr"] = o.lr;
  d["betas"] = py::make_tuple(o.beta1, o.beta2);
  d["eps"] = o.eps;
  d["weight_decay"] = o.weight_decay;
  d["adam_w_mode"] = o.adam_w_mode;
  d["bias_correction"] = o.bias_correction;
  d["momentum"] = o.momentum;
  d["dampening"] = o.dampening;
  d["nesterov"] = o.nesterov;
  d["lr_decay"] = o.lr_decay;
  d["initial_accumulator_value"] = o.initial_accumulator_value;
  return d;
}
}  // namespace

void bind_zero(py::module_& m) {
  // The sequence number the next autograd node created on this thread gets (every node but
  // AccumulateGrad takes one): ZeRO-3's hooks bracket a module's forward with it.
  m.def("autograd_sequence_number", [] { return at::sequence_number::peek(); });
  // The config's optimizer block with its defaults, for the Python param_groups.
  m.def("require_buildable", [](const std::shared_ptr<Config>& c) { require_buildable(c->zero_optimization); },
        py::arg("config"));
  m.def("optimizer_config", [](const std::shared_ptr<Config>& c) { return optimizer_to_dict(c->optimizer); });
  // Fields of the config the Python engine reads directly.
  m.def("engine_settings", [](const std::shared_ptr<Config>& c) {
    py::dict d;
    d["precision"] = c->precision() == Precision::fp16 ? "fp16" : c->precision() == Precision::bf16 ? "bf16" : "fp32";
    d["fp16_auto_cast"] = c->fp16.auto_cast;
    d["stage"] = c->zero_optimization.stage;
    d["gradient_clipping"] = c->gradient_clipping;
    d["steps_per_print"] = c->steps_per_print;
    d["wall_clock_breakdown"] = c->wall_clock_breakdown;
    d["dataloader_drop_last"] = c->dataloader_drop_last;
    d["scheduler"] = c->scheduler.present ? py::object(py::str(c->scheduler.type)) : py::object(py::none());
    d["zero_allow_untested_optimizer"] = c->zero_allow_untested_optimizer;
    d["offload_optimizer"] = c->zero_optimization.offload_optimizer.device;
    d["offload_param"] = c->zero_optimization.offload_param.device;
    d["gather_16bit_weights_on_model_save"] =
        c->zero_optimization.stage3_gather_16bit_weights_on_model_save;
    return d;
  });

  py::class_<StepResult>(m, "StepResult")
      .def_readonly("applied", &StepResult::applied)
      .def_readonly("grad_norm", &StepResult::grad_norm)
      .def_readonly("loss_scale", &StepResult::loss_scale);

  // When ZeRO-3 may release frozen parameters early (zero/frozen_release.h); the engine's hooks
  // report forwards and the nodes that ran, and ask it.
  py::class_<FrozenRelease, std::shared_ptr<FrozenRelease>>(m, "FrozenRelease")
      .def(py::init([](std::shared_ptr<Comm> comm, const std::string& device) {
             return std::make_shared<FrozenRelease>(std::move(comm), c10::Device(device));
           }),
           py::arg("comm"), py::arg("device"))
      .def("record", &FrozenRelease::record, py::arg("tracked"))
      .def("agree_now", &FrozenRelease::agree_now, py::arg("tracked"),
           py::call_guard<py::gil_scoped_release>())
      .def("may_arm", &FrozenRelease::may_arm, py::arg("verdict"), py::arg("grad_enabled"))
      .def_property_readonly("in_backward", &FrozenRelease::in_backward)
      .def("begin_backward", &FrozenRelease::begin_backward, py::call_guard<py::gil_scoped_release>())
      .def("end_backward", &FrozenRelease::end_backward)
      .def_readonly_static("NEVER", &FrozenRelease::kNever);

  // The run's progress (runtime/training_state.h): the engine's counters read it, and
  // state_dict()/load_state_dict() carry it whole as JSON-compatible dicts.
  py::class_<TrainingState>(m, "TrainingState")
      .def_property_readonly("global_steps", &TrainingState::global_steps)
      .def_property_readonly("micro_steps", &TrainingState::micro_steps)
      .def_property_readonly("global_samples", &TrainingState::global_samples)
      .def_property_readonly("skipped_steps", &TrainingState::skipped_steps)
      .def("count_micro_step", &TrainingState::count_micro_step)
      .def("state_dict", [](const TrainingState& s) {
        return py::module_::import("json").attr("loads")(s.state_dict().dump());
      })
      .def("load_state_dict", [](TrainingState& s, const py::dict& state) {
        const std::string text = py::module_::import("json").attr("dumps")(state).cast<std::string>();
        s.load_state_dict(nlohmann::json::parse(text));
      }, py::arg("state"));

  py::class_<ZeroOptimizer, std::shared_ptr<ZeroOptimizer>>(m, "ZeroOptimizer")
      .def(py::init([](std::shared_ptr<Comm> comm, std::shared_ptr<Config> config,
                       const py::dict& optimizer, const std::vector<std::vector<at::Tensor>>& groups,
                       at::ScalarType dtype,
                       const std::vector<std::vector<ChunkedShape>>& prechunked_shapes,
                       const std::vector<at::Tensor>& frozen,
                       const std::vector<ChunkedShape>& frozen_shapes) {
             const OptimizerConfig oc = optimizer_from_dict(optimizer);
             py::gil_scoped_release release;
             return std::make_shared<ZeroOptimizer>(std::move(comm), *config, oc, groups, dtype,
                                                    prechunked_shapes, frozen, frozen_shapes);
           }),
           py::arg("comm"), py::arg("config"), py::arg("optimizer"), py::arg("groups"),
           py::arg("model_dtype"),
           py::arg("prechunked_shapes") = std::vector<std::vector<ChunkedShape>>{},
           py::arg("frozen") = std::vector<at::Tensor>{},
           py::arg("frozen_shapes") = std::vector<ChunkedShape>{})
      .def("param_views", &ZeroOptimizer::param_views)
      .def("grad_views", &ZeroOptimizer::grad_views)
      .def("grad_ready",
           [](ZeroOptimizer& o, int64_t index, const std::optional<at::Tensor>& grad) {
             py::gil_scoped_release release;
             o.grad_ready(index, grad.value_or(at::Tensor()));
           },
           py::arg("param_index"), py::arg("grad"))
      .def("before_backward", &ZeroOptimizer::before_backward, py::arg("accumulation_boundary"))
      .def("after_backward", &ZeroOptimizer::after_backward, py::arg("accumulation_boundary"),
           py::call_guard<py::gil_scoped_release>())
      .def("abort_backward", &ZeroOptimizer::abort_backward, py::call_guard<py::gil_scoped_release>())
      .def("abort_forward", &ZeroOptimizer::abort_forward, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("keeps_full_grads", &ZeroOptimizer::keeps_full_grads)
      .def_property_readonly("partitions_params", &ZeroOptimizer::partitions_params)
      // Stage 3: the engine's module hooks drive the parameter coordinator.
      .def("attach_parameters",
           [](ZeroOptimizer& o, const std::vector<at::Tensor>& params) { o.coordinator().attach(params); },
           py::arg("params"), py::call_guard<py::gil_scoped_release>())
      .def("register_module",
           [](ZeroOptimizer& o, int64_t id, const std::vector<int64_t>& params) {
             o.coordinator().register_module(id, params);
           },
           py::arg("module_id"), py::arg("param_indices"))
      .def("begin_forward",
           [](ZeroOptimizer& o, bool grad_enabled) { o.coordinator().begin_forward(grad_enabled); },
           py::arg("grad_enabled"))
      .def("end_forward", [](ZeroOptimizer& o) { o.coordinator().end_forward(); },
           py::call_guard<py::gil_scoped_release>())
      .def("fetch", [](ZeroOptimizer& o, int64_t id, bool bwd) { o.coordinator().fetch(id, bwd); },
           py::arg("module_id"), py::arg("for_backward") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("release",
           [](ZeroOptimizer& o, int64_t id, bool during_backward) {
             return o.coordinator().release(id, during_backward);
           },
           py::arg("module_id"), py::arg("during_backward") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("backward_nodes_done",
           [](ZeroOptimizer& o, int64_t id, int64_t gathers) { o.coordinator().backward_nodes_done(id, gathers); },
           py::arg("module_id"), py::arg("gathers") = 1, py::call_guard<py::gil_scoped_release>())
      .def("holds_frozen", [](ZeroOptimizer& o, int64_t id) { return o.coordinator().holds_frozen(id); },
           py::arg("module_id"))
      .def("read_in_forward",
           [](ZeroOptimizer& o, int64_t id, int64_t i) { return o.coordinator().read_in_forward(id, i); },
           py::arg("module_id"), py::arg("param_index"), py::call_guard<py::gil_scoped_release>())
      .def("add_external",
           [](ZeroOptimizer& o, int64_t id, int64_t i) { return o.coordinator().add_external(id, i); },
           py::arg("module_id"), py::arg("param_index"))
      .def("fetch_params",
           [](ZeroOptimizer& o, const std::vector<int64_t>& ids) { o.coordinator().fetch_params(ids); },
           py::arg("param_indices"), py::call_guard<py::gil_scoped_release>())
      .def("release_params",
           [](ZeroOptimizer& o, const std::vector<int64_t>& ids) { o.coordinator().release_params(ids); },
           py::arg("param_indices"), py::call_guard<py::gil_scoped_release>())
      .def("write_back",
           [](ZeroOptimizer& o, int64_t i, int modifier_rank) { o.coordinator().write_back(i, modifier_rank); },
           py::arg("param_index"), py::arg("modifier_rank") = -1, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("live_gathered_numel",
                             [](ZeroOptimizer& o) { return o.coordinator().live_gathered_numel(); })
      .def_property_readonly("peak_gathered_numel",
                             [](ZeroOptimizer& o) { return o.coordinator().peak_gathered_numel(); })
      .def("reset_gathered_peak", [](ZeroOptimizer& o) { o.coordinator().reset_peak(); })
      .def_property_readonly("prefetched_params",
                             [](ZeroOptimizer& o) { return o.coordinator().prefetched_params(); })
      .def_property_readonly("trace_invalidations",
                             [](ZeroOptimizer& o) { return o.coordinator().trace_invalidations(); })
      .def("step",
           [](ZeroOptimizer& o, const py::list& groups, int64_t samples) {
             std::vector<GroupHyper> hypers;
             for (const auto& g : groups) hypers.push_back(hyper_from_dict(g.cast<py::dict>()));
             py::gil_scoped_release release;
             return o.step(hypers, samples);
           },
           py::arg("param_groups"), py::arg("samples"))
      .def_property_readonly("state", [](ZeroOptimizer& o) -> TrainingState& { return o.training_state(); },
                             py::return_value_policy::reference_internal)
      .def("zero_grad", &ZeroOptimizer::zero_grad, py::call_guard<py::gil_scoped_release>())
      .def("master", &ZeroOptimizer::master, py::arg("group"))
      .def("full_value",
           [](ZeroOptimizer& o, int64_t index, const std::string& what) -> std::optional<at::Tensor> {
             at::Tensor t;
             {
               py::gil_scoped_release release;
               t = o.full_value(index, what);
             }
             if (!t.defined()) return std::nullopt;
             return t;
           },
           py::arg("index"), py::arg("what"))
      .def("set_full_value", &ZeroOptimizer::set_full_value, py::arg("index"), py::arg("what"),
           py::arg("value"), py::arg("src_rank") = 0, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("loss_scale", &ZeroOptimizer::loss_scale)
      .def_property_readonly("memory", &ZeroOptimizer::memory, py::return_value_policy::reference_internal)
      .def_property_readonly("stage", &ZeroOptimizer::stage)
      .def_property_readonly("num_buckets", &ZeroOptimizer::num_buckets)
      .def_property_readonly("num_params", &ZeroOptimizer::num_params);
}

}  // namespace zeroshard::python
