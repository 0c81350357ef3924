// Shared by the tests/cpp/runtime/test_checkpoint_*.cpp binaries: a scratch directory, tensors
// with reproducible contents, byte comparison, and small checkpoints written the way the engine
// will write them (files in a staged directory, a manifest, commit).
#pragma once
#include <ATen/ATen.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "runtime/checkpoint/atomic_dir.h"
#include "runtime/checkpoint/manifest.h"
#include "runtime/checkpoint/safetensors.h"
#include "runtime/checkpoint/testing_hooks.h"

namespace zs_test {

namespace fs = std::filesystem;
namespace ckpt = zeroshard::checkpoint;

// A fresh directory under /tmp, removed with its contents at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    char name[] = "/tmp/zs-ckpt-test-XXXXXX";
    if (::mkdtemp(name) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = name;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// Contents that differ by `seed` and by position, for any dtype (bools alternate).
inline at::Tensor pattern(at::ScalarType dtype, std::vector<int64_t> shape, int seed) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const at::Tensor base = at::arange(numel, at::kDouble);
  at::Tensor values;
  if (dtype == at::kBool) values = (base + seed).remainder(3).eq(0);
  else if (at::isFloatingType(dtype) || at::isComplexType(dtype)) values = (base * 0.37 + seed).sin() * 3.0;
  else values = (base * 7 + seed * 13).remainder(101);
  return values.to(dtype).reshape(shape);
}

inline bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ca = a.contiguous();
  const at::Tensor cb = b.contiguous();
  return ca.nbytes() == 0 || std::memcmp(ca.const_data_ptr(), cb.const_data_ptr(), ca.nbytes()) == 0;
}

inline std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

using Named = std::vector<std::pair<std::string, at::Tensor>>;

// A model-like set of tensors whose values all depend on `version`.
inline Named model_tensors(int version, int64_t scale = 1) {
  return {{"embed.weight", pattern(at::kFloat, {16 * scale, 8}, version)},
          {"block.0.bias", pattern(at::kBFloat16, {24}, version + 1)},
          {"block.0.weight", pattern(at::kFloat, {24, 16 * scale}, version + 2)},
          {"step", pattern(at::kLong, {}, version)}};
}

// Writes `tensors` as a two-rank checkpoint (each tensor's flat elements split between two
// files, rank0.safetensors and rank1.safetensors) plus the manifest, and commits it. The
// manifest's "training_state" section records `version`; the test hook point
// "test:between_files" comes after the first file.
inline void save_two_rank_checkpoint(const fs::path& save_dir, const std::string& tag, const Named& tensors,
                                     bool save_latest = true, int version = 0) {
  auto staged = ckpt::StagedCheckpoint::create(save_dir, tag);
  ckpt::Manifest manifest;
  for (int rank = 0; rank < 2; ++rank) {
    Named shard;
    for (const auto& [name, t] : tensors) {
      const int64_t half = t.numel() / 2;
      const at::Tensor flat = t.reshape({-1});
      shard.emplace_back(name, rank == 0 ? flat.slice(0, 0, half) : flat.slice(0, half));
    }
    const std::string file = "rank" + std::to_string(rank) + ".safetensors";
    manifest.add_file(file, ckpt::write_safetensors(staged.file(file), shard));
    for (const auto& [name, t] : tensors) {
      const int64_t half = t.numel() / 2;
      manifest.add_piece(name, t.sizes().vec(), ckpt::dtype_of(t), file, name, rank == 0 ? 0 : half,
                         rank == 0 ? half : t.numel());
    }
    if (rank == 0) ckpt::testing::reached("test:between_files");
  }
  manifest.set_section("training_state", {{"global_steps", version}});
  manifest.validate_complete();
  manifest.save(staged.file(ckpt::kManifestFileName));
  staged.commit(save_latest);
}

// Loads a checkpoint directory: the manifest, every file verified, every tensor read whole
// through plan_read (pieces from several files).
inline Named load_checkpoint(const fs::path& dir) {
  const auto manifest = ckpt::Manifest::load(dir / ckpt::kManifestFileName);
  for (const auto& f : manifest.files()) ckpt::verify_safetensors(dir / f.name, manifest.file_checksums(f.name));
  Named out;
  for (const auto& t : manifest.tensors()) {
    at::Tensor value = at::empty(t.shape, at::TensorOptions().dtype(ckpt::scalar_type_of(t.dtype)));
    const at::Tensor flat = value.view({-1});
    for (const auto& step : manifest.plan_read(t.name, 0, t.numel())) {
      const ckpt::SafetensorsReader reader(dir / step.file);
      reader.read_range(step.key, step.file_begin, step.file_end,
                        flat.slice(0, step.dest_offset, step.dest_offset + step.file_end - step.file_begin));
    }
    out.emplace_back(t.name, value);
  }
  return out;
}

inline bool same_tensors(const Named& a, const Named& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].first != b[i].first || !same_bytes(a[i].second, b[i].second)) return false;
  return true;
}

}  // namespace zs_test
