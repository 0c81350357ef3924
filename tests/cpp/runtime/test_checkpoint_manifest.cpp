// The checkpoint manifest (runtime/checkpoint/manifest.cpp): partial manifests merged across
// ranks, the JSON round trip, read plans for any global range, and the errors a load gives for
// a newer version, missing fields and pieces that do not tile a tensor.
// With ATen included, Catch2's CHECK is shadowed by c10's: only REQUIRE here.
#include <catch2/catch.hpp>

#include "checkpoint_helpers.h"
#include "runtime/error.h"

using namespace zeroshard;
using namespace zeroshard::checkpoint;
using namespace zs_test;
using nlohmann::json;

namespace zeroshard::checkpoint {
// For Catch's failure messages (c10 prints vectors element by element).
std::ostream& operator<<(std::ostream& out, const ReadStep& s) {
  return out << "{" << s.file << " " << s.key << " [" << s.file_begin << ", " << s.file_end << ") -> " << s.dest_offset << "}";
}
}  // namespace zeroshard::checkpoint

namespace {

FileChecksums fake_sums(uint64_t bytes, std::map<std::string, uint32_t> keys) {
  return {bytes, uint32_t(bytes * 2654435761u), std::move(keys)};
}

// Tensor "w" of 10 elements: [0, 4) in rank0's file, [4, 10) in rank1's; "s" a scalar on rank 0.
Manifest two_rank_manifest() {
  Manifest rank0;
  rank0.add_file("rank0.safetensors", fake_sums(100, {{"w", 0x11u}, {"s", 0x22u}}));
  rank0.add_piece("w", {2, 5}, "F32", "rank0.safetensors", "w", 0, 4);
  rank0.add_piece("s", {}, "I64", "rank0.safetensors", "s", 0, 1);
  rank0.set_section("config", {{"train_batch_size", 8}});
  Manifest rank1;
  rank1.add_file("rank1.safetensors", fake_sums(200, {{"w", 0x33u}}));
  rank1.add_piece("w", {2, 5}, "F32", "rank1.safetensors", "w", 4, 10);
  rank1.add_piece("empty", {0}, "BF16", "rank1.safetensors", "w", 0, 0);
  Manifest merged = Manifest::parse(rank1.to_json(), "rank 1's manifest");  // as rank 0 receives it
  merged.merge(rank0);
  merged.validate_complete("test");
  return merged;
}

json valid_json() { return two_rank_manifest().to_json(); }

}  // namespace

TEST_CASE("manifest: ranks' partial manifests merge, round trip through JSON, and keep checksums") {
  const Manifest m = two_rank_manifest();
  REQUIRE(m.files().size() == 2);
  REQUIRE(m.tensor("w").pieces.size() == 2);
  REQUIRE(m.tensor("w").pieces[0].file == "rank0.safetensors");  // sorted by begin
  REQUIRE(m.tensor("s").numel() == 1);
  REQUIRE(m.tensor("empty").numel() == 0);
  REQUIRE(m.section("config")["train_batch_size"] == 8);

  const json j = m.to_json();
  REQUIRE(j["format_version"] == 1);
  Manifest back = Manifest::parse(j, "round trip");
  back.validate_complete("round trip");
  REQUIRE(back.to_json() == j);
  const FileChecksums sums = back.file_checksums("rank0.safetensors");
  REQUIRE(sums.file_bytes == 100);
  REQUIRE(sums.file_crc32c == uint32_t(100 * 2654435761u));
  REQUIRE(sums.tensor_crc32c == std::map<std::string, uint32_t>{{"w", 0x11u}, {"s", 0x22u}});
  REQUIRE_THROWS_WITH(back.tensor("v"), Catch::Contains("no tensor \"v\""));
  REQUIRE_THROWS_WITH(back.section("layout"), Catch::Contains("no section \"layout\""));
}

TEST_CASE("manifest: plan_read names the file ranges for any global range") {
  const Manifest m = two_rank_manifest();
  struct Want {
    int64_t begin, end;
    std::vector<ReadStep> steps;
  };
  const std::string f0 = "rank0.safetensors", f1 = "rank1.safetensors";
  const std::vector<Want> wants = {
      {0, 10, {{f0, "w", 0, 4, 0}, {f1, "w", 0, 6, 4}}},
      {3, 5, {{f0, "w", 3, 4, 0}, {f1, "w", 0, 1, 1}}},
      {4, 4, {}},
      {5, 9, {{f1, "w", 1, 5, 0}}},
      {0, 4, {{f0, "w", 0, 4, 0}}},
      {9, 10, {{f1, "w", 5, 6, 0}}},
  };
  for (const auto& want : wants) {
    INFO("[" << want.begin << ", " << want.end << ")");
    REQUIRE(m.plan_read("w", want.begin, want.end) == want.steps);
  }
  REQUIRE(m.plan_read("empty", 0, 0).empty());
  REQUIRE_THROWS_AS(m.plan_read("w", 8, 11), UsageError);
  REQUIRE_THROWS_WITH(m.plan_read("w", 8, 11), Catch::Contains("outside [0, 10)"));
}

TEST_CASE("manifest: a newer format version is refused, saying which version this build reads") {
  json j = valid_json();
  j["format_version"] = 2;
  REQUIRE_THROWS_AS(Manifest::parse(j, "ckpt/manifest.json"), Error);
  REQUIRE_THROWS_WITH(Manifest::parse(j, "ckpt/manifest.json"),
                      Catch::Contains("ckpt/manifest.json") && Catch::Contains("format version 2") &&
                          Catch::Contains("reads (version 1 and older)"));
  j.erase("format_version");
  REQUIRE_THROWS_WITH(Manifest::parse(j, "x"), Catch::Contains("no format_version"));
}

TEST_CASE("manifest: missing and mistyped fields are named, all in one error") {
  json j = valid_json();
  j["files"][1].erase("crc32c");
  j["tensors"][0].erase("dtype");
  j["tensors"][1]["pieces"][0].erase("end");
  j["tensors"][1]["shape"] = "2x5";
  j.erase("sections");
  const std::string name0 = j["tensors"][0]["name"], name1 = j["tensors"][1]["name"];
  REQUIRE_THROWS_AS(Manifest::parse(j, "m"), Error);
  REQUIRE_THROWS_WITH(Manifest::parse(j, "m"),
                      Catch::Contains("missing fields: files[1].crc32c, tensors[0] (\"" + name0 + "\").dtype, tensors[1] (\"" +
                                      name1 + "\").pieces[0].end, sections") &&
                          Catch::Contains("bad fields: tensors[1] (\"" + name1 + "\").shape: got \"2x5\", expected a list"));
  json bad_crc = valid_json();
  bad_crc["files"][0]["crc32c"] = 1234;
  REQUIRE_THROWS_WITH(Manifest::parse(bad_crc, "m"), Catch::Contains("files[0].crc32c: got 1234, expected 8 hex digits"));
  json outside = valid_json();
  outside["files"][0]["name"] = "../elsewhere.safetensors";
  REQUIRE_THROWS_WITH(Manifest::parse(outside, "m"), Catch::Contains("not a name inside the checkpoint directory"));
}

TEST_CASE("manifest: pieces must tile each tensor exactly once, or the tensor is named") {
  struct Bad {
    const char* what;
    std::vector<std::pair<int64_t, int64_t>> pieces;
    const char* message;
  };
  const std::vector<Bad> cases = {
      {"gap", {{0, 4}, {5, 10}}, "leave elements [4, 5) uncovered"},
      {"short", {{0, 4}, {4, 9}}, "leave elements [9, 10) uncovered"},
      {"no start", {{2, 10}}, "leave elements [0, 2) uncovered"},
      {"overlap", {{0, 6}, {4, 10}}, "elements [4, 6) are in two pieces"},
      {"twice", {{0, 10}, {0, 10}}, "elements [0, 10) are in two pieces"},
      {"past the end", {{0, 4}, {4, 11}}, "piece [4, 11) (f.safetensors) is outside [0, 10)"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    Manifest m;
    m.add_file("f.safetensors", fake_sums(10, {{"a", 1}}));
    for (auto [begin, end] : c.pieces) m.add_piece("layer.weight", {10}, "F32", "f.safetensors", "a", begin, end);
    m.add_piece("fine", {2}, "F32", "f.safetensors", "a", 0, 2);
    REQUIRE_THROWS_AS(m.validate_complete("ckpt"), Error);
    REQUIRE_THROWS_WITH(m.validate_complete("ckpt"), Catch::Contains("tensor \"layer.weight\"") && Catch::Contains(c.message));
    // The same through a load: the JSON form is refused the same way.
    REQUIRE_THROWS_WITH(Manifest::parse(m.to_json(), "ckpt").validate_complete("ckpt"), Catch::Contains(c.message));
  }
  json no_pieces = valid_json();
  no_pieces["tensors"][0]["pieces"] = json::array();
  REQUIRE_THROWS_WITH(Manifest::parse(no_pieces, "m").validate_complete("m"),
                      Catch::Contains("tensor \"w\": its pieces leave elements [0, 10) uncovered"));
  json unlisted = valid_json();
  for (size_t i = 0; i < unlisted["files"].size(); ++i)
    if (unlisted["files"][i]["name"] == "rank1.safetensors") unlisted["files"].erase(i);
  REQUIRE_THROWS_WITH(Manifest::parse(unlisted, "m").validate_complete("m"),
                      Catch::Contains("in file \"rank1.safetensors\", which the manifest does not list"));
}

TEST_CASE("manifest: building mistakes are UsageErrors naming the tensor or file") {
  Manifest m;
  REQUIRE_THROWS_WITH(m.add_piece("w", {4}, "F32", "f.safetensors", "w", 0, 4),
                      Catch::Contains("must be added (add_file) before its pieces"));
  m.add_file("f.safetensors", fake_sums(10, {{"w", 1}}));
  REQUIRE_THROWS_WITH(m.add_file("f.safetensors", fake_sums(10, {})), Catch::Contains("added twice"));
  REQUIRE_THROWS_WITH(m.add_file("/abs.safetensors", fake_sums(10, {})), Catch::Contains("must be relative"));
  REQUIRE_THROWS_WITH(m.add_piece("w", {4}, "F32", "f.safetensors", "v", 0, 4), Catch::Contains("has no key \"v\""));
  m.add_piece("w", {4}, "F32", "f.safetensors", "w", 0, 2);
  REQUIRE_THROWS_AS(m.add_piece("w", {5}, "F32", "f.safetensors", "w", 2, 4), UsageError);
  REQUIRE_THROWS_WITH(m.add_piece("w", {4}, "BF16", "f.safetensors", "w", 2, 4), Catch::Contains("F32 [4] in one piece and BF16 [4]"));
  REQUIRE_THROWS_WITH(m.save("/nonexistent"), Catch::Contains("before validate_complete"));
  Manifest other;
  other.add_file("f.safetensors", fake_sums(10, {}));
  REQUIRE_THROWS_WITH(m.merge(other), Catch::Contains("\"f.safetensors\" is written twice"));
}

TEST_CASE("manifest: real shard files, resharded on read through plan_read, and a damaged manifest") {
  TempDir dir;
  const Named tensors = model_tensors(3);
  save_two_rank_checkpoint(dir.path, "global_step7", tensors, true, 7);
  const fs::path ckpt_dir = dir.path / "global_step7";
  REQUIRE(same_tensors(load_checkpoint(ckpt_dir), tensors));

  // A third of "block.0.weight" as a rank of a 3-way run would own it: the range crosses files.
  const Manifest m = Manifest::load(ckpt_dir / kManifestFileName);
  REQUIRE(m.section("training_state")["global_steps"] == 7);
  const at::Tensor full = tensors[2].second.reshape({-1});
  const int64_t third = full.numel() / 3;
  at::Tensor mine = at::empty({third}, full.options());
  const auto steps = m.plan_read("block.0.weight", third, 2 * third);
  REQUIRE(steps.size() == 2);
  for (const auto& s : steps)
    SafetensorsReader(ckpt_dir / s.file).read_range(s.key, s.file_begin, s.file_end,
                                                    mine.slice(0, s.dest_offset, s.dest_offset + s.file_end - s.file_begin));
  REQUIRE(same_bytes(mine, full.slice(0, third, 2 * third)));

  const std::string text = read_bytes(ckpt_dir / kManifestFileName);
  write_bytes(ckpt_dir / kManifestFileName, text.substr(0, text.size() / 2));
  REQUIRE_THROWS_WITH(Manifest::load(ckpt_dir / kManifestFileName),
                      Catch::Contains("manifest.json is not valid JSON") && Catch::Contains("damaged"));
}
