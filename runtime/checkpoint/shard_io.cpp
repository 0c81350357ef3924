#include "runtime/checkpoint/shard_io.h"

#include <ATen/ATen.h>
#include <algorithm>
#include "runtime/checkpoint/crc32c.h"
#include "runtime/error.h"

namespace zeroshard::checkpoint {

namespace {

constexpr int64_t kHostChunkBytes = 64 << 20;  // device -> host copies, at most this much at once

const Piece& piece_of(const TensorRecord& t, const std::string& file, const std::string& key) {
  for (const Piece& p : t.pieces) {
    if (p.file == file && p.key == key) return p;
  }
  throw Error(detail::cat("checkpoint manifest: tensor \"", t.name, "\" has no piece ", key, " in ", file));
}

}  // namespace

Manifest write_shard_file(const fs::path& path, const std::vector<SaveItem>& items) {
  std::vector<TensorSpec> specs;
  specs.reserve(items.size());
  for (const SaveItem& item : items) {
    ZS_REQUIRE(item.values.dim() == 1, "checkpoint: tensor \"", item.name, "\": values must be 1-D");
    specs.push_back({item.name, dtype_of(item.values), {item.values.numel()}});
  }
  SafetensorsWriter writer(path, specs);
  for (const SaveItem& item : items) {
    const at::Tensor& v = item.values;
    if (v.is_cpu()) {
      writer.append(v);
      continue;
    }
    const int64_t step = std::max<int64_t>(1, kHostChunkBytes / int64_t(v.element_size()));
    for (int64_t at = 0; at < v.numel(); at += step) {
      writer.append(v.narrow(0, at, std::min(step, v.numel() - at)).to(at::kCPU));
    }
  }
  const FileChecksums sums = writer.close();
  Manifest manifest;
  const std::string file = path.filename().string();
  manifest.add_file(file, sums);
  for (const SaveItem& item : items) {
    manifest.add_piece(item.name, item.shape, dtype_of(item.values), file, item.name, item.begin,
                       item.begin + item.values.numel());
  }
  return manifest;
}

CheckpointReader::CheckpointReader(fs::path dir, bool verify_before_writing)
    : dir_(std::move(dir)),
      manifest_(Manifest::load(dir_ / kManifestFileName)),
      verify_before_writing_(verify_before_writing) {}

void CheckpointReader::open_all() {
  for (const FileRecord& f : manifest_.files()) reader(f.name);
}

SafetensorsReader& CheckpointReader::reader(const std::string& file) {
  auto it = readers_.find(file);
  if (it == readers_.end()) {
    auto r = std::make_unique<SafetensorsReader>(dir_ / file);
    const uint64_t expected = manifest_.file_checksums(file).file_bytes;
    if (r->header().file_bytes != expected) {
      throw Error(detail::cat("checkpoint ", (dir_ / file).string(), ": ", r->header().file_bytes,
                              " bytes, the manifest says ", expected, " (truncated or replaced)"));
    }
    it = readers_.emplace(file, std::move(r)).first;
  }
  return *it->second;
}

at::Tensor CheckpointReader::staging(int64_t numel, at::ScalarType dtype) {
  const int64_t bytes = numel * int64_t(c10::elementSize(dtype));
  // Grown, never shrunk: fresh pages for every key cost more than the read itself.
  if (staging_.numel() < bytes) staging_ = at::empty({bytes}, at::kByte);
  return staging_.narrow(0, 0, bytes).view(dtype);
}

void CheckpointReader::read(const std::string& name, int64_t begin, const at::Tensor& out) {
  const TensorRecord& t = manifest_.tensor(name);
  const at::ScalarType file_dtype = scalar_type_of(t.dtype);
  at::Tensor flat_out = out.view({-1});
  for (const ReadStep& s : manifest_.plan_read(name, begin, begin + out.numel())) {
    SafetensorsReader& r = reader(s.file);
    const int64_t key_numel = r.entry(s.key).spec.numel();
    const bool whole_key = s.file_begin == 0 && s.file_end == key_numel;
    const bool checked = verified_.count({s.file, s.key}) != 0;
    at::Tensor dst = flat_out.narrow(0, s.dest_offset, s.file_end - s.file_begin);
    const bool direct = dst.is_cpu() && dst.is_contiguous() && dst.scalar_type() == file_dtype;
    if (checked) {  // already verified: read only the range
      at::Tensor buf = direct ? dst : staging(s.file_end - s.file_begin, file_dtype);
      r.read_range(s.key, s.file_begin, s.file_end, buf);
      if (!direct) dst.copy_(buf);
      bytes_read_ += uint64_t(buf.nbytes());
      continue;
    }
    const bool into_dst = direct && whole_key && !verify_before_writing_;
    at::Tensor key = into_dst ? dst : staging(key_numel, file_dtype);
    r.read_range(s.key, 0, key_numel, key);
    bytes_read_ += uint64_t(key.nbytes());
    const uint32_t crc = crc32c(key.const_data_ptr(), size_t(key.nbytes()));
    if (crc != piece_of(t, s.file, s.key).crc32c) {
      throw Error(detail::cat("checkpoint ", (dir_ / s.file).string(), ": tensor \"", s.key,
                              "\": checksum mismatch (the file is corrupted)"));
    }
    verified_.insert({s.file, s.key});
    if (!into_dst) dst.copy_(key.narrow(0, s.file_begin, s.file_end - s.file_begin));
  }
}

}  // namespace zeroshard::checkpoint
