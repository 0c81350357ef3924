// The safetensors format (safetensors.h): header building and parsing, the streaming writer with
// its checksums, pread-based reads of whole tensors and element ranges, and verification.
#include "runtime/checkpoint/safetensors.h"

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>

#include "runtime/checkpoint/crc32c.h"
#include "runtime/error.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this build writes host memory as it is"
#endif

namespace zeroshard::checkpoint {
namespace {

using nlohmann::json;

struct DtypeInfo {
  const char* name;
  uint64_t bytes;
  at::ScalarType scalar_type;
};
constexpr DtypeInfo kDtypes[] = {
    {"BOOL", 1, at::kBool},      {"U8", 1, at::kByte},          {"I8", 1, at::kChar},
    {"I16", 2, at::kShort},      {"U16", 2, at::kUInt16},       {"I32", 4, at::kInt},
    {"U32", 4, at::kUInt32},     {"I64", 8, at::kLong},         {"U64", 8, at::kUInt64},
    {"F16", 2, at::kHalf},       {"BF16", 2, at::kBFloat16},    {"F32", 4, at::kFloat},
    {"F64", 8, at::kDouble},     {"F8_E4M3", 1, at::kFloat8_e4m3fn},
    {"F8_E5M2", 1, at::kFloat8_e5m2}, {"C64", 8, at::kComplexFloat},
};
constexpr uint64_t kMaxHeaderBytes = uint64_t(100) << 20;  // the limit safetensors itself enforces
constexpr uint64_t kChunkBytes = uint64_t(4) << 20;       // read-back chunk for checksums

const DtypeInfo* find_dtype(const std::string& name) {
  for (const auto& d : kDtypes)
    if (name == d.name) return &d;
  return nullptr;
}

}  // namespace

std::vector<std::pair<std::string, c10::ScalarType>> safetensors_dtypes() {
  std::vector<std::pair<std::string, c10::ScalarType>> out;
  for (const auto& d : kDtypes) out.emplace_back(d.name, d.scalar_type);
  return out;
}

namespace {

std::string known_dtypes() {
  std::string out;
  for (const auto& d : kDtypes) out += std::string(out.empty() ? "" : ", ") + d.name;
  return out;
}

bool is_count(const json& v) { return v.is_number_integer() && v.get<int64_t>() >= 0; }

std::string shape_text(const std::vector<int64_t>& shape) { return json(shape).dump(); }

std::string json_quote(const std::string& name) { return json(name).dump(); }

void validate_specs(const std::vector<TensorSpec>& specs, const fs::path& path) {
  std::vector<std::string> names;
  for (const auto& s : specs) {
    ZS_REQUIRE(!s.name.empty(), "safetensors ", path.string(), ": a tensor has an empty name");
    ZS_REQUIRE(s.name != "__metadata__", "safetensors ", path.string(),
               ": \"__metadata__\" is reserved for the metadata and cannot name a tensor");
    dtype_element_bytes(s.dtype);
    for (int64_t d : s.shape)
      ZS_REQUIRE(d >= 0, "safetensors ", path.string(), ": tensor ", json_quote(s.name), " has shape ",
                 shape_text(s.shape), ": dimensions must be >= 0");
    names.push_back(s.name);
  }
  std::sort(names.begin(), names.end());
  const auto dup = std::adjacent_find(names.begin(), names.end());
  ZS_REQUIRE(dup == names.end(), "safetensors ", path.string(), ": tensor ", json_quote(*dup),
             " appears twice");
}

// The header text, spaces appended so that the data starts at a multiple of 8.
std::string header_text(const std::vector<TensorSpec>& specs, const Metadata& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& s : specs) {
    const uint64_t end = offset + s.num_bytes();
    header[s.name] = {{"dtype", s.dtype}, {"shape", s.shape}, {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    throw UsageError(std::string("safetensors: tensor names and metadata must be UTF-8: ") + e.what());
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

uint64_t data_bytes(const std::vector<TensorSpec>& specs) {
  uint64_t total = 0;
  for (const auto& s : specs) total += s.num_bytes();
  return total;
}

[[noreturn]] void bad_file(const fs::path& path, const std::string& what) {
  throw Error("checkpoint: " + path.string() + " is not a valid safetensors file: " + what);
}

}  // namespace

bool is_safetensors_dtype(const std::string& dtype) { return find_dtype(dtype) != nullptr; }

uint64_t dtype_element_bytes(const std::string& dtype) {
  const DtypeInfo* d = find_dtype(dtype);
  ZS_REQUIRE(d != nullptr, "safetensors dtype ", json_quote(dtype), " is not one of ", known_dtypes());
  return d->bytes;
}

c10::ScalarType scalar_type_of(const std::string& dtype) {
  const DtypeInfo* d = find_dtype(dtype);
  ZS_REQUIRE(d != nullptr, "safetensors dtype ", json_quote(dtype), " is not one of ", known_dtypes());
  return d->scalar_type;
}

std::string dtype_of(const at::Tensor& tensor) {
  for (const auto& d : kDtypes)
    if (tensor.scalar_type() == d.scalar_type) return d.name;
  throw UsageError(std::string("safetensors: tensors of dtype ") + c10::toString(tensor.scalar_type()) +
                   " cannot be stored; the format holds " + known_dtypes());
}

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

TensorSpec spec_of(const std::string& name, const at::Tensor& tensor) {
  return {name, dtype_of(tensor), tensor.sizes().vec()};
}

const TensorEntry* SafetensorsHeader::find(const std::string& name) const {
  for (const auto& e : tensors)
    if (e.spec.name == name) return &e;
  return nullptr;
}

uint64_t safetensors_file_bytes(const std::vector<TensorSpec>& specs, const Metadata& metadata) {
  validate_specs(specs, "(size estimate)");
  return 8 + header_text(specs, metadata).size() + data_bytes(specs);
}

// ---------------------------------------------------------------------------------------------
// Writing

namespace {
std::string validated_header(const std::vector<TensorSpec>& specs, const Metadata& metadata,
                             const fs::path& path) {
  validate_specs(specs, path);
  return header_text(specs, metadata);
}
}  // namespace

// Members initialize in declaration order: specs_, header_, file_bytes_, then file_ (reserved).
SafetensorsWriter::SafetensorsWriter(const fs::path& path, std::vector<TensorSpec> specs,
                                     const Metadata& metadata)
    : specs_(std::move(specs)),
      header_(validated_header(specs_, metadata, path)),
      file_bytes_(8 + header_.size() + data_bytes(specs_)),
      file_(path, file_bytes_) {
  unsigned char length[8];
  const uint64_t n = header_.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(n >> (8 * i));
  file_.write(length, 8);
  file_.write(header_.data(), n);
  sums_.file_crc32c = crc32c_extend(crc32c(length, 8), header_.data(), n);
  header_ = std::string();
  skip_empty_tensors();
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::skip_empty_tensors() {
  // A finished tensor (or one with no bytes) records its checksum and gives way to the next.
  while (current_ < specs_.size() && current_written_ == specs_[current_].num_bytes()) {
    sums_.tensor_crc32c[specs_[current_].name] = current_crc_;
    ++current_;
    current_written_ = 0;
    current_crc_ = 0;
  }
}

void SafetensorsWriter::append_bytes(const void* data, uint64_t num_bytes) {
  const char* bytes = static_cast<const char*>(data);
  while (num_bytes > 0) {
    ZS_REQUIRE(current_ < specs_.size(), "safetensors ", path().string(), ": ", num_bytes,
               " bytes appended after the last tensor was complete");
    const uint64_t take = std::min(num_bytes, specs_[current_].num_bytes() - current_written_);
    file_.write(bytes, take);
    current_crc_ = crc32c_extend(current_crc_, bytes, take);
    sums_.file_crc32c = crc32c_extend(sums_.file_crc32c, bytes, take);
    current_written_ += take;
    bytes += take;
    num_bytes -= take;
    skip_empty_tensors();
  }
}

void SafetensorsWriter::append(const at::Tensor& values) {
  if (values.numel() == 0) return;  // an empty tensor's turn has passed already (no bytes)
  ZS_REQUIRE(current_ < specs_.size(), "safetensors ", path().string(),
             ": a tensor appended after the last tensor was complete");
  const TensorSpec& spec = specs_[current_];
  ZS_REQUIRE(values.is_cpu(), "safetensors ", path().string(), ": tensor ", json_quote(spec.name),
             ": values must be on the CPU, got ", values.device().str());
  ZS_REQUIRE(dtype_of(values) == spec.dtype, "safetensors ", path().string(), ": tensor ",
             json_quote(spec.name), " is ", spec.dtype, ", got values of ", dtype_of(values));
  const uint64_t left = spec.num_bytes() - current_written_;
  const at::Tensor flat = values.resolve_conj().resolve_neg().contiguous();
  ZS_REQUIRE(flat.nbytes() <= left, "safetensors ", path().string(), ": tensor ", json_quote(spec.name),
             " needs ", left / dtype_element_bytes(spec.dtype), " more elements, got ", flat.numel(),
             " (append_bytes streams bytes across tensors)");
  append_bytes(flat.const_data_ptr(), flat.nbytes());
}

FileChecksums SafetensorsWriter::close() {
  skip_empty_tensors();
  if (current_ < specs_.size()) {
    throw UsageError(detail::cat("safetensors ", path().string(), ": close() before tensor ",
                                 json_quote(specs_[current_].name), " was complete (", current_written_,
                                 " of ", specs_[current_].num_bytes(), " bytes written, ",
                                 specs_.size() - current_ - 1, " tensors after it)"));
  }
  file_.close();
  ZS_CHECK(file_.bytes_written() == file_bytes_, "safetensors ", path().string(), ": wrote ",
           file_.bytes_written(), " bytes, planned ", file_bytes_);
  sums_.file_bytes = file_bytes_;
  return sums_;
}

FileChecksums write_safetensors(const fs::path& path,
                                const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                const Metadata& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& [name, tensor] : tensors) specs.push_back(spec_of(name, tensor));
  SafetensorsWriter writer(path, std::move(specs), metadata);
  for (const auto& named : tensors) writer.append(named.second);
  return writer.close();
}

// ---------------------------------------------------------------------------------------------
// Reading

SafetensorsHeader parse_safetensors_header(const std::string& header_json, uint64_t file_bytes,
                                           const fs::path& path) {
  SafetensorsHeader header;
  header.data_start = 8 + header_json.size();
  header.file_bytes = file_bytes;
  json parsed;
  try {
    parsed = json::parse(header_json);
  } catch (const json::exception& e) {
    bad_file(path, std::string("its header is not valid JSON (") + e.what() + ")");
  }
  if (!parsed.is_object()) bad_file(path, "its header is not a JSON object");
  for (const auto& [name, value] : parsed.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) bad_file(path, "__metadata__ is not an object");
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string()) bad_file(path, "__metadata__." + key + " is not a string");
        header.metadata[key] = text.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor " + json_quote(name);
    if (!value.is_object()) bad_file(path, where + " is not an object");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!value.contains(field)) bad_file(path, where + " has no \"" + field + "\"");
    TensorEntry entry;
    entry.spec.name = name;
    const json& dtype = value["dtype"];
    if (!dtype.is_string() || find_dtype(dtype.get<std::string>()) == nullptr)
      bad_file(path, where + ": dtype " + dtype.dump() + " is not one of " + known_dtypes());
    entry.spec.dtype = dtype.get<std::string>();
    const json& shape = value["shape"];
    if (!shape.is_array()) bad_file(path, where + ": shape " + shape.dump() + " is not a list");
    for (const json& d : shape) {
      if (!is_count(d)) bad_file(path, where + ": shape " + shape.dump() + " has a bad dimension");
      entry.spec.shape.push_back(d.get<int64_t>());
    }
    int64_t numel = 1;  // a hostile header must not overflow the byte counts below
    for (int64_t d : entry.spec.shape)
      if (__builtin_mul_overflow(numel, d, &numel) || numel > (int64_t(1) << 60))
        bad_file(path, where + ": shape " + shape.dump() + " has more elements than a file can hold");
    const json& offsets = value["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !is_count(offsets[0]) ||
        !is_count(offsets[1]) || offsets[0].get<uint64_t>() > offsets[1].get<uint64_t>())
      bad_file(path, where + ": data_offsets " + offsets.dump() + " is not [begin, end] with begin <= end");
    entry.data_begin = offsets[0].get<uint64_t>();
    entry.data_end = offsets[1].get<uint64_t>();
    if (entry.data_end - entry.data_begin != entry.spec.num_bytes())
      bad_file(path, detail::cat(where, ": data_offsets ", offsets.dump(), " hold ",
                                 entry.data_end - entry.data_begin, " bytes, but ", entry.spec.dtype,
                                 " of shape ", shape_text(entry.spec.shape), " needs ",
                                 entry.spec.num_bytes()));
    header.tensors.push_back(std::move(entry));
  }
  // By (begin, end): an empty tensor sits at the offset where the next one starts.
  std::sort(header.tensors.begin(), header.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data_end < b.data_end;
  });
  uint64_t cursor = 0;
  for (const auto& e : header.tensors) {
    if (e.data_begin != cursor)
      bad_file(path, detail::cat("tensor ", json_quote(e.spec.name), " starts at data byte ", e.data_begin,
                                 ", expected ", cursor, " (tensors must be back to back)"));
    cursor = e.data_end;
  }
  const uint64_t data_bytes_in_file = file_bytes >= header.data_start ? file_bytes - header.data_start : 0;
  if (cursor > data_bytes_in_file)
    throw Error(detail::cat("checkpoint: ", path.string(), " is truncated: its header describes ",
                            header.data_start + cursor, " bytes, the file has ", file_bytes));
  if (cursor < data_bytes_in_file)
    bad_file(path, detail::cat("the file has ", data_bytes_in_file - cursor,
                               " bytes after the last tensor's data"));
  return header;
}

SafetensorsReader::SafetensorsReader(const fs::path& path) : file_(path) {
  if (file_.size() < 8)
    throw Error(detail::cat("checkpoint: ", path.string(), " is truncated: ", file_.size(),
                            " bytes, a safetensors file has at least 8"));
  unsigned char length[8];
  file_.read_at(0, length, 8, "the header length");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(length[i]) << (8 * i);
  if (n > kMaxHeaderBytes) bad_file(path, detail::cat("its header length ", n, " exceeds 100 MiB"));
  if (n > file_.size() - 8)
    throw Error(detail::cat("checkpoint: ", path.string(), " is truncated: its header needs ", 8 + n,
                            " bytes, the file has ", file_.size()));
  std::string text(size_t(n), '\0');
  file_.read_at(8, text.data(), n, "the header");
  header_ = parse_safetensors_header(text, file_.size(), path);
}

const TensorEntry& SafetensorsReader::entry(const std::string& name) const {
  const TensorEntry* e = header_.find(name);
  if (e == nullptr)
    throw Error("checkpoint: " + path().string() + " holds no tensor " + json_quote(name));
  return *e;
}

void SafetensorsReader::read(const std::string& name, const at::Tensor& out) const {
  const TensorEntry& e = entry(name);
  ZS_REQUIRE(out.sizes().vec() == e.spec.shape, "reading tensor ", json_quote(name), " of ",
             path().string(), ": the file's shape is ", shape_text(e.spec.shape), ", the destination's ",
             shape_text(out.sizes().vec()));
  read_range(name, 0, e.spec.numel(), out);
}

void SafetensorsReader::read_range(const std::string& name, int64_t begin, int64_t end,
                                   const at::Tensor& out) const {
  const TensorEntry& e = entry(name);
  const std::string where = "reading tensor " + json_quote(name) + " of " + path().string();
  ZS_REQUIRE(out.is_cpu() && out.is_contiguous(), where, ": the destination must be a contiguous CPU tensor");
  ZS_REQUIRE(dtype_of(out) == e.spec.dtype, where, ": the file holds ", e.spec.dtype,
             ", the destination is ", dtype_of(out));
  ZS_REQUIRE(out.numel() == end - begin, where, ": elements [", begin, ", ", end, ") need a destination of ",
             end - begin, " elements, it has ", out.numel());
  read_range_bytes(name, begin, end, out.data_ptr());
}

void SafetensorsReader::read_range_bytes(const std::string& name, int64_t begin, int64_t end, void* out) const {
  const TensorEntry& e = entry(name);
  ZS_REQUIRE(0 <= begin && begin <= end && end <= e.spec.numel(), "reading tensor ", json_quote(name), " of ",
             path().string(), ": elements [", begin, ", ", end, ") are outside [0, ", e.spec.numel(), ")");
  const uint64_t element = dtype_element_bytes(e.spec.dtype);
  file_.read_at(header_.data_start + e.data_begin + uint64_t(begin) * element, out,
                uint64_t(end - begin) * element, "tensor " + json_quote(name));
}

namespace {
uint32_t crc_of_range(const InputFile& file, uint64_t offset, uint64_t num_bytes, const std::string& what) {
  std::vector<char> chunk(size_t(std::min(num_bytes, kChunkBytes)));
  uint32_t crc = 0;
  while (num_bytes > 0) {
    const uint64_t n = std::min<uint64_t>(num_bytes, chunk.size());
    file.read_at(offset, chunk.data(), n, what);
    crc = crc32c_extend(crc, chunk.data(), n);
    offset += n;
    num_bytes -= n;
  }
  return crc;
}
}  // namespace

uint32_t SafetensorsReader::tensor_crc32c(const std::string& name) const {
  const TensorEntry& e = entry(name);
  return crc_of_range(file_, header_.data_start + e.data_begin, e.data_end - e.data_begin,
                      "tensor " + json_quote(name));
}

uint32_t SafetensorsReader::file_crc32c() const { return crc_of_range(file_, 0, file_.size(), "the file"); }

void verify_tensor(const SafetensorsReader& reader, const std::string& name, uint32_t expected_crc32c) {
  const uint32_t actual = reader.tensor_crc32c(name);
  if (actual != expected_crc32c)
    throw Error("checkpoint: " + reader.path().string() + ": tensor " + json_quote(name) +
                ": checksum mismatch (crc32c recorded " + crc32c_to_hex(expected_crc32c) + ", file has " +
                crc32c_to_hex(actual) + "): the file is corrupted");
}

void verify_safetensors(const fs::path& path, const FileChecksums& expected) {
  const SafetensorsReader reader(path);
  if (reader.header().file_bytes != expected.file_bytes)
    throw Error(detail::cat("checkpoint: ", path.string(), " has ", reader.header().file_bytes,
                            " bytes, the manifest records ", expected.file_bytes,
                            ": the file was truncated or replaced"));
  const uint32_t actual = reader.file_crc32c();
  if (actual == expected.file_crc32c) return;
  for (const auto& [name, crc] : expected.tensor_crc32c) verify_tensor(reader, name, crc);
  // Every recorded tensor matches: the difference is in the header or in a tensor not recorded.
  std::string unrecorded;
  for (const auto& e : reader.header().tensors)
    if (!expected.tensor_crc32c.count(e.spec.name)) unrecorded += (unrecorded.empty() ? "" : ", ") + json_quote(e.spec.name);
  throw Error("checkpoint: " + path.string() + ": checksum mismatch (crc32c recorded " +
              crc32c_to_hex(expected.file_crc32c) + ", file has " + crc32c_to_hex(actual) + ") in " +
              (unrecorded.empty() ? "the header" : "the header or tensors without a recorded checksum: " + unrecorded) +
              ": the file is corrupted");
}

}  // namespace zeroshard::checkpoint
