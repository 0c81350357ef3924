// zeroshard._C: the private extension module. Exceptions map to Python as ConfigError(ValueError)
// for bad user input and CommError/RuntimeError for failures.
#include <torch/csrc/utils/pybind.h>

#include "python/csrc/bindings.h"
#include "runtime/error.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "zeroshard C++ runtime (private; use the zeroshard package)";
  // Translators are tried newest first, so the base class is registered before its subclasses.
  pybind11::register_exception<zeroshard::Error>(m, "Error", PyExc_RuntimeError);
  pybind11::register_exception<zeroshard::CommError>(m, "CommError", PyExc_RuntimeError);
  pybind11::register_exception<zeroshard::ConfigError>(m, "ConfigError", PyExc_ValueError);
  zeroshard::python::bind_runtime(m);
  zeroshard::python::bind_config(m);
  zeroshard::python::bind_zero(m);
  zeroshard::python::bind_kernels(m);
}
