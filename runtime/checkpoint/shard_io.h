// A rank's part of a checkpoint, in and out: write_shard_file streams this rank's pieces of
// tensors (any device) into one safetensors file and returns the partial manifest that describes
// them; CheckpointReader fills any global element range of any tensor from a checkpoint
// directory, whatever world size or stage wrote it, reading the keys (per-file pieces) that hold
// the range and checking each key's CRC32C against the manifest (a mismatch names the file and
// the tensor).
#pragma once
#include <ATen/core/Tensor.h>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>
#include "runtime/checkpoint/manifest.h"
#include "runtime/checkpoint/safetensors.h"

namespace zeroshard::checkpoint {

// Elements [begin, begin + values.numel()) of tensor `name` (global `shape`), stored under the
// key `name` in the file; `values` is 1-D, on any device, in the dtype to store.
struct SaveItem {
  std::string name;
  std::vector<int64_t> shape;
  int64_t begin = 0;
  at::Tensor values;
};

// Writes `items` to `path` (a new file; its file name is what the manifest records) and returns
// the manifest of this one file. Device tensors come to the host in bounded pieces.
Manifest write_shard_file(const fs::path& path, const std::vector<SaveItem>& items);

class CheckpointReader {
 public:
  // Loads and validates <dir>/manifest.json. `verify_before_writing`: a key's first read goes
  // through a host buffer and reaches `out` only once its CRC32C matched, so a corrupted file
  // never overwrites live weights; false (consolidation, whose destination is scratch) reads a
  // whole key straight into a CPU destination of the file's dtype, with no second buffer.
  explicit CheckpointReader(fs::path dir, bool verify_before_writing = true);
  const Manifest& manifest() const { return manifest_; }
  const fs::path& dir() const { return dir_; }
  // Opens every file the manifest lists and checks its size, so a missing or truncated file is
  // an Error (naming it) before anything is read.
  void open_all();
  // Global elements [begin, begin + out.numel()) of `name` into `out` (1-D or any contiguous
  // shape; any device; any dtype the file's converts to). Each key is checked against its
  // CRC32C once: the first read of a key reads all of it (also when only part is wanted), later
  // reads only the range.
  void read(const std::string& name, int64_t begin, const at::Tensor& out);
  // Bytes read from files so far (for the progress line and the benchmark).
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  SafetensorsReader& reader(const std::string& file);
  // A host buffer of `numel` elements of `dtype`, reused from read to read.
  at::Tensor staging(int64_t numel, at::ScalarType dtype);
  fs::path dir_;
  Manifest manifest_;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers_;
  bool verify_before_writing_;
  at::Tensor staging_;  // bytes
  std::set<std::pair<std::string, std::string>> verified_;  // (file, key) whose CRC matched
  uint64_t bytes_read_ = 0;
};

}  // namespace zeroshard::checkpoint
