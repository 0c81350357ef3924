// zeroshard._C: the private extension module. runtime/error.h's family maps to Python as
// UsageError and ConfigError (ValueError) for bad input, Error, CommError and InternalError
// (RuntimeError) for failures.
#include <torch/csrc/utils/pybind.h>

#include "python/csrc/bindings.h"
#include "offload/aio_engine.h"
#include "runtime/error.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "zeroshard C++ runtime (private; use the zeroshard package)";
  // torch first: its types (at::Tensor's caster) must be registered before any binding runs,
  // also when _C is imported before anything imported torch.
  pybind11::module_::import("torch");
  // Translators are tried newest first, so the base class is registered before its subclasses.
  auto& error = pybind11::register_exception<zeroshard::Error>(m, "Error", PyExc_RuntimeError);
  pybind11::register_exception<zeroshard::CommError>(m, "CommError", error.ptr());
  pybind11::register_exception<zeroshard::InternalError>(m, "InternalError", error.ptr());
  pybind11::register_exception<zeroshard::IoError>(m, "IoError", error.ptr());
  auto& usage = pybind11::register_exception<zeroshard::UsageError>(m, "UsageError", PyExc_ValueError);
  pybind11::register_exception<zeroshard::ConfigError>(m, "ConfigError", usage.ptr());
  zeroshard::python::bind_runtime(m);
  zeroshard::python::bind_config(m);
  zeroshard::python::bind_zero(m);
  zeroshard::python::bind_kernels(m);
  zeroshard::python::bind_checkpoint(m);
  zeroshard::python::bind_offload(m);
  zeroshard::python::bind_pipeline(m);
}
