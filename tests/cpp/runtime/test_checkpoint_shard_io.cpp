// A rank's part of a checkpoint (runtime/checkpoint/shard_io.cpp): three "ranks" write pieces of
// the same tensors with write_shard_file, their partial manifests are merged and saved as
// save_checkpoint does, and CheckpointReader reads ranges inside one key, across files and of
// whole keys, in the file's dtype and others, into flat and shaped outs; bytes_read's accounting;
// corrupted, truncated, replaced and missing files; write_shard_file's 1-D rule.
// With ATen included, Catch2's CHECK is shadowed by c10's: only REQUIRE here.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "checkpoint_helpers.h"
#include "runtime/checkpoint/shard_io.h"
#include "runtime/error.h"

using namespace zeroshard;
using namespace zeroshard::checkpoint;
using namespace zs_test;

namespace {

// Which elements [begin, end) of which tensor each rank's file holds: every tensor is tiled,
// "c" lives in one file only, and rank 2 holds no "b".
struct Part {
  std::string tensor;
  int64_t begin, end;
};
const std::vector<std::vector<Part>> kRankParts = {
    {{"w", 0, 25}, {"b", 0, 10}},
    {{"w", 25, 40}, {"b", 10, 37}},
    {{"w", 40, 60}, {"c", 0, 3}},
};

Named full_tensors() {
  return {{"w", pattern(at::kFloat, {6, 10}, 1)},
          {"b", pattern(at::kBFloat16, {37}, 2)},
          {"c", pattern(at::kFloat, {3}, 3)}};
}

const at::Tensor& tensor_of(const Named& all, const std::string& name) {
  for (const auto& [n, t] : all)
    if (n == name) return t;
  throw std::runtime_error("no tensor " + name);
}

std::string rank_file(int rank) { return "rank0000" + std::to_string(rank) + ".safetensors"; }

// Bytes of `tensor`'s key in rank `rank`'s file.
int64_t key_bytes(int rank, const std::string& tensor) {
  const Named all = full_tensors();
  for (const Part& p : kRankParts[size_t(rank)])
    if (p.tensor == tensor) return (p.end - p.begin) * int64_t(tensor_of(all, tensor).element_size());
  throw std::runtime_error("rank " + std::to_string(rank) + " holds no " + tensor);
}

// What save_checkpoint does: each rank writes its file and returns its partial manifest, rank 0
// merges the others' (as parsed JSON), validates and saves manifest.json.
void write_checkpoint(const fs::path& dir) {
  const Named all = full_tensors();
  std::vector<Manifest> partial;
  for (size_t rank = 0; rank < kRankParts.size(); ++rank) {
    std::vector<SaveItem> items;
    for (const Part& p : kRankParts[rank]) {
      const at::Tensor& t = tensor_of(all, p.tensor);
      items.push_back({p.tensor, t.sizes().vec(), p.begin, t.reshape({-1}).slice(0, p.begin, p.end)});
    }
    partial.push_back(write_shard_file(dir / rank_file(int(rank)), items));
  }
  Manifest manifest = partial[0];
  for (size_t rank = 1; rank < partial.size(); ++rank)
    manifest.merge(Manifest::parse(partial[rank].to_json(), "rank " + std::to_string(rank) + "'s manifest"));
  manifest.validate_complete(dir.string());
  manifest.save(dir / kManifestFileName);
}

// Overwrites one byte in the middle of `tensor`'s data in `file`.
void corrupt_key(const fs::path& file, const std::string& tensor) {
  uint64_t at_byte = 0;
  {
    const SafetensorsReader reader(file);
    const TensorEntry& e = reader.entry(tensor);
    at_byte = reader.header().data_start + (e.data_begin + e.data_end) / 2;
  }
  std::string bytes = read_bytes(file);
  bytes[at_byte] = char(bytes[at_byte] ^ 0x5a);
  write_bytes(file, bytes);
}

// The global elements [begin, begin + numel(shape)) of `tensor`, converted to `dtype`, shaped.
at::Tensor expected(const std::string& tensor, int64_t begin, const std::vector<int64_t>& shape,
                    at::ScalarType dtype) {
  const at::Tensor flat = tensor_of(full_tensors(), tensor).reshape({-1});
  return flat.slice(0, begin, begin + c10::multiply_integers(shape)).to(dtype).reshape(shape);
}

at::Tensor sentinel(const std::vector<int64_t>& shape, at::ScalarType dtype) {
  return at::full(shape, -7.0, at::dtype(dtype));
}

bool all_sentinel(const at::Tensor& t) { return t.eq(-7.0).all().item<bool>(); }

// The message of the Error `f` throws (another exception fails the test as it propagates).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no Error thrown)";
}

// One read: global elements from `begin` of `tensor` into an out of `shape` and `dtype`.
struct ReadCase {
  const char* what;
  std::string tensor;
  int64_t begin;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

const std::vector<ReadCase> kReads = {
    {"inside rank 0's key", "w", 3, {10}, at::kFloat},
    {"inside rank 0's key, into double", "w", 3, {10}, at::kDouble},
    {"inside rank 0's key, into bf16", "w", 3, {10}, at::kBFloat16},
    {"inside rank 1's key, 2-D", "w", 27, {3, 4}, at::kFloat},
    {"one element", "c", 1, {1}, at::kFloat},
    {"across three files", "w", 20, {25}, at::kFloat},
    {"across three files, 2-D double", "w", 20, {5, 5}, at::kDouble},
    {"across two files, bf16 file into float, 2-D", "b", 5, {3, 5}, at::kFloat},
    {"exactly one whole key", "w", 25, {15}, at::kFloat},
    {"exactly one whole key, into double", "b", 10, {27}, at::kDouble},
    {"whole tensor (whole keys), 2-D", "w", 0, {6, 10}, at::kFloat},
    {"whole tensor (whole keys), into bf16", "w", 0, {6, 10}, at::kBFloat16},
    {"whole bf16 tensor", "b", 0, {37}, at::kBFloat16},
    {"whole tensor in one file", "c", 0, {3}, at::kFloat},
};

}  // namespace

TEST_CASE("shard files: three ranks' partial manifests merge into one that tiles every tensor") {
  TempDir dir;
  write_checkpoint(dir.path);
  const Manifest m = Manifest::load(dir.path / kManifestFileName);
  REQUIRE(m.files().size() == 3);
  for (const FileRecord& f : m.files()) {
    REQUIRE(f.bytes == fs::file_size(dir.path / f.name));
    verify_safetensors(dir.path / f.name, m.file_checksums(f.name));
  }
  const Named all = full_tensors();
  for (const auto& [name, t] : all) {
    const TensorRecord& r = m.tensor(name);
    REQUIRE(r.shape == t.sizes().vec());
    REQUIRE(r.dtype == dtype_of(t));
  }
  const TensorRecord& w = m.tensor("w");
  REQUIRE(w.pieces.size() == 3);
  for (size_t rank = 0; rank < 3; ++rank) {
    REQUIRE(w.pieces[rank].file == rank_file(int(rank)));
    REQUIRE(w.pieces[rank].key == "w");
    REQUIRE(w.pieces[rank].begin == kRankParts[rank][0].begin);
    REQUIRE(w.pieces[rank].end == kRankParts[rank][0].end);
  }
  REQUIRE(m.tensor("c").pieces.size() == 1);
  REQUIRE(m.tensor("c").pieces[0].file == rank_file(2));
}

TEST_CASE("CheckpointReader: ranges inside a key, across files and of whole keys, in any dtype and shape") {
  TempDir dir;
  write_checkpoint(dir.path);
  for (const bool verify_first : {true, false}) {
    // One reader for every case (keys verified by earlier cases are read by range only), and a
    // fresh one per case (every key's first read).
    CheckpointReader shared(dir.path, verify_first);
    for (const ReadCase& c : kReads) {
      CAPTURE(verify_first, c.what, c.tensor, c.begin, c.shape);
      const at::Tensor want = expected(c.tensor, c.begin, c.shape, c.dtype);
      CheckpointReader fresh(dir.path, verify_first);
      for (CheckpointReader* reader : {&fresh, &shared}) {
        at::Tensor out = sentinel(c.shape, c.dtype);
        reader->read(c.tensor, c.begin, out);
        REQUIRE(same_bytes(out, want));
      }
    }
  }
}

TEST_CASE("CheckpointReader: bytes_read counts a key whole on its first read, only the range after") {
  TempDir dir;
  write_checkpoint(dir.path);
  struct Step {
    std::string tensor;
    int64_t begin, numel;
    at::ScalarType dtype;
    int64_t bytes;  // bytes_read() grows by this much
  };
  const std::vector<Step> steps = {
      {"w", 3, 10, at::kFloat, key_bytes(0, "w")},         // first read of rank 0's key: all of it
      {"w", 5, 4, at::kFloat, 4 * 4},                      // verified: the range only
      {"w", 20, 25, at::kDouble,                           // rank 0's range, rank 1's and rank 2's
       5 * 4 + key_bytes(1, "w") + key_bytes(2, "w")},     // whole keys (rank 2's only 5 wanted)
      {"w", 0, 60, at::kFloat, 60 * 4},                    // all verified: the ranges
      {"b", 0, 37, at::kFloat, key_bytes(0, "b") + key_bytes(1, "b")},
      {"b", 12, 2, at::kBFloat16, 2 * 2},
      {"c", 0, 3, at::kFloat, key_bytes(2, "c")},
  };
  for (const bool verify_first : {true, false}) {
    CAPTURE(verify_first);
    CheckpointReader reader(dir.path, verify_first);
    reader.open_all();  // headers only: no data
    REQUIRE(reader.bytes_read() == 0);
    uint64_t total = 0;
    for (const Step& s : steps) {
      CAPTURE(s.tensor, s.begin, s.numel);
      at::Tensor out = sentinel({s.numel}, s.dtype);
      reader.read(s.tensor, s.begin, out);
      total += uint64_t(s.bytes);
      REQUIRE(reader.bytes_read() == total);
      REQUIRE(same_bytes(out, expected(s.tensor, s.begin, {s.numel}, s.dtype)));
    }
  }
}

TEST_CASE("CheckpointReader: a corrupted key is an Error naming the file and tensor; the out keeps its values") {
  TempDir dir;
  write_checkpoint(dir.path);
  const fs::path bad_file = dir.path / rank_file(1);
  corrupt_key(bad_file, "w");  // global elements [25, 40) of "w"
  // Catch2 v2's combined matchers hold their parts by pointer: built where they are used.
  const auto require_names_it = [&](const std::string& message) {
    REQUIRE_THAT(message, Catch::Contains(bad_file.string()) && Catch::Contains("tensor \"w\"") &&
                              Catch::Contains("checksum mismatch"));
  };

  SECTION("verify_before_writing: nothing of a corrupted key reaches the out") {
    CheckpointReader reader(dir.path);
    reader.open_all();  // the size is right: only the checksum finds it
    struct Bad {
      const char* what;
      int64_t begin;
      std::vector<int64_t> shape;
      at::ScalarType dtype;
      int64_t keep_begin, keep_end;  // elements of the out that must keep their values
    };
    const std::vector<Bad> cases = {
        {"part of the key", 27, {3}, at::kFloat, 0, 3},
        {"the whole key, file dtype (the direct read)", 25, {15}, at::kFloat, 0, 15},
        {"the whole key, 2-D", 25, {3, 5}, at::kFloat, 0, 15},
        {"the whole key into double", 25, {15}, at::kDouble, 0, 15},
        // Rank 0's key comes first and is fine; the corrupted key's part and what follows stay.
        {"the whole tensor", 0, {6, 10}, at::kFloat, 25, 60},
    };
    for (int attempt = 0; attempt < 2; ++attempt) {  // a failed key is not remembered as verified
      for (const Bad& c : cases) {
        CAPTURE(attempt, c.what);
        at::Tensor out = sentinel(c.shape, c.dtype);
        require_names_it(error_of([&] { reader.read("w", c.begin, out); }));
        REQUIRE(all_sentinel(out.reshape({-1}).slice(0, c.keep_begin, c.keep_end)));
      }
    }
    // The other keys still read.
    for (const auto& [begin, numel] : std::vector<std::pair<int64_t, int64_t>>{{0, 25}, {40, 20}}) {
      at::Tensor out = sentinel({numel}, at::kFloat);
      reader.read("w", begin, out);
      REQUIRE(same_bytes(out, expected("w", begin, {numel}, at::kFloat)));
    }
    at::Tensor b = sentinel({37}, at::kBFloat16);
    reader.read("b", 0, b);
    REQUIRE(same_bytes(b, expected("b", 0, {37}, at::kBFloat16)));
  }

  SECTION("without verify_before_writing the mismatch is still an Error") {
    CheckpointReader reader(dir.path, /*verify_before_writing=*/false);
    for (const std::vector<int64_t>& shape : {std::vector<int64_t>{15}, std::vector<int64_t>{3}}) {
      CAPTURE(shape);
      at::Tensor out = sentinel(shape, at::kFloat);
      require_names_it(error_of([&] { reader.read("w", 25, out); }));
    }
  }
}

TEST_CASE("CheckpointReader: a truncated, replaced or missing file is an Error naming it") {
  TempDir dir;
  write_checkpoint(dir.path);
  const fs::path file = dir.path / rank_file(2);
  const uint64_t bytes = fs::file_size(file);

  SECTION("truncated: the file and both sizes") {
    fs::resize_file(file, bytes - 3);
    const auto require_names_it = [&](const std::string& message) {
      REQUIRE_THAT(message, Catch::Contains(file.string()) && Catch::Contains("truncated") &&
                                Catch::Contains(std::to_string(bytes)) &&
                                Catch::Contains(std::to_string(bytes - 3)));
    };
    CheckpointReader reader(dir.path);
    require_names_it(error_of([&] { reader.open_all(); }));
    at::Tensor out = sentinel({5}, at::kFloat);
    require_names_it(error_of([&] { reader.read("w", 40, out); }));
    // Files that are whole still read.
    reader.read("w", 0, out);
    REQUIRE(same_bytes(out, expected("w", 0, {5}, at::kFloat)));
  }

  SECTION("replaced by a valid file of another size: both sizes") {
    fs::remove(file);
    write_shard_file(file, {{"c", {3}, 0, at::zeros({3}, at::kFloat)}});
    const uint64_t now = fs::file_size(file);
    REQUIRE(now != bytes);
    CheckpointReader reader(dir.path);
    REQUIRE_THAT(error_of([&] { reader.open_all(); }),
                 Catch::Contains(file.string()) && Catch::Contains(std::to_string(now) + " bytes") &&
                     Catch::Contains("the manifest says " + std::to_string(bytes)));
  }

  SECTION("missing") {
    fs::remove(file);
    CheckpointReader reader(dir.path);
    REQUIRE_THAT(error_of([&] { reader.open_all(); }), Catch::Contains(file.string()));
  }
}

TEST_CASE("write_shard_file: every item's values are 1-D") {
  TempDir dir;
  const fs::path file = dir.path / rank_file(0);
  const std::vector<SaveItem> items = {{"ok", {4}, 0, at::zeros({4}, at::kFloat)},
                                       {"w", {6, 10}, 0, pattern(at::kFloat, {2, 10}, 1)}};
  REQUIRE_THROWS_AS(write_shard_file(file, items), UsageError);
  REQUIRE_THROWS_WITH(write_shard_file(file, items), Catch::Contains("tensor \"w\"") && Catch::Contains("1-D"));
  REQUIRE(!fs::exists(file));  // refused before the file is created
}
