// Bindings for zero/: the ZeRO optimizer that the Python engine drives.
#include <ATen/SequenceNumber.h>
#include <torch/csrc/utils/pybind.h>

#include "python/csrc/bindings.h"
#include "runtime/error.h"
#include "runtime/shard.h"
#include "zero/buckets.h"
#include "zero/frozen_release.h"
#include "zero/optimizer.h"
#include "zero/strategy.h"
#include "zero/swap_space.h"

namespace py = pybind11;

namespace zeroshard::python {

namespace {
// Param group `g`'s values for the keys the optimizer's table row reads (optim/table.h), through
// the one key table (optim/hyper.h); a key the dict lacks keeps GroupHyper's initializer.
GroupHyper hyper_from_dict(const py::dict& d, size_t g, const OptimizerRow& row) {
  GroupHyper h;
  for (const std::string& name : row.group_keys) {
    if (!d.contains(name.c_str())) continue;
    const py::handle v = d[name.c_str()];
    const HyperKey& k = hyper_key(name);
    const auto bad = [&](const char* expected) {
      return UsageError(detail::cat("optimizer.param_groups[", g, "][\"", name, "\"]: got ",
                                    py::repr(v).cast<std::string>(), ", expected ", expected));
    };
    if (k.flag) {
      if (!py::isinstance<py::bool_>(v)) throw bad("true or false");
      h.*k.flag = v.cast<bool>();
    } else if (k.second) {
      try {
        const auto pair = v.cast<std::pair<double, double>>();
        h.*k.number = pair.first;
        h.*k.second = pair.second;
      } catch (const py::cast_error&) {
        throw bad("a pair of numbers");
      }
    } else {
      try {
        h.*k.number = v.cast<double>();
      } catch (const py::cast_error&) {
        throw bad("a number");
      }
    }
  }
  return h;
}

// The param_group values a group starts with from the config's optimizer block: the row's keys.
py::dict group_defaults(const OptimizerConfig& o) {
  py::dict d;
  for (const std::string& name : optimizer_row(o.type).group_keys) {
    const HyperKey& k = hyper_key(name);
    if (k.flag) d[name.c_str()] = o.hyper.*k.flag;
    else if (k.second) d[name.c_str()] = py::make_tuple(o.hyper.*k.number, o.hyper.*k.second);
    else d[name.c_str()] = o.hyper.*k.number;
  }
  return d;
}

// What a client torch optimizer maps to (python/zeroshard/optimizer.py): its type and fixed
// settings; its hyperparameters come with its param_groups.
OptimizerConfig client_optimizer(const py::dict& d) {
  OptimizerConfig o;
  o.present = true;
  o.type = d["type"].cast<std::string>();
  optimizer_row(o.type);  // a ConfigError naming the types for any other
  if (d.contains("adam_w_mode")) o.adam_w_mode = d["adam_w_mode"].cast<bool>();
  if (d.contains("bias_correction")) o.bias_correction = d["bias_correction"].cast<bool>();
  if (d.contains("eps_inside_sqrt")) o.eps_inside_sqrt = d["eps_inside_sqrt"].cast<bool>();
  if (d.contains("initial_accumulator_value"))
    o.initial_accumulator_value = d["initial_accumulator_value"].cast<double>();
  return o;
}
}  // namespace

void bind_zero(py::module_& m) {
  // The layout rules the memory planner (zeroshard/planner) counts bytes with: the same functions
  // and constants the runtime lays its buffers out with (runtime/shard.h, zero/buckets.h,
  // zero/swap_space.h).
  py::module_ lm = m.def_submodule("layout", "flat-buffer padding, ZeRO-3 chunks and gradient buckets");
  lm.attr("alignment_numel") = kAlignmentNumel;
  lm.def("flat_layout", [](const std::vector<int64_t>& numels, int64_t world_size) {
        const FlatLayout L = make_flat_layout(numels, world_size, kAlignmentNumel);
        return py::make_tuple(L.total_numel, L.padded_numel, L.shard_numel());
      }, py::arg("numels"), py::arg("world_size"),
      "(total_numel, padded_numel, shard_numel) of one flat group at stages 0-2");
  lm.def("chunk_layout", [](const std::vector<int64_t>& numels, int64_t world_size) {
        const ChunkLayout L = make_chunk_layout(numels, world_size);
        return py::make_tuple(L.chunks, L.shard_numel);
      }, py::arg("numels"), py::arg("world_size"), "(chunk numel per tensor, shard_numel) at stage 3");
  lm.def("stage_traits", [](int stage) {
        ZeroConfig zc;
        zc.stage = stage;
        const auto strategy = make_strategy(zc);
        py::dict d;
        d["shards_optimizer_state"] = strategy->shards_optimizer_state();
        d["keeps_full_grads"] = strategy->keeps_full_grads();
        d["partitions_params"] = strategy->partitions_params();
        return d;
      }, py::arg("stage"), "what ZeRO stage `stage` shards and keeps (zero/strategy.h)");
  lm.def("swap_region_bytes", &swap_region_bytes, py::arg("value_bytes"), py::arg("slots"),
         "bytes of one NVMe swap-file region: header, values and `slots` state slots, each padded");
  lm.def("swap_staging_bytes", [](int64_t value_bytes, int64_t slots) {
        return staging_allocation_bytes(swap_region_bytes(value_bytes, slots));
      }, py::arg("value_bytes"), py::arg("slots"),
      "host-pool bytes of one NVMe staging buffer for a region of value_bytes and `slots` state slots");
  lm.def("optimizer_state_slots", [](const std::string& type) { return optimizer_row(type).state_names.size(); },
         py::arg("type"), "state tensors per element of the optimizer `type` (Adam: 2)");
  lm.def("effective_bucket_numel", &effective_bucket_numel, py::arg("reduce_bucket_size"),
         py::arg("full_grads"), py::arg("overlap_comm"));
  lm.def("plan_buckets", [](const std::vector<int64_t>& numels, int64_t world_size, int64_t bucket_numel) {
        const FlatLayout L = make_flat_layout(numels, world_size, kAlignmentNumel);
        std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
        for (const BucketSpec& b : plan_buckets({&L}, bucket_numel).buckets) {
          out.emplace_back(b.first_param, b.end_param, b.offset, b.numel);
        }
        return out;
      }, py::arg("numels"), py::arg("world_size"), py::arg("bucket_numel"),
      "one group's gradient buckets as (first_param, end_param, offset, numel), in fill order");

  // The sequence number the next autograd node created on this thread gets (every node but
  // AccumulateGrad takes one): ZeRO-3's hooks bracket a module's forward with it.
  m.def("autograd_sequence_number", [] { return at::sequence_number::peek(); });
  // Refuses what this build cannot do (offload), before the engine touches the model.
  m.def("require_buildable", [](const std::shared_ptr<Config>& c) { require_buildable(c->zero_optimization); },
        py::arg("config"));
  // The config's optimizer type and the param_group values its groups start with.
  m.def("optimizer_config", [](const std::shared_ptr<Config>& c) {
    py::dict d;
    d["present"] = c->optimizer.present;
    if (c->optimizer.present) {
      d["type"] = c->optimizer.type;
      d["group_defaults"] = group_defaults(c->optimizer);
    }
    return d;
  });

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
    d["zero_force_ds_cpu_optimizer"] = c->zero_force_ds_cpu_optimizer;
    d["offload_optimizer"] = c->zero_optimization.offload_optimizer.device;
    d["offload_param"] = c->zero_optimization.offload_param.device;
    d["gather_16bit_weights_on_model_save"] =
        c->zero_optimization.stage3_gather_16bit_weights_on_model_save;
    py::dict ck;
    ck["tag_validation"] = c->checkpoint.tag_validation;
    ck["load_universal"] = c->checkpoint.load_universal;
    ck["use_node_local_storage"] = c->checkpoint.use_node_local_storage;
    ck["parallel_write_pipeline_stage"] = c->checkpoint.parallel_write_pipeline_stage;
    d["checkpoint"] = ck;
    py::dict pipe;
    pipe["stages"] = c->pipeline.stages;
    pipe["schedule"] = c->pipeline.schedule;
    pipe["virtual_stages"] = c->pipeline.virtual_stages;
    pipe["activation_checkpoint_interval"] = c->pipeline.activation_checkpoint_interval;
    pipe["seed_layers"] = c->pipeline.seed_layers;
    pipe["partition"] = c->pipeline.partition;
    d["pipeline"] = pipe;
    d["cpu_checkpointing"] = c->activation_checkpointing.cpu_checkpointing;
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
      // The factor backward multiplies the loss by (the fp16 loss scale; 1 without fp16).
      .def_property_readonly("loss_scale", [](const TrainingState& s) { return s.scaler().scale(); })
      .def("count_micro_step", &TrainingState::count_micro_step)
      .def("state_dict", [](const TrainingState& s) {
        return py::module_::import("json").attr("loads")(s.state_dict().dump());
      })
      .def("load_state_dict", [](TrainingState& s, const py::dict& state) {
        const std::string text = py::module_::import("json").attr("dumps")(state).cast<std::string>();
        s.load_state_dict(nlohmann::json::parse(text));
      }, py::arg("state"));

  // What differs between stages (zero/strategy.h), as the engine asks it.
  py::class_<ZeroStrategy>(m, "ZeroStrategy")
      .def_property_readonly("stage", &ZeroStrategy::stage)
      .def_property_readonly("keeps_full_grads", &ZeroStrategy::keeps_full_grads)
      .def_property_readonly("partitions_params", &ZeroStrategy::partitions_params)
      .def_property_readonly("shards_optimizer_state", &ZeroStrategy::shards_optimizer_state);

  // DeepSpeed's safe_get_full_* / safe_set_full_* (zero/full_values.h).
  py::class_<FullValues>(m, "FullValues")
      .def("get",
           [](FullValues& f, int64_t index, const std::string& what) -> std::optional<at::Tensor> {
             at::Tensor t;
             {
               py::gil_scoped_release release;
               t = f.get(index, what);
             }
             if (!t.defined()) return std::nullopt;
             return t;
           },
           py::arg("index"), py::arg("what"))
      .def("set", &FullValues::set, py::arg("index"), py::arg("what"), py::arg("value"),
           py::arg("src_rank") = 0, py::call_guard<py::gil_scoped_release>());

  // Stage 3's parameters one by one (zero/param_gatherer.h): the engine attaches them,
  // GatheredParameters gathers and writes them back, and the counters say how much is gathered.
  py::class_<ParamGatherer>(m, "ParamGatherer")
      .def("attach", &ParamGatherer::attach, py::arg("params"), py::call_guard<py::gil_scoped_release>())
      .def("fetch_params", &ParamGatherer::fetch_params, py::arg("param_indices"),
           py::call_guard<py::gil_scoped_release>())
      .def("release_params", &ParamGatherer::release_params, py::arg("param_indices"),
           py::call_guard<py::gil_scoped_release>())
      .def("release_unreferenced", &ParamGatherer::release_unreferenced,
           py::call_guard<py::gil_scoped_release>())
      .def("write_back", &ParamGatherer::write_back, py::arg("param_index"),
           py::arg("modifier_rank") = -1, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("live_gathered_numel",
                             [](const ParamGatherer& g) { return g.counters().live_numel; })
      .def_property_readonly("peak_gathered_numel",
                             [](const ParamGatherer& g) { return g.counters().peak_live_numel; })
      .def("reset_gathered_peak", &ParamGatherer::reset_peak)
      .def_property_readonly("prefetched_params",
                             [](const ParamGatherer& g) { return g.counters().prefetched_params; });

  // Stage 3's schedule by module (zero/param_coordinator.h), driven by the engine's module hooks.
  py::class_<ParamCoordinator>(m, "ParamCoordinator")
      .def("register_module", &ParamCoordinator::register_module, py::arg("module_id"),
           py::arg("param_indices"))
      .def("begin_forward", &ParamCoordinator::begin_forward, py::arg("grad_enabled"))
      .def("end_forward", &ParamCoordinator::end_forward, py::call_guard<py::gil_scoped_release>())
      .def("fetch", &ParamCoordinator::fetch, py::arg("module_id"), py::arg("for_backward") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("release", &ParamCoordinator::release, py::arg("module_id"),
           py::arg("during_backward") = false, py::call_guard<py::gil_scoped_release>())
      .def("backward_nodes_done", &ParamCoordinator::backward_nodes_done, py::arg("module_id"),
           py::arg("gathers") = 1, py::call_guard<py::gil_scoped_release>())
      .def("holds_frozen", &ParamCoordinator::holds_frozen, py::arg("module_id"))
      .def("read_in_forward", &ParamCoordinator::read_in_forward, py::arg("module_id"),
           py::arg("param_index"), py::call_guard<py::gil_scoped_release>())
      .def("add_external", &ParamCoordinator::add_external, py::arg("module_id"), py::arg("param_index"))
      .def_property_readonly("trace_invalidations", &ParamCoordinator::trace_invalidations);

  py::class_<ZeroOptimizer, std::shared_ptr<ZeroOptimizer>>(m, "ZeroOptimizer")
      .def(py::init([](std::shared_ptr<Comm> comm, std::shared_ptr<Config> config,
                       const std::optional<py::dict>& client,
                       const std::vector<std::vector<at::Tensor>>& groups, at::ScalarType dtype,
                       const std::vector<std::vector<ChunkedShape>>& prechunked_shapes,
                       const std::vector<at::Tensor>& frozen,
                       const std::vector<ChunkedShape>& frozen_shapes) {
             // The config's optimizer block stays in C++; a client optimizer's mapping comes in.
             const OptimizerConfig oc = client ? client_optimizer(*client) : config->optimizer;
             ZS_REQUIRE(oc.present, "optimizer: none given");
             py::gil_scoped_release release;
             return std::make_shared<ZeroOptimizer>(std::move(comm), *config, oc, groups, dtype,
                                                    prechunked_shapes, frozen, frozen_shapes);
           }),
           py::arg("comm"), py::arg("config"), py::arg("client_optimizer"), py::arg("groups"),
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
      .def("step",
           // group_numbers: each group's index in optimizer.param_groups, which errors name (the
           // core holds only the groups with parameters; optimizer.py).
           [](ZeroOptimizer& o, const py::list& groups, int64_t samples, double duplicate_sum_sq,
              const std::vector<int64_t>& group_numbers) {
             const OptimizerRow& row = optimizer_row(o.optimizer().type);
             std::vector<GroupHyper> hypers;
             for (const auto& g : groups) {
               const size_t i = hypers.size();
               hypers.push_back(hyper_from_dict(g.cast<py::dict>(),
                                                i < group_numbers.size() ? size_t(group_numbers[i]) : i, row));
             }
             py::gil_scoped_release release;
             return o.step(hypers, samples, duplicate_sum_sq);
           },
           py::arg("param_groups"), py::arg("samples"), py::arg("duplicate_sum_sq") = 0.0,
           py::arg("group_numbers") = std::vector<int64_t>{})
      .def("set_model_parallel", &ZeroOptimizer::set_model_parallel, py::arg("across"))
      .def("zero_grad", &ZeroOptimizer::zero_grad, py::call_guard<py::gil_scoped_release>())
      .def("master", &ZeroOptimizer::master, py::arg("group"))
      .def("sub_groups", [](const ZeroOptimizer& o, int64_t g) {
             py::list out;
             for (const SubGroup& sg : o.sub_groups(g)) out.append(py::make_tuple(sg.begin, sg.numel, residency_name(sg.residency)));
             return out;
           }, py::arg("group"))
      .def("last_step_times", [](const ZeroOptimizer& o) {
             py::dict d;
             d["transfer_ms"] = o.last_step_times().transfer_ms;
             d["host_step_ms"] = o.last_step_times().host_step_ms;
             d["early_sub_groups"] = o.last_step_times().early_sub_groups;
             d["nvme_wait_ms"] = o.last_step_times().nvme_wait_ms;
             return d;
           })
      .def_property_readonly("strategy", &ZeroOptimizer::strategy, py::return_value_policy::reference_internal)
      .def_property_readonly("coordinator", &ZeroOptimizer::coordinator,
                             py::return_value_policy::reference_internal)
      .def_property_readonly("gatherer",
                             [](ZeroOptimizer& o) -> ParamGatherer& { return o.coordinator().gatherer(); },
                             py::return_value_policy::reference_internal)
      .def_property_readonly("full_values", &ZeroOptimizer::full_values,
                             py::return_value_policy::reference_internal)
      .def_property_readonly("state", &ZeroOptimizer::training_state, py::return_value_policy::reference_internal)
      .def_property_readonly("memory", &ZeroOptimizer::memory, py::return_value_policy::reference_internal)
      .def_property_readonly("num_buckets", &ZeroOptimizer::num_buckets)
      .def_property_readonly("num_params", &ZeroOptimizer::num_params)
      // [(kind, parameter index, first element, 1-D live view, replicated)] (zero/shard_entries.h)
      .def("shard_entries", [](ZeroOptimizer& o, bool with_state) {
        py::list out;
        for (const ShardEntry& e : o.shard_entries(with_state)) {
          out.append(py::make_tuple(e.kind, e.index, e.tensor_begin, e.values, e.replicated));
        }
        return out;
      }, py::arg("with_state"))
      .def("after_load", &ZeroOptimizer::after_load, py::call_guard<py::gil_scoped_release>())
      // A reader of shard_entries is done: NVMe state leaves host memory (its views stay valid).
      .def("end_entries", &ZeroOptimizer::end_entries, py::arg("written"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("swap_backend", &ZeroOptimizer::swap_backend)
      // offload_param.device "nvme": what the parameter chunks' swap did and holds; None otherwise.
      .def("param_swap_stats", [](const ZeroOptimizer& o) -> py::object {
             const ParamSwap* s = o.param_swap();
             if (!s) return py::none();
             const ParamSwapCounters& c = s->counters();
             py::dict d;
             d["reads"] = c.reads;
             d["writes"] = c.writes;
             d["prefetched"] = c.prefetched;
             d["peak_lent"] = c.peak_lent;
             d["resident_numel"] = c.resident_numel;
             d["peak_resident_numel"] = c.peak_resident_numel;
             d["persistent_numel"] = c.persistent_numel;
             d["wait_ms"] = c.wait_ms;
             d["mapped_bytes"] = s->mapped_bytes();
             return std::move(d);
           })
      // Fault tests: "<eio|short>:<read|write>:<n>", the n-th block request from now of the
      // optimizer's or the parameters' NVMe engine fails.
      .def("inject_nvme_fault", &ZeroOptimizer::inject_swap_fault, py::arg("spec"),
           py::arg("engine") = "optimizer")
      .def("drop_optimizer_state", &ZeroOptimizer::drop_optimizer_state)
      .def_property_readonly("optimizer_type", [](const ZeroOptimizer& o) { return o.optimizer().type; })
      .def_property_readonly("state_names",
                             [](const ZeroOptimizer& o) { return optimizer_row(o.optimizer().type).state_names; });
}

}  // namespace zeroshard::python
