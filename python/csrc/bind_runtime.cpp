// Bindings for runtime/: the communicator (built from a torch ProcessGroup), memory accounting.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include "python/csrc/bindings.h"
#include "runtime/comm.h"
#include "runtime/memory.h"

namespace py = pybind11;

namespace zeroshard::python {

void bind_runtime(py::module_& m) {
  py::class_<Comm, std::shared_ptr<Comm>>(m, "Comm")
      .def(py::init([](const c10::intrusive_ptr<c10d::ProcessGroup>& group, double timeout_s) {
             return std::make_shared<Comm>(
                 group, std::chrono::milliseconds(int64_t(timeout_s * 1000.0)));
           }),
           py::arg("group"), py::arg("timeout_s") = 1800.0)
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("world_size", &Comm::world_size)
      .def_property_readonly("backend", &Comm::backend)
      .def_property_readonly("sequence", &Comm::sequence)
      .def("all_reduce", [](Comm& c, at::Tensor t, const std::string& what) { c.all_reduce(t, what).wait(); },
           py::arg("tensor"), py::arg("what") = "python", py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter",
           [](Comm& c, at::Tensor out, at::Tensor in, const std::string& what) { c.reduce_scatter(out, in, what).wait(); },
           py::arg("output"), py::arg("input"), py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      .def("all_gather",
           [](Comm& c, at::Tensor out, at::Tensor in, const std::string& what) { c.all_gather(out, in, what).wait(); },
           py::arg("output"), py::arg("input"), py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      .def("broadcast",
           [](Comm& c, at::Tensor t, int root, const std::string& what) { c.broadcast(t, root, what).wait(); },
           py::arg("tensor"), py::arg("root"), py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      .def("barrier", &Comm::barrier, py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>());

  py::class_<MemoryAccount>(m, "MemoryAccount")
      .def("bytes", [](const MemoryAccount& a) {
        py::dict d;
        for (int i = 0; i < int(MemoryCategory::count); ++i) {
          d[memory_category_name(MemoryCategory(i))] = a.bytes(MemoryCategory(i));
        }
        return d;
      })
      .def("peak_bytes", [](const MemoryAccount& a) {
        py::dict d;
        for (int i = 0; i < int(MemoryCategory::count); ++i) {
          d[memory_category_name(MemoryCategory(i))] = a.peak_bytes(MemoryCategory(i));
        }
        return d;
      })
      .def_property_readonly("total_bytes", &MemoryAccount::total_bytes)
      .def("summary", &MemoryAccount::summary);
}

}  // namespace zeroshard::python
