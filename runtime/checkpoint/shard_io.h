// A rank's part of a checkpoint, in and out: write_shard_file streams this rank's pieces of
// tensors (any device) into one safetensors file and returns the partial manifest that describes
// them; CheckpointReader fills any global element range of any tensor from a checkpoint
// directory, whatever world size or stage wrote it, checking each key's CRC32C against the
// manifest as it reads it (a mismatch names the file and the tensor).
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
  // Loads and validates <dir>/manifest.json.
  explicit CheckpointReader(fs::path dir);
  const Manifest& manifest() const { return manifest_; }
  const fs::path& dir() const { return dir_; }
  // Global elements [begin, begin + out.numel()) of `name` into `out` (1-D or any contiguous
  // shape; any device; any dtype the file's converts to). Each key read is checked against its
  // CRC32C once; reading part of a key reads the whole key to check it.
  void read(const std::string& name, int64_t begin, const at::Tensor& out);
  // Bytes read from files so far (for the progress line and the benchmark).
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  SafetensorsReader& reader(const std::string& file);
  fs::path dir_;
  Manifest manifest_;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers_;
  std::set<std::pair<std::string, std::string>> verified_;  // (file, key) whose CRC matched
  uint64_t bytes_read_ = 0;
};

}  // namespace zeroshard::checkpoint
