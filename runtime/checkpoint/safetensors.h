// The safetensors file format (Hugging Face): 8-byte little-endian header length N, N bytes of
// JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}
// padded with spaces to a multiple of 8, then each tensor's raw little-endian bytes, back to back,
// in the order given to the writer. Files written here load with safetensors.torch.load_file.
//
// Writing streams tensor by tensor (never the whole file in memory): the header is known up front
// from the specs, the file's exact size is reserved before any data, and CRC32C checksums of each
// tensor and of the whole file are computed while writing. Reading opens the header once and
// reads a whole tensor, or a flat element range [begin, end) of it, with pread into the caller's
// tensor, so a rank reads only the bytes it owns. Reads verify no checksum (a range is part of
// a tensor); verify_safetensors recomputes them and names the file and tensor that differ.
//
// Errors: a caller's mismatch (dtype, shape, range, unknown name) is a UsageError; a missing,
// truncated or malformed file is an Error naming the file (file_io.h for I/O errors).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>  // the dtype enum only, not the tensor headers

#include "runtime/checkpoint/file_io.h"

namespace at {
class Tensor;
}

namespace zeroshard::checkpoint {

using Metadata = std::map<std::string, std::string>;

// Every safetensors dtype this build reads and writes, with its torch dtype (the one table).
std::vector<std::pair<std::string, c10::ScalarType>> safetensors_dtypes();
// Whether `dtype` is a safetensors dtype this build reads and writes.
bool is_safetensors_dtype(const std::string& dtype);
// Bytes per element of a safetensors dtype ("F32" -> 4); UsageError listing the known ones.
uint64_t dtype_element_bytes(const std::string& dtype);
// The torch dtype of a safetensors dtype ("BF16" -> at::kBFloat16); UsageError for unknown ones.
c10::ScalarType scalar_type_of(const std::string& dtype);
// The safetensors dtype of a tensor ("BF16" for torch.bfloat16); UsageError for dtypes it lacks.
std::string dtype_of(const at::Tensor& tensor);

// One tensor as the header describes it.
struct TensorSpec {
  std::string name;
  std::string dtype;           // safetensors spelling: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;  // [] is a scalar (1 element)
  int64_t numel() const;
  uint64_t num_bytes() const { return uint64_t(numel()) * dtype_element_bytes(dtype); }
};
TensorSpec spec_of(const std::string& name, const at::Tensor& tensor);

// A parsed header: tensors in data order, with byte offsets relative to the data section.
struct TensorEntry {
  TensorSpec spec;
  uint64_t data_begin = 0;
  uint64_t data_end = 0;
};
struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // sorted by data_begin
  Metadata metadata;
  uint64_t data_start = 0;  // 8 + header length: where data_offsets count from
  uint64_t file_bytes = 0;
  // nullptr when absent.
  const TensorEntry* find(const std::string& name) const;
};

// The exact size of the file write_safetensors / SafetensorsWriter produces for these specs.
uint64_t safetensors_file_bytes(const std::vector<TensorSpec>& specs, const Metadata& metadata = {});

// Checksums computed while writing, checked by verify_safetensors.
struct FileChecksums {
  uint64_t file_bytes = 0;
  uint32_t file_crc32c = 0;
  std::map<std::string, uint32_t> tensor_crc32c;  // by tensor name (the key in the file)
};

// Writes one file, tensor after tensor in the order of `specs`. append() takes any part of the
// current tensor, so a tensor can be streamed from pieces; close() requires every byte. A writer
// destroyed before close() leaves a partial file (StagedCheckpoint removes its directory).
class SafetensorsWriter {
 public:
  // Validates the specs (unique names, known dtypes, no "__metadata__"), creates `path`, reserves
  // its exact size (ENOSPC here, before any data) and writes the header.
  SafetensorsWriter(const fs::path& path, std::vector<TensorSpec> specs, const Metadata& metadata = {});
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  ~SafetensorsWriter();

  // The next elements of the current tensor: a CPU tensor of its dtype (any shape, contiguous or
  // not), at most the elements it still needs.
  void append(const at::Tensor& values);
  // The same from raw little-endian bytes, for callers without a tensor (at any byte boundary).
  void append_bytes(const void* data, uint64_t num_bytes);
  // Requires every tensor complete; flushes, fsyncs, closes. Returns the checksums.
  FileChecksums close();

  const fs::path& path() const { return file_.path(); }
  uint64_t file_bytes() const { return file_bytes_; }

 private:
  void skip_empty_tensors();

  std::vector<TensorSpec> specs_;
  std::string header_;  // only until the constructor has written it
  uint64_t file_bytes_ = 0;
  OutputFile file_;
  size_t current_ = 0;               // index of the tensor append() fills
  uint64_t current_written_ = 0;     // its bytes so far
  uint32_t current_crc_ = 0;
  FileChecksums sums_;
};

// The whole file in one call: a spec per tensor (spec_of), then each tensor appended.
FileChecksums write_safetensors(const fs::path& path,
                                const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                const Metadata& metadata = {});

// Parses and validates a header (its JSON text) against the file's size: known dtypes, shapes
// that match the byte ranges, ranges inside the data section that tile it. Error naming `path`.
SafetensorsHeader parse_safetensors_header(const std::string& header_json, uint64_t file_bytes,
                                           const fs::path& path);

// A file opened for reading: the header is read and validated once.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const fs::path& path);

  const fs::path& path() const { return file_.path(); }
  const SafetensorsHeader& header() const { return header_; }
  // The entry of `name`; Error naming the file and the tensor when it is absent.
  const TensorEntry& entry(const std::string& name) const;

  // The whole tensor into `out`: a contiguous CPU tensor of the file's dtype and shape.
  void read(const std::string& name, const at::Tensor& out) const;
  // Elements [begin, end) of the tensor's flattened data into `out`: contiguous, CPU, the file's
  // dtype, exactly end - begin elements (any shape). Only those bytes are read.
  void read_range(const std::string& name, int64_t begin, int64_t end, const at::Tensor& out) const;
  // The same into raw memory of (end - begin) * element bytes.
  void read_range_bytes(const std::string& name, int64_t begin, int64_t end, void* out) const;

  // CRC32C of the tensor's bytes / of the whole file, read back from disk in bounded chunks.
  uint32_t tensor_crc32c(const std::string& name) const;
  uint32_t file_crc32c() const;

 private:
  InputFile file_;
  SafetensorsHeader header_;
};

// Recomputes the file's size and CRC32C and compares them with `expected`; on a mismatch,
// recomputes each tensor's CRC32C to say which: Error "<path>: tensor "<name>": checksum mismatch".
void verify_safetensors(const fs::path& path, const FileChecksums& expected);
// Recomputes one tensor's CRC32C; Error naming the file and tensor on a mismatch.
void verify_tensor(const SafetensorsReader& reader, const std::string& name, uint32_t expected_crc32c);

}  // namespace zeroshard::checkpoint
