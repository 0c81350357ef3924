// Bindings for pipeline/, as _C.pipeline: the schedules' instruction lists (built and checked
// here before the Python engine runs one), their simulation for the benchmark, and the layer
// partition. No Torch types cross this boundary, so the file needs only pybind11.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "pipeline/partition.h"
#include "pipeline/schedule.h"
#include "pipeline/schedule_check.h"
#include "python/csrc/bindings.h"
#include "runtime/error.h"

namespace py = pybind11;

namespace zeroshard::python {
namespace {

using pipeline::Instruction;
using pipeline::Op;

// (op name, micro_batch, chunk, peer); -1 where the instruction has no such field.
using Row = std::tuple<std::string, int, int, int>;

Op op_from(const std::string& name) {
  for (int i = 0; i <= static_cast<int>(Op::optimizer_step); ++i) {
    if (pipeline::to_string(static_cast<Op>(i)) == name) return static_cast<Op>(i);
  }
  throw UsageError("pipeline: unknown instruction \"" + name + "\"");
}

std::vector<std::vector<Row>> to_rows(const std::vector<std::vector<Instruction>>& lists) {
  std::vector<std::vector<Row>> out;
  for (const auto& list : lists) {
    auto& rows = out.emplace_back();
    for (const Instruction& i : list) rows.emplace_back(pipeline::to_string(i.op), i.micro_batch, i.chunk, i.peer);
  }
  return out;
}

std::vector<std::vector<Instruction>> from_rows(const std::vector<std::vector<Row>>& rows) {
  std::vector<std::vector<Instruction>> out;
  for (const auto& list : rows) {
    auto& instructions = out.emplace_back();
    for (const auto& [op, mb, chunk, peer] : list) instructions.push_back({op_from(op), mb, chunk, peer});
  }
  return out;
}

py::dict report_dict(const pipeline::ScheduleReport& report) {
  py::dict d;
  py::list peaks, graphs, busy;
  for (const auto& r : report.ranks) {
    peaks.append(r.peak_activations);
    graphs.append(r.peak_graphs);
    busy.append(r.busy_time);
  }
  d["peak_activations"] = peaks;
  d["peak_graphs"] = graphs;  // = peak_activations but for zero_bubble (graphs live until W)
  d["busy_time"] = busy;
  d["makespan"] = report.makespan;
  d["bubble_fraction"] = report.bubble_fraction();
  return d;
}

pipeline::InstructionCosts costs_from(const std::map<std::string, double>& given) {
  pipeline::InstructionCosts c;
  for (const auto& [name, value] : given) {
    if (name == "forward") c.forward = value;
    else if (name == "backward") c.backward = value;
    else if (name == "backward_input") c.backward_input = value;
    else if (name == "backward_weight") c.backward_weight = value;
    else if (name == "communication") c.communication = value;
    else throw UsageError("costs: unknown key \"" + name + "\", expected forward, backward, backward_input, "
                          "backward_weight or communication");
  }
  return c;
}

}  // namespace

void bind_pipeline(py::module_& root) {
  py::module_ m = root.def_submodule("pipeline", "pipeline schedules and partitioning (pipeline/)");
  // Every rank's list for one training step, proven runnable and within the schedule's memory
  // bound by the checker first, and the checker's report at unit costs (peak activations and
  // graphs per rank, bubble fraction).
  m.def(
      "build",
      [](const std::string& kind, int stages, int micro_batches, int virtual_stages) {
        const pipeline::PipelineShape shape{stages, micro_batches, virtual_stages};
        const pipeline::ScheduleKind schedule = pipeline::parse_schedule_kind(kind);
        const auto lists = pipeline::build_all_schedules(schedule, shape);
        const auto report = pipeline::check_schedule(schedule, shape, lists);
        return py::make_tuple(to_rows(lists), report_dict(report));
      },
      py::arg("schedule"), py::arg("stages"), py::arg("micro_batches"), py::arg("virtual_stages") = 1);
  // eval_batch's lists for every rank (forwards only), proven runnable by the checker first, and
  // its report at unit costs.
  m.def(
      "build_eval",
      [](int stages, int micro_batches, int virtual_stages) {
        const pipeline::PipelineShape shape{stages, micro_batches, virtual_stages};
        const auto lists = pipeline::build_eval_schedules(shape);
        return py::make_tuple(to_rows(lists), report_dict(pipeline::check_eval_schedule(shape, lists)));
      },
      py::arg("stages"), py::arg("micro_batches"), py::arg("virtual_stages") = 1);
  // Simulates lists (as build returns them) at the given per-instruction costs (the benchmark's
  // measured ones); raises where they are not runnable. No memory bound: build proved it.
  m.def(
      "simulate",
      [](const std::vector<std::vector<Row>>& lists, int micro_batches, int virtual_stages,
         const std::map<std::string, double>& costs) {
        const pipeline::PipelineShape shape{static_cast<int>(lists.size()), micro_batches, virtual_stages};
        return report_dict(pipeline::simulate_schedule(shape, from_rows(lists), costs_from(costs)));
      },
      py::arg("lists"), py::arg("micro_batches"), py::arg("virtual_stages") = 1, py::arg("costs") = std::map<std::string, double>{});
  m.def("partition_balanced", &pipeline::partition_balanced, py::arg("weights"), py::arg("parts"));
  m.def("partition_uniform", &pipeline::partition_uniform, py::arg("num_items"), py::arg("parts"));
}

}  // namespace zeroshard::python
