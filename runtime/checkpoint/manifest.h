// A checkpoint's manifest (manifest.json): what each tensor is (name, global shape, dtype) and
// where its data lives, as pieces {file, key in that file, global flat element range [begin, end),
// crc32c of that key's bytes}; every file's byte size and CRC32C; and free-form JSON sections the
// caller adds ("config", "layout", "training_state", "client_state"). Format version 1.
//
// Each rank builds a partial manifest of the files it wrote; rank 0 merges them (to_json /
// parse / merge), checks validate_complete() and saves it. A load parses and validates: a newer
// format version, missing or mistyped fields, or pieces that do not tile a tensor's [0, numel)
// exactly once are Errors that name the version, the fields or the tensor. plan_read() then says
// which byte ranges of which files hold any global element range, for resharding at load.
//
// A piece's key holds exactly end - begin elements: key element i is global element begin + i.
// The key's dtype and size in its file are checked when it is read (safetensors.h), not here.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "runtime/checkpoint/safetensors.h"

namespace zeroshard::checkpoint {

constexpr int kManifestFormatVersion = 1;
constexpr const char* kManifestFileName = "manifest.json";

struct Piece {
  std::string file;  // relative to the checkpoint directory
  std::string key;   // the tensor's name inside that file
  int64_t begin = 0;  // global flat elements [begin, end)
  int64_t end = 0;
  uint32_t crc32c = 0;  // of the key's bytes (FileChecksums::tensor_crc32c)
};

struct TensorRecord {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;  // safetensors spelling ("F32", "BF16", ...)
  std::vector<Piece> pieces;  // sorted by begin once validated
  int64_t numel() const;
};

struct FileRecord {
  std::string name;  // relative to the checkpoint directory
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};

// One read that plan_read() asks for: elements [file_begin, file_end) of `key` in `file` go to
// elements [dest_offset, dest_offset + file_end - file_begin) of the destination.
struct ReadStep {
  std::string file;
  std::string key;
  int64_t file_begin = 0;
  int64_t file_end = 0;
  int64_t dest_offset = 0;
  bool operator==(const ReadStep& other) const;
};

class Manifest {
 public:
  // Records a file this rank wrote, with the checksums its writer returned.
  void add_file(const std::string& file, const FileChecksums& sums);
  // Records that elements [begin, end) of tensor `name` are `key` of `file`; the key's checksum
  // comes from `file`'s add_file(), which must come first. The first piece of a tensor fixes its shape and dtype;
  // later pieces must agree (UsageError naming the tensor otherwise).
  void add_piece(const std::string& name, const std::vector<int64_t>& shape, const std::string& dtype,
                 const std::string& file, const std::string& key, int64_t begin, int64_t end);
  // A free-form section; replaces one of the same name.
  void set_section(const std::string& name, nlohmann::json value);
  // Adds another rank's files, pieces and sections: a file twice, tensors that disagree on shape
  // or dtype, or a section twice with different values are UsageErrors naming them.
  void merge(const Manifest& other);

  // Every piece's file is recorded and the pieces of each tensor tile [0, numel) exactly once;
  // otherwise an Error naming the tensor and the gap or overlap. Sorts the pieces.
  void validate_complete(const std::string& source = "manifest");

  const std::vector<TensorRecord>& tensors() const { return tensors_; }
  const std::vector<FileRecord>& files() const { return files_; }
  const std::map<std::string, nlohmann::json>& sections() const { return sections_; }
  // Error naming the manifest's source when absent.
  const TensorRecord& tensor(const std::string& name) const;
  bool has_tensor(const std::string& name) const;
  const nlohmann::json& section(const std::string& name) const;
  bool has_section(const std::string& name) const { return sections_.count(name) != 0; }
  // A file's size and checksums (its own and each key's), for verify_safetensors.
  FileChecksums file_checksums(const std::string& file) const;

  // The reads that fill global elements [begin, end) of `name`, in destination order.
  // Requires validate_complete(); UsageError when the range is outside [0, numel).
  std::vector<ReadStep> plan_read(const std::string& name, int64_t begin, int64_t end) const;

  nlohmann::json to_json() const;
  // Checks the format version and every field's presence and type (not completeness: a rank's
  // partial manifest parses too). Errors name `source` (a path, or "rank 3's manifest").
  static Manifest parse(const nlohmann::json& json, const std::string& source);
  // Writes to_json() to a new file (reserved, fsync'd: file_io.h); requires validate_complete().
  void save(const fs::path& path) const;
  // Reads, parses and validate_complete()s a manifest file.
  static Manifest load(const fs::path& path);

 private:
  TensorRecord* find(const std::string& name);

  std::vector<TensorRecord> tensors_;  // in the order first added (the model's order)
  std::vector<FileRecord> files_;
  std::map<std::string, nlohmann::json> sections_;
  std::map<std::string, std::map<std::string, uint32_t>> key_crc32c_;  // add_file's, for add_piece
  std::string source_ = "manifest";
  bool validated_ = false;
};

}  // namespace zeroshard::checkpoint
