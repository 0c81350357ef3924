// The checkpoint manifest (manifest.h): building it from each rank's writes, merging, the JSON
// form with its field checks, the tiling check, and the read plan for any global element range.
#include "runtime/checkpoint/manifest.h"

#include <algorithm>

#include "runtime/checkpoint/crc32c.h"
#include "runtime/error.h"

namespace zeroshard::checkpoint {
namespace {

using nlohmann::json;

constexpr const char* kFormatName = "zeroshard checkpoint";

std::string json_quote(const std::string& text) { return json(text).dump(); }

// JSON built in memory holds signed integers, JSON parsed from text unsigned ones.
bool is_count(const json& v) { return v.is_number_integer() && v.get<int64_t>() >= 0; }

std::string range_text(int64_t begin, int64_t end) { return detail::cat("[", begin, ", ", end, ")"); }

// A file name inside the checkpoint directory: relative, no "..", so a manifest cannot point
// a load outside its directory.
bool is_inside_name(const std::string& name) {
  if (name.empty()) return false;
  const fs::path path(name);
  if (path.is_absolute()) return false;
  for (const auto& part : path)
    if (part == ".." || part == ".") return false;
  return true;
}

// Collects every missing or mistyped field of a manifest, so one error names them all.
struct FieldReader {
  std::vector<std::string> missing;
  std::vector<std::string> bad;

  const json* field(const json& object, const char* key, const std::string& where) {
    const std::string path = where.empty() ? key : where + "." + key;
    if (!object.is_object() || !object.contains(key)) {
      missing.push_back(path);
      return nullptr;
    }
    return &object[key];
  }
  void mistyped(const std::string& where, const char* key, const json& value, const char* expected) {
    bad.push_back(detail::cat(where.empty() ? "" : where + ".", key, ": got ", value.dump(), ", expected ", expected));
  }
  std::string text(const json& object, const char* key, const std::string& where) {
    const json* v = field(object, key, where);
    if (v == nullptr) return {};
    if (!v->is_string()) {
      mistyped(where, key, *v, "a string");
      return {};
    }
    return v->get<std::string>();
  }
  int64_t count(const json& object, const char* key, const std::string& where) {
    const json* v = field(object, key, where);
    if (v == nullptr) return 0;
    if (!is_count(*v)) {
      mistyped(where, key, *v, "an integer >= 0");
      return 0;
    }
    return v->get<int64_t>();
  }
  uint32_t crc(const json& object, const char* key, const std::string& where) {
    const json* v = field(object, key, where);
    if (v == nullptr) return 0;
    const auto value = v->is_string() ? crc32c_from_hex(v->get<std::string>()) : std::nullopt;
    if (!value) mistyped(where, key, *v, "8 hex digits");
    return value.value_or(0);
  }
  std::vector<int64_t> shape(const json& object, const char* key, const std::string& where) {
    const json* v = field(object, key, where);
    std::vector<int64_t> out;
    if (v == nullptr) return out;
    const bool ok = v->is_array() && std::all_of(v->begin(), v->end(), [](const json& d) { return is_count(d); });
    if (!ok) {
      mistyped(where, key, *v, "a list of integers >= 0");
      return out;
    }
    int64_t numel = 1;  // a hostile manifest must not overflow the tiling check
    for (const json& d : *v) {
      out.push_back(d.get<int64_t>());
      if (__builtin_mul_overflow(numel, out.back(), &numel) || numel > (int64_t(1) << 60)) {
        mistyped(where, key, *v, "a shape of at most 2^60 elements");
        return {};
      }
    }
    return out;
  }
  const json* list(const json& object, const char* key, const std::string& where) {
    const json* v = field(object, key, where);
    if (v != nullptr && !v->is_array()) {
      mistyped(where, key, *v, "a list");
      return nullptr;
    }
    return v;
  }
};

}  // namespace

int64_t TensorRecord::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool ReadStep::operator==(const ReadStep& o) const {
  return file == o.file && key == o.key && file_begin == o.file_begin && file_end == o.file_end &&
         dest_offset == o.dest_offset;
}

TensorRecord* Manifest::find(const std::string& name) {
  for (auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

void Manifest::add_file(const std::string& file, const FileChecksums& sums) {
  ZS_REQUIRE(is_inside_name(file), "checkpoint manifest: file name ", json_quote(file),
             " must be relative to the checkpoint directory, without \".\" or \"..\"");
  for (const auto& f : files_)
    ZS_REQUIRE(f.name != file, "checkpoint manifest: file ", json_quote(file), " is added twice");
  files_.push_back({file, sums.file_bytes, sums.file_crc32c});
  key_crc32c_[file] = sums.tensor_crc32c;
  validated_ = false;
}

void Manifest::add_piece(const std::string& name, const std::vector<int64_t>& shape, const std::string& dtype,
                         const std::string& file, const std::string& key, int64_t begin, int64_t end) {
  const auto written = key_crc32c_.find(file);
  ZS_REQUIRE(written != key_crc32c_.end(), "checkpoint manifest: tensor ", json_quote(name), ": file ",
             json_quote(file), " must be added (add_file) before its pieces");
  const auto key_crc = written->second.find(key);
  ZS_REQUIRE(key_crc != written->second.end(), "checkpoint manifest: tensor ", json_quote(name), ": file ",
             json_quote(file), " has no key ", json_quote(key));
  dtype_element_bytes(dtype);
  TensorRecord* record = find(name);
  if (record == nullptr) {
    tensors_.push_back({name, shape, dtype, {}});
    record = &tensors_.back();
  }
  ZS_REQUIRE(record->shape == shape && record->dtype == dtype, "checkpoint manifest: tensor ", json_quote(name),
             " is ", record->dtype, " ", json(record->shape).dump(), " in one piece and ", dtype, " ",
             json(shape).dump(), " in another");
  record->pieces.push_back({file, key, begin, end, key_crc->second});
  validated_ = false;
}

void Manifest::set_section(const std::string& name, json value) {
  sections_[name] = std::move(value);
}

void Manifest::merge(const Manifest& other) {
  for (const auto& f : other.files_) {
    for (const auto& mine : files_)
      ZS_REQUIRE(mine.name != f.name, "checkpoint manifest: file ", json_quote(f.name), " is written twice");
    files_.push_back(f);
  }
  for (const auto& [file, keys] : other.key_crc32c_) key_crc32c_[file] = keys;
  for (const auto& t : other.tensors_) {
    TensorRecord* record = find(t.name);
    if (record == nullptr) {
      tensors_.push_back(t);
      continue;
    }
    ZS_REQUIRE(record->shape == t.shape && record->dtype == t.dtype, "checkpoint manifest: tensor ",
               json_quote(t.name), " is ", record->dtype, " ", json(record->shape).dump(), " on one rank and ",
               t.dtype, " ", json(t.shape).dump(), " on another");
    record->pieces.insert(record->pieces.end(), t.pieces.begin(), t.pieces.end());
  }
  for (const auto& [name, value] : other.sections_) {
    const auto mine = sections_.find(name);
    ZS_REQUIRE(mine == sections_.end() || mine->second == value, "checkpoint manifest: section ",
               json_quote(name), " differs between ranks");
    sections_[name] = value;
  }
  validated_ = false;
}

void Manifest::validate_complete(const std::string& source) {
  const std::string prefix = "checkpoint manifest " + source + ": ";
  for (auto& t : tensors_) {
    const std::string where = prefix + "tensor " + json_quote(t.name);
    const int64_t numel = t.numel();
    for (const auto& p : t.pieces) {
      const bool listed = std::any_of(files_.begin(), files_.end(), [&](const FileRecord& f) { return f.name == p.file; });
      if (!listed) throw Error(where + ": a piece is in file " + json_quote(p.file) + ", which the manifest does not list");
      if (p.begin < 0 || p.begin > p.end || p.end > numel)
        throw Error(where + ": piece " + range_text(p.begin, p.end) + " (" + p.file + ") is outside [0, " +
                    std::to_string(numel) + ")");
    }
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const Piece& a, const Piece& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
    int64_t covered = 0;  // [0, covered) is tiled so far
    const Piece* last = nullptr;
    for (const auto& p : t.pieces) {
      if (p.begin == p.end) continue;  // an empty piece holds nothing
      if (p.begin > covered)
        throw Error(where + ": its pieces leave elements " + range_text(covered, p.begin) + " uncovered (of [0, " +
                    std::to_string(numel) + "))");
      if (p.begin < covered)
        throw Error(where + ": elements " + range_text(p.begin, std::min(covered, p.end)) +
                    " are in two pieces (" + last->file + " key " + json_quote(last->key) + " and " + p.file +
                    " key " + json_quote(p.key) + ")");
      covered = p.end;
      last = &p;
    }
    if (covered != numel)
      throw Error(where + ": its pieces leave elements " + range_text(covered, numel) + " uncovered (of [0, " +
                  std::to_string(numel) + "))");
  }
  source_ = source;
  validated_ = true;
}

const TensorRecord& Manifest::tensor(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return t;
  throw Error("checkpoint manifest " + source_ + ": no tensor " + json_quote(name));
}

bool Manifest::has_tensor(const std::string& name) const {
  return std::any_of(tensors_.begin(), tensors_.end(), [&](const TensorRecord& t) { return t.name == name; });
}

const json& Manifest::section(const std::string& name) const {
  const auto it = sections_.find(name);
  if (it == sections_.end()) throw Error("checkpoint manifest " + source_ + ": no section " + json_quote(name));
  return it->second;
}

FileChecksums Manifest::file_checksums(const std::string& file) const {
  FileChecksums sums;
  bool found = false;
  for (const auto& f : files_) {
    if (f.name != file) continue;
    sums.file_bytes = f.bytes;
    sums.file_crc32c = f.crc32c;
    found = true;
  }
  if (!found) throw Error("checkpoint manifest " + source_ + ": no file " + json_quote(file));
  for (const auto& t : tensors_)
    for (const auto& p : t.pieces)
      if (p.file == file) sums.tensor_crc32c[p.key] = p.crc32c;
  return sums;
}

std::vector<ReadStep> Manifest::plan_read(const std::string& name, int64_t begin, int64_t end) const {
  ZS_REQUIRE(validated_, "checkpoint manifest: plan_read before validate_complete()");
  const TensorRecord& t = tensor(name);
  ZS_REQUIRE(0 <= begin && begin <= end && end <= t.numel(), "checkpoint tensor ", json_quote(name), ": elements ",
             range_text(begin, end), " are outside [0, ", t.numel(), ")");
  std::vector<ReadStep> steps;
  for (const auto& p : t.pieces) {  // sorted by begin, tiling [0, numel)
    const int64_t from = std::max(begin, p.begin);
    const int64_t to = std::min(end, p.end);
    if (from >= to) continue;
    steps.push_back({p.file, p.key, from - p.begin, to - p.begin, from - begin});
  }
  return steps;
}

json Manifest::to_json() const {
  json files = json::array();
  for (const auto& f : files_) files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"crc32c", crc32c_to_hex(f.crc32c)}});
  json tensors = json::array();
  for (const auto& t : tensors_) {
    json pieces = json::array();
    for (const auto& p : t.pieces)
      pieces.push_back({{"file", p.file}, {"key", p.key}, {"begin", p.begin}, {"end", p.end},
                        {"crc32c", crc32c_to_hex(p.crc32c)}});
    tensors.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", t.dtype}, {"pieces", std::move(pieces)}});
  }
  json sections = json::object();
  for (const auto& [name, value] : sections_) sections[name] = value;
  return {{"format", kFormatName}, {"format_version", kManifestFormatVersion}, {"files", std::move(files)},
          {"tensors", std::move(tensors)}, {"sections", std::move(sections)}};
}

Manifest Manifest::parse(const json& j, const std::string& source) {
  const std::string prefix = "checkpoint manifest " + source + ": ";
  if (!j.is_object()) throw Error(prefix + "expected a JSON object, got " + std::string(j.type_name()));
  if (!j.contains("format_version") || !j["format_version"].is_number_integer())
    throw Error(prefix + "no format_version: this is not a zeroshard checkpoint manifest");
  const int64_t version = j["format_version"].get<int64_t>();
  if (version > kManifestFormatVersion)
    throw Error(detail::cat(prefix, "format version ", version, " is newer than this build of zeroshard reads (",
                            "version ", kManifestFormatVersion, " and older); upgrade zeroshard to load it"));
  if (version < 1) throw Error(detail::cat(prefix, "format version ", version, " is invalid (versions start at 1)"));

  FieldReader r;
  Manifest m;
  const std::string format = r.text(j, "format", "");
  if (r.missing.empty() && r.bad.empty() && format != kFormatName)
    r.bad.push_back("format: got " + json_quote(format) + ", expected " + json_quote(kFormatName));
  if (const json* files = r.list(j, "files", "")) {
    for (size_t i = 0; i < files->size(); ++i) {
      const json& f = (*files)[i];
      const std::string where = detail::cat("files[", i, "]");
      FileRecord record{r.text(f, "name", where), uint64_t(r.count(f, "bytes", where)), r.crc(f, "crc32c", where)};
      m.files_.push_back(std::move(record));
    }
  }
  if (const json* tensors = r.list(j, "tensors", "")) {
    for (size_t i = 0; i < tensors->size(); ++i) {
      const json& t = (*tensors)[i];
      std::string where = detail::cat("tensors[", i, "]");
      TensorRecord record;
      record.name = r.text(t, "name", where);
      if (!record.name.empty()) where += " (" + json_quote(record.name) + ")";
      record.shape = r.shape(t, "shape", where);
      record.dtype = r.text(t, "dtype", where);
      if (!record.dtype.empty() && !is_safetensors_dtype(record.dtype))
        r.bad.push_back(where + ".dtype: got " + json_quote(record.dtype) + ", expected a safetensors dtype");
      if (const json* pieces = r.list(t, "pieces", where)) {
        for (size_t k = 0; k < pieces->size(); ++k) {
          const json& p = (*pieces)[k];
          const std::string at = detail::cat(where, ".pieces[", k, "]");
          record.pieces.push_back({r.text(p, "file", at), r.text(p, "key", at), r.count(p, "begin", at),
                                   r.count(p, "end", at), r.crc(p, "crc32c", at)});
        }
      }
      m.tensors_.push_back(std::move(record));
    }
  }
  if (const json* sections = r.field(j, "sections", "")) {
    if (!sections->is_object()) r.mistyped("", "sections", *sections, "an object");
    else
      for (const auto& [name, value] : sections->items()) m.sections_[name] = value;
  }
  if (!r.missing.empty() || !r.bad.empty()) {
    std::string message = prefix;
    auto join = [](const std::vector<std::string>& items) {
      std::string out;
      for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
      return out;
    };
    if (!r.missing.empty()) message += "missing fields: " + join(r.missing);
    if (!r.bad.empty()) message += std::string(r.missing.empty() ? "" : "; ") + "bad fields: " + join(r.bad);
    throw Error(message);
  }
  for (size_t i = 0; i < m.files_.size(); ++i) {
    const std::string& name = m.files_[i].name;
    if (!is_inside_name(name))
      throw Error(prefix + "file " + json_quote(name) + " is not a name inside the checkpoint directory");
    for (size_t k = 0; k < i; ++k)
      if (m.files_[k].name == name) throw Error(prefix + "file " + json_quote(name) + " is listed twice");
  }
  for (size_t i = 0; i < m.tensors_.size(); ++i)
    for (size_t k = 0; k < i; ++k)
      if (m.tensors_[k].name == m.tensors_[i].name)
        throw Error(prefix + "tensor " + json_quote(m.tensors_[i].name) + " is listed twice");
  m.source_ = source;
  return m;
}

void Manifest::save(const fs::path& path) const {
  ZS_REQUIRE(validated_, "checkpoint manifest: save before validate_complete()");
  write_file_durably(path, to_json().dump(1) + "\n");
}

Manifest Manifest::load(const fs::path& path) {
  const std::string text = read_small_file(path);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error("checkpoint manifest " + path.string() + " is not valid JSON (" + e.what() +
                "): the file is damaged");
  }
  Manifest m = parse(j, path.string());
  m.validate_complete(path.string());
  return m;
}

}  // namespace zeroshard::checkpoint
