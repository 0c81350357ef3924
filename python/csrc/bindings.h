// Declarations of the per-folder binding functions that module.cpp calls. Each bind_*.cpp is a
// list of .def for one folder's classes and functions.
#pragma once
#include <pybind11/pybind11.h>

namespace zeroshard::python {
void bind_runtime(pybind11::module_& m);   // bind_runtime.cpp: Comm, MemoryAccount, LossScaler
void bind_config(pybind11::module_& m);    // bind_config.cpp: parse_config, Config, LR schedules
void bind_zero(pybind11::module_& m);      // bind_zero.cpp: ZeroOptimizer
void bind_kernels(pybind11::module_& m);   // bind_kernels.cpp: CPU optimizer kernels
void bind_checkpoint(pybind11::module_& m);  // bind_checkpoint.cpp: _C.checkpoint (storage)
void bind_offload(pybind11::module_& m);   // bind_offload.cpp: _C.aio (the NVMe I/O engine)
void bind_pipeline(pybind11::module_& m);  // bind_pipeline.cpp: _C.pipeline (schedules, partition)
}  // namespace zeroshard::python
