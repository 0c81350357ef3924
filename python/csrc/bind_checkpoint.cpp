// Bindings for runtime/checkpoint/: the staged directory, the manifest, a rank's shard file and
// the reader, as _C.checkpoint. JSON crosses as text through Python's json module.
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "python/csrc/bindings.h"
#include "runtime/checkpoint/atomic_dir.h"
#include "runtime/checkpoint/file_io.h"
#include "runtime/checkpoint/manifest.h"
#include "runtime/checkpoint/shard_io.h"
#include "runtime/error.h"

namespace py = pybind11;

namespace zeroshard::python {
namespace {

using namespace zeroshard::checkpoint;

py::object to_python(const nlohmann::json& j) { return py::module_::import("json").attr("loads")(j.dump()); }

nlohmann::json from_python(const py::object& value, const std::string& what) {
  py::object text;
  try {
    text = py::module_::import("json").attr("dumps")(value, py::arg("allow_nan") = false);
  } catch (py::error_already_set& e) {
    throw UsageError(what + ": not JSON-serialisable (" + std::string(py::str(e.value())) + ")");
  }
  return nlohmann::json::parse(text.cast<std::string>());
}

}  // namespace

void bind_checkpoint(py::module_& parent) {
  py::module_ m = parent.def_submodule("checkpoint", "checkpoint storage (runtime/checkpoint/)");
  m.def("validate_tag", &validate_tag, py::arg("tag"));
  m.def("read_latest", [](const std::string& dir) { return read_latest(dir); }, py::arg("load_dir"));
  m.def("find_checkpoint_dir",
        [](const std::string& dir, const std::string& tag) -> std::optional<std::string> {
          auto found = find_checkpoint_dir(dir, tag);
          if (!found) return std::nullopt;
          return found->string();
        },
        py::arg("load_dir"), py::arg("tag"));
  m.def("write_file_durably", [](const std::string& path, const std::string& text) { write_file_durably(path, text); },
        py::arg("path"), py::arg("text"), "a new file, fsync'd; a full disk names the path and the bytes");
  m.def("safetensors_dtypes", [] {
    py::dict out;
    for (const auto& [name, type] : safetensors_dtypes()) out[py::str(name)] = type;
    return out;
  }, "safetensors dtype name -> torch dtype, for every dtype checkpoints store");
  m.attr("MANIFEST") = kManifestFileName;
  m.attr("FORMAT_VERSION") = kManifestFormatVersion;

  py::class_<StagedCheckpoint>(m, "StagedCheckpoint")
      .def_static("create", [](const std::string& dir, const std::string& tag) {
        return std::make_unique<StagedCheckpoint>(StagedCheckpoint::create(dir, tag));
      }, py::arg("save_dir"), py::arg("tag"))
      .def_static("attach", [](const std::string& dir, const std::string& tag, const std::string& name) {
        return std::make_unique<StagedCheckpoint>(StagedCheckpoint::attach(dir, tag, name));
      }, py::arg("save_dir"), py::arg("tag"), py::arg("temp_name"))
      .def_property_readonly("temp_name", &StagedCheckpoint::temp_name)
      .def_property_readonly("temp_dir", [](const StagedCheckpoint& s) { return s.temp_dir().string(); })
      .def_property_readonly("final_dir", [](const StagedCheckpoint& s) { return s.final_dir().string(); })
      .def("file", [](const StagedCheckpoint& s, const std::string& name) { return s.file(name).string(); })
      .def("release", &StagedCheckpoint::release)
      .def("commit", &StagedCheckpoint::commit, py::arg("save_latest") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("abort", &StagedCheckpoint::abort);

  py::class_<Manifest>(m, "Manifest")
      .def(py::init<>())
      .def_static("parse", [](const std::string& text, const std::string& source) {
        return Manifest::parse(nlohmann::json::parse(text), source);
      }, py::arg("text"), py::arg("source"))
      .def_static("load", [](const std::string& path) { return Manifest::load(path); }, py::arg("path"))
      .def("to_json", [](const Manifest& mf) { return mf.to_json().dump(); })
      .def("merge", &Manifest::merge, py::arg("other"))
      .def("set_section", [](Manifest& mf, const std::string& name, const py::object& value) {
        mf.set_section(name, from_python(value, "checkpoint section \"" + name + "\""));
      }, py::arg("name"), py::arg("value"))
      .def("section", [](const Manifest& mf, const std::string& name) { return to_python(mf.section(name)); })
      .def("has_section", &Manifest::has_section)
      .def("has_tensor", &Manifest::has_tensor)
      .def("tensors", [](const Manifest& mf) {
        py::list out;
        for (const auto& t : mf.tensors()) out.append(py::make_tuple(t.name, t.shape, t.dtype));
        return out;
      })
      .def("files", [](const Manifest& mf) {
        py::list out;
        for (const auto& f : mf.files()) out.append(py::make_tuple(f.name, f.bytes));
        return out;
      })
      .def("validate_complete", &Manifest::validate_complete, py::arg("source") = "manifest")
      .def("save", [](const Manifest& mf, const std::string& path) { mf.save(path); }, py::arg("path"));

  m.def("write_shard_file",
        [](const std::string& path, const std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t,
                                                                 at::Tensor>>& items) {
          std::vector<SaveItem> v;
          v.reserve(items.size());
          for (const auto& [name, shape, begin, values] : items) v.push_back({name, shape, begin, values});
          py::gil_scoped_release release;
          return write_shard_file(path, v);
        },
        py::arg("path"), py::arg("items"),
        "items: (name, global shape, first element, 1-D values); returns the file's manifest");

  py::class_<CheckpointReader>(m, "CheckpointReader")
      .def(py::init([](const std::string& dir, bool verify_before_writing) {
             return std::make_unique<CheckpointReader>(dir, verify_before_writing);
           }),
           py::arg("dir"), py::arg("verify_before_writing") = true)
      .def("open_all", &CheckpointReader::open_all)
      .def_property_readonly("manifest", &CheckpointReader::manifest, py::return_value_policy::reference_internal)
      .def("read", &CheckpointReader::read, py::arg("name"), py::arg("begin"), py::arg("out"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("bytes_read", &CheckpointReader::bytes_read);
}

}  // namespace zeroshard::python
