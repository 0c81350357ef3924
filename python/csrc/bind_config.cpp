// Bindings for runtime/config: parsing a ds_config and reading the resolved result.
#include <torch/csrc/utils/pybind.h>

#include "python/csrc/bindings.h"
#include "runtime/config/config.h"

namespace py = pybind11;

namespace zeroshard::python {

void bind_config(py::module_& m) {
  py::class_<Config, std::shared_ptr<Config>>(m, "Config")
      .def("resolve_batch",
           [](Config& c, int64_t world) {
             auto r = c.resolve_batch(world);
             return py::make_tuple(r.train_batch_size, r.train_micro_batch_size_per_gpu,
                                   r.gradient_accumulation_steps);
           },
           py::arg("dp_world_size"))
      .def("resolved_json", [](const Config& c) { return c.resolved.dump(); })
      .def_readonly("notes", &Config::notes);
  m.def("parse_config",
        [](const std::string& text, const std::string& source) {
          return std::make_shared<Config>(parse_config(text, source));
        },
        py::arg("json_text"), py::arg("source") = "<config>");
}

}  // namespace zeroshard::python
