// Bindings for runtime/: the communicator (built from a torch ProcessGroup), memory accounting.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <cstdio>
#include <functional>
#include <optional>
#include <tuple>

#include "python/csrc/bindings.h"
#include "runtime/comm.h"
#include "runtime/comm_stats.h"
#include "runtime/initial_sync.h"
#include "runtime/log.h"
#include "runtime/memory.h"
#include "runtime/shard.h"
#include "runtime/trace.h"

namespace py = pybind11;

namespace zeroshard::python {
namespace {

// What a collective hands to the backend: a new TensorImpl over the caller's storage, with no
// Python object. Gloo's worker thread holds a collective's tensors until it drops the work, which
// can be after wait() returned and the caller let go (in 113 and 129 of 500 rounds of
// test_the_backend_never_holds_the_callers_tensor before this). Dropping the last reference to a
// tensor that has a Python object takes the GIL; once the interpreter has begun to exit, that ends
// the worker thread inside a noexcept frame, and the process aborts (std::terminate). The storage
// stays shared: one with a Python object of its own (untyped_storage(), torch.load) is not covered.
at::Tensor bare(const at::Tensor& t) { return t.detach(); }

// A runtime/log.h sink calling zeroshard.log.<function>; while Python is not there (not yet
// initialized, or finalizing) or the logger fails, the line goes to `fallback` instead.
std::function<void(const std::string&)> python_sink(const char* function, FILE* fallback, const char* prefix) {
  auto* target = new py::object(py::module_::import("zeroshard.log").attr(function));  // never freed
  return [target, fallback, prefix](const std::string& message) {
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing();
#else
    const bool finalizing = _Py_IsFinalizing();
#endif
    if (!Py_IsInitialized() || finalizing) {
      std::fprintf(fallback, "[zeroshard] %s%s\n", prefix, message.c_str());
      return;
    }
    py::gil_scoped_acquire gil;
    try {
      (*target)(message);
    } catch (const py::error_already_set& e) {
      std::fprintf(fallback, "[zeroshard] %s%s (the logger failed: %s)\n", prefix, message.c_str(), e.what());
    }
  };
}

// _C.trace (runtime/trace.h) and _C.comms (runtime/comm_stats.h), read by zeroshard/observe/.
void bind_observability(py::module_& m) {
  py::module_ t = m.def_submodule("trace", "the runtime's timeline (runtime/trace.h)");
  t.def("now_ns", &trace::now_ns);
  t.def("track", &trace::track);
  t.def("on", &trace::on);
  t.def("start", &trace::start, py::arg("max_events"));
  t.def("stop", &trace::stop);
  t.def("dropped", &trace::dropped);
  // [(phase, category, name, start_ns, duration_ns, track, args)], args a JSON object's members.
  t.def("drain", [] {
    std::vector<std::tuple<std::string, std::string, std::string, int64_t, int64_t, int, std::string>> out;
    for (auto& e : trace::drain())
      out.emplace_back(std::string(1, e.phase), e.category, e.name, e.start_ns, e.duration_ns, e.track, e.args);
    return out;
  });
  // Python's events (module spans, pipeline instructions, process memory) join the runtime's
  // buffer, so max_events bounds them all.
  t.def("span", [](const std::string& category, std::string name, int64_t start_ns, int64_t end_ns,
                   std::string args) { trace::span(category.c_str(), std::move(name), start_ns, end_ns, std::move(args)); },
        py::arg("category"), py::arg("name"), py::arg("start_ns"), py::arg("end_ns"), py::arg("args") = "");
  t.def("counter", &trace::counter, py::arg("name"), py::arg("args"));
  t.def("set_timing", &trace::set_timing, py::arg("on"));
  m.def("format_bytes", &format_bytes, py::arg("bytes"));  // "1.5MB", as the memory summaries
  t.def("blocked_ns", &trace::blocked_ns);

  py::module_ c = m.def_submodule("comms", "the comms logger's table (runtime/comm_stats.h)");
  c.def("configure", [](bool enabled, bool verbose, bool prof_all, bool debug,
                        std::vector<std::string> prof_ops, int rank) {
         CommStats::global().configure({enabled, verbose, prof_all, debug, std::move(prof_ops)}, rank);
       }, py::arg("enabled"), py::arg("verbose"), py::arg("prof_all"), py::arg("debug"),
       py::arg("prof_ops"), py::arg("rank"));
  c.def("enabled", [] { return CommStats::global().enabled(); });
  c.def("rows", [] {
    py::list out;
    for (const CommStatsRow& r : CommStats::global().rows()) {
      py::dict d;
      d["op"] = r.op;
      d["bytes"] = r.bytes;
      d["message_size"] = format_bytes(r.bytes);
      d["world_size"] = r.world_size;
      d["count"] = r.count;
      d["total_ms"] = r.total_ms;
      d["min_ms"] = r.min_ms;
      d["max_ms"] = r.max_ms;
      d["algbw_gbps"] = r.algbw_gbps();
      d["busbw_gbps"] = r.busbw_gbps();
      out.append(d);
    }
    return out;
  });
  c.def("reset", [] { CommStats::global().reset(); });
}

}  // namespace

void bind_runtime(py::module_& m) {
  // A send or receive in flight (Comm.isend / Comm.irecv, the pipeline's transfers): wait()
  // returns when it is done and raises the CommError naming every rank when it failed or timed
  // out; a second wait() returns at once.
  py::class_<CommWork, std::shared_ptr<CommWork>>(m, "CommWork")
      .def("wait", &CommWork::wait, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("pending", &CommWork::pending)
      .def_property_readonly("completed", &CommWork::completed)
      .def_property_readonly("description", &CommWork::description);
  py::class_<Comm, std::shared_ptr<Comm>>(m, "Comm")
      // store: the group's c10d Store (dist.distributed_c10d._get_default_store() for WORLD), so
      // that errors name every rank's collective. debug_collectives: None reads
      // ZEROSHARD_DEBUG_COLLECTIVES; True checks on every collective that all ranks issue the same.
      .def(py::init([](const c10::intrusive_ptr<c10d::ProcessGroup>& group, double timeout_s,
                       const py::object& store, const py::object& debug_collectives) {
             c10::intrusive_ptr<c10d::Store> s;
             if (!store.is_none()) s = store.cast<c10::intrusive_ptr<c10d::Store>>();
             std::optional<bool> check;
             if (!debug_collectives.is_none()) check = debug_collectives.cast<bool>();
             // Dropped without the GIL: the group's destructor waits for Gloo's worker threads,
             // which may need the GIL to free the last tensors of a finished collective.
             return std::shared_ptr<Comm>(
                 new Comm(group, std::chrono::milliseconds(int64_t(timeout_s * 1000.0)), s, check),
                 [](Comm* c) {
                   if (PyGILState_Check()) {
                     py::gil_scoped_release no_gil;
                     delete c;
                   } else {
                     delete c;
                   }
                 });
           }),
           py::arg("group"), py::arg("timeout_s") = 1800.0, py::arg("store") = py::none(),
           py::arg("debug_collectives") = py::none())
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("world_size", &Comm::world_size)
      .def_property_readonly("backend", &Comm::backend)
      .def_property_readonly("sequence", &Comm::sequence)
      .def_property_readonly("checks_agreement", &Comm::checks_agreement)
      .def("recent_collectives", [](const Comm& c) { return c.recorder().summary(); })
      // Python's tensors reach the backend through bare(): see there.
      .def("all_reduce",
           [](Comm& c, const at::Tensor& t, const std::string& what) { c.all_reduce(bare(t), what).wait(); },
           py::arg("tensor"), py::arg("what") = "python", py::call_guard<py::gil_scoped_release>())
      // Sums a few numbers over ranks (the progress line's loss) in a tensor made here.
      .def("all_reduce_values",
           [](Comm& c, const std::vector<double>& values, const std::string& device, const std::string& what) {
             at::Tensor t = at::tensor(values, at::kDouble).to(at::Device(device));
             c.all_reduce(t, what).wait();
             t = t.cpu();
             return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
           },
           py::arg("values"), py::arg("device"), py::arg("what"), py::call_guard<py::gil_scoped_release>())
      .def("all_reduce_max",
           [](Comm& c, const at::Tensor& t, const std::string& what) { c.all_reduce_max(bare(t), what).wait(); },
           py::arg("tensor"), py::arg("what") = "python", py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter",
           [](Comm& c, const at::Tensor& out, const at::Tensor& in, const std::string& what) {
             c.reduce_scatter(bare(out), bare(in), what).wait();
           },
           py::arg("output"), py::arg("input"), py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter_in_place",
           [](Comm& c, const at::Tensor& buffer, const std::string& what) {
             c.reduce_scatter_in_place(bare(buffer), what).wait();
           },
           py::arg("buffer"), py::arg("what") = "python", py::call_guard<py::gil_scoped_release>())
      .def("all_gather",
           [](Comm& c, const at::Tensor& out, const at::Tensor& in, const std::string& what) {
             c.all_gather(bare(out), bare(in), what).wait();
           },
           py::arg("output"), py::arg("input"), py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      .def("broadcast",
           [](Comm& c, const at::Tensor& t, int root, const std::string& what) {
             c.broadcast(bare(t), root, what).wait();
           },
           py::arg("tensor"), py::arg("root"), py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      .def("send",
           [](Comm& c, const at::Tensor& t, int dst, int tag, const std::string& what) {
             c.send(bare(t), dst, tag, what).wait();
           },
           py::arg("tensor"), py::arg("dst"), py::arg("tag") = 0, py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      .def("recv",
           [](Comm& c, const at::Tensor& t, int src, int tag, const std::string& what) {
             c.recv(bare(t), src, tag, what).wait();
           },
           py::arg("tensor"), py::arg("src"), py::arg("tag") = 0, py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      // The same, returning at once: the transfer runs on the backend's own thread while the
      // caller computes. The caller keeps the tensor unchanged (and alive) until wait().
      .def("isend",
           [](Comm& c, const at::Tensor& t, int dst, int tag, const std::string& what) {
             return std::make_shared<CommWork>(c.send(bare(t), dst, tag, what));
           },
           py::arg("tensor"), py::arg("dst"), py::arg("tag") = 0, py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      .def("irecv",
           [](Comm& c, const at::Tensor& t, int src, int tag, const std::string& what) {
             return std::make_shared<CommWork>(c.recv(bare(t), src, tag, what));
           },
           py::arg("tensor"), py::arg("src"), py::arg("tag") = 0, py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      .def("fail_here", &Comm::fail_here, py::arg("what"), py::arg("cause"),
           py::call_guard<py::gil_scoped_release>())
      .def("barrier", &Comm::barrier, py::arg("what") = "python",
           py::call_guard<py::gil_scoped_release>())
      .def("follow_aborts_of", &Comm::follow_aborts_of, py::arg("world"));

  // runtime/log.h's warnings and information go to zeroshard.log's runtime_warning and
  // runtime_info, kept for the life of the process: the C++ side may speak from any thread.
  set_warning_sink(python_sink("runtime_warning", stderr, "warning: "));
  set_info_sink(python_sink("runtime_info", stdout, ""));
  auto* draw = new py::object(py::module_::import("zeroshard.log").attr("runtime_progress"));  // never freed
  set_progress_sink([draw](const std::string& what, int64_t done, int64_t total) {
    if (!Py_IsInitialized()) return;
    py::gil_scoped_acquire gil;
    try {
      (*draw)(what, done, total);
    } catch (const py::error_already_set&) {
      // A bar that cannot draw is no reason to stop the work it reports on.
    }
  });
  bind_observability(m);
  // zeroshard.log clears the sinks at exit (atexit), before the interpreter starts finalizing.
  m.def("clear_warning_sink", [] {
    set_warning_sink(nullptr);
    set_info_sink(nullptr);
    set_progress_sink(nullptr);
  });
  // One tensor's ZeRO-3 chunk (runtime/shard.h), for zero.Init: (chunk_numel, held_numel), the
  // elements rank holds of it being [rank * chunk_numel, rank * chunk_numel + held_numel).
  m.def("zero3_chunk", [](int64_t numel, int64_t world_size, int64_t rank) {
        const ChunkLayout layout = make_chunk_layout({numel}, world_size);
        return std::make_pair(layout.chunks[0], layout.held_numel(0, rank));
      }, py::arg("numel"), py::arg("world_size"), py::arg("rank"));
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
      .def("reset_peaks", &MemoryAccount::reset_peaks)
      .def("trace_sample", &MemoryAccount::trace_sample)
      .def_property_readonly("peak_total_bytes", &MemoryAccount::peak_total_bytes)
      .def_property_readonly("total_bytes", &MemoryAccount::total_bytes)
      .def_property_readonly("host_total_bytes", &MemoryAccount::host_total_bytes)
      .def("summary", &MemoryAccount::summary);

  // The start of a run (runtime/initial_sync.h): the engine's buffers and frozen parameters.
  m.def("broadcast_from_rank0",
        [](const std::shared_ptr<Comm>& comm, const std::vector<at::Tensor>& tensors,
           const std::vector<std::string>& names, const std::string& label, int64_t bucket_numel) {
          broadcast_from_rank0(*comm, tensors, names, label, bucket_numel);
        },
        py::arg("comm"), py::arg("tensors"), py::arg("names"), py::arg("label"),
        py::arg("bucket_numel") = 0,
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace zeroshard::python
