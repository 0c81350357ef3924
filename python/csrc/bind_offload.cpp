// Bindings for offload/: the NVMe I/O engine and direct-I/O files, as _C.aio (the
// zeroshard-nvme-bench command and bench/nvme.py drive the engine the runtime swaps with).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>

#include "offload/aio_engine.h"
#include "python/csrc/bindings.h"
#include "runtime/error.h"
#include "zero/swap_space.h"

namespace py = pybind11;

namespace zeroshard::python {
namespace {

// A request in flight and the buffer it reads or writes, kept alive until it is waited for.
struct Request {
  AioEngine::Handle handle;
  at::Tensor buffer;
  bool waited = false;
};

void* checked_bytes(const at::Tensor& buffer, int64_t bytes) {
  ZS_REQUIRE(buffer.device().is_cpu() && buffer.is_contiguous(), "aio: the buffer must be a contiguous CPU tensor");
  ZS_REQUIRE(int64_t(buffer.nbytes()) >= bytes, "aio: the buffer holds ", buffer.nbytes(), " bytes, the request is ",
             bytes);
  return buffer.data_ptr();
}

}  // namespace

void bind_offload(py::module_& m) {
  py::module_ aio = m.def_submodule("aio", "NVMe I/O: the engine NVMe offload reads and writes with");
  aio.attr("ALIGNMENT") = kDirectAlignment;
  aio.def("aligned_buffer", [](int64_t bytes) {
        ZS_REQUIRE(bytes > 0 && bytes % kDirectAlignment == 0, "aligned_buffer: ", bytes,
                   " bytes, expected a positive multiple of ", kDirectAlignment);
        // One alignment's slack: the CPU allocator aligns to less than a page.
        return aligned_for_direct_io(at::empty({bytes + kDirectAlignment}, at::kByte), bytes);
      }, py::arg("bytes"), "A uint8 CPU tensor of `bytes` whose data starts on a 4096-byte boundary");
  py::class_<DirectFile>(aio, "DirectFile")
      .def(py::init<const std::string&, bool>(), py::arg("path"), py::arg("create") = true)
      .def("preallocate", &DirectFile::preallocate, py::arg("bytes"))
      .def_property_readonly("path", &DirectFile::path);
  py::class_<Request>(aio, "Request")
      .def("wait", [](Request& r) {
        ZS_REQUIRE(!r.waited, "aio: this request was already waited for");
        r.waited = true;
        py::gil_scoped_release release;
        AioEngine::wait(r.handle);
      });
  py::class_<AioEngine>(aio, "AioEngine")
      .def(py::init([](int64_t block_size, int64_t queue_depth, int64_t intra_op_parallelism, bool single_submit,
                       bool overlap_events, const std::string& backend) {
             AioOptions o;
             o.block_size = block_size;
             o.queue_depth = queue_depth;
             o.intra_op_parallelism = intra_op_parallelism;
             o.single_submit = single_submit;
             o.overlap_events = overlap_events;
             o.backend = backend;
             return std::make_unique<AioEngine>(o);
           }),
           py::arg("block_size") = 1048576, py::arg("queue_depth") = 8, py::arg("intra_op_parallelism") = 1,
           py::arg("single_submit") = false, py::arg("overlap_events") = true, py::arg("backend") = "auto")
      // keep_alive: the request keeps its file open (a closed descriptor's number could be
      // reused by another file while the I/O is in flight).
      .def("read", [](AioEngine& e, const DirectFile& f, const at::Tensor& buffer, int64_t bytes, int64_t offset) {
             return Request{e.read(f, checked_bytes(buffer, bytes), bytes, offset), buffer};
           }, py::arg("file"), py::arg("buffer"), py::arg("bytes"), py::arg("offset") = 0, py::keep_alive<0, 2>())
      .def("write", [](AioEngine& e, const DirectFile& f, const at::Tensor& buffer, int64_t bytes, int64_t offset) {
             return Request{e.write(f, checked_bytes(buffer, bytes), bytes, offset), buffer};
           }, py::arg("file"), py::arg("buffer"), py::arg("bytes"), py::arg("offset") = 0, py::keep_alive<0, 2>())
      .def_property_readonly("backend", &AioEngine::backend)
      .def_property_readonly("backend_reason", &AioEngine::backend_reason);
}

}  // namespace zeroshard::python
