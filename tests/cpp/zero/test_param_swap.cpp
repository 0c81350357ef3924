// Parameter chunks on NVMe (zero/param_swap.cpp) against real files in a temp directory, with a
// FlatGroup whose chunk store is reserved memory: after start nothing but persistent chunks is in
// host memory (accounted, and as the kernel reports the store's pages); held chunks read back
// their values; the step's new values reach chunks on disk and in memory, whole or in part;
// max_in_cpu bounds what stays after a hold ends, least recently used leaving first; reads
// started ahead never win over newer values and share the staging buffers (never more than
// buffer_count lent); a hold that fails (a write error while making room) is not left held, and
// one ended twice is named; a file rewritten under the run is an IoError naming it; buffer_size
// must hold the largest chunk.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/host_pool.h"
#include "runtime/memory.h"
#include "offload/aio_engine.h"
#include "zero/flat_group.h"
#include "zero/param_swap.h"

using namespace zeroshard;
namespace fs = std::filesystem;

namespace {

// Three tensors of 5000, 300 and 12000 elements in bf16 at world 1: chunks of the same sizes.
const std::vector<int64_t> kNumels{5000, 300, 12000};

struct Fixture {
  fs::path dir;
  MemoryAccount memory;
  HostPool pool{false, c10::Device(c10::kCPU), memory};
  std::vector<at::Tensor> values;
  std::unique_ptr<FlatGroup> group;
  std::unique_ptr<ParamSwap> swap;

  explicit Fixture(int64_t max_in_cpu, std::vector<bool> persistent = {false, false, false},
                   int64_t buffer_size = 100000, int64_t buffers = 2) {
    char tmpl[] = "/tmp/zs-param-swap-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    dir = tmpl;
    for (size_t i = 0; i < kNumels.size(); ++i) {
      values.push_back(at::arange(kNumels[i], at::kFloat).remainder(251) + float(i));
    }
    GroupSpec spec;
    spec.model_dtype = at::kBFloat16;
    spec.partition_params = true;
    spec.params_on_host = true;
    spec.params_on_nvme = true;
    group = std::make_unique<FlatGroup>(values, spec, memory);
    Config c;
    c.zero_optimization.stage = 3;
    c.zero_optimization.offload_param.device = "nvme";
    c.zero_optimization.offload_param.nvme_path = dir.string();
    c.zero_optimization.offload_param.buffer_count = buffers;
    c.zero_optimization.offload_param.buffer_size = buffer_size;
    c.zero_optimization.offload_param.max_in_cpu = max_in_cpu;
    swap = std::make_unique<ParamSwap>(c, 0, pool, memory);
    swap->start({group.get()}, {persistent});
  }
  ~Fixture() {
    swap.reset();
    group.reset();
    fs::remove_all(dir);
  }
  at::Tensor chunk(int64_t t) const {
    return group->params().narrow(0, group->chunk_layout().local_offsets[size_t(t)], kNumels[size_t(t)]);
  }
  // The tensor's values as the store holds them (bf16), read while held.
  at::Tensor read(int64_t t) {
    swap->hold(0, {t});
    at::Tensor out = chunk(t).clone();
    swap->unhold(0, {t}, false);
    return out;
  }
  int64_t host_bytes() const { return memory.bytes(MemoryCategory::host_parameters); }
  // Values for the whole store (17300 elements), and tensor t's part of them.
  static at::Tensor fresh(float k) { return (at::arange(17300, at::kFloat).remainder(97) * k - 40).to(at::kBFloat16); }
  at::Tensor part(const at::Tensor& all, int64_t t) const {
    return all.narrow(0, group->chunk_layout().local_offsets[size_t(t)], kNumels[size_t(t)]);
  }
};

}  // namespace

TEST_CASE("after start the chunks are on disk only, and a hold reads them back") {
  Fixture f(0);
  CHECK(f.swap->counters().resident_numel == 0);
  CHECK(f.host_bytes() == 0);
  // Each chunk may share a page at either end with a neighbour (at most 4 boundary pages).
  CHECK(f.swap->mapped_bytes() <= 4 * 4096);
  CHECK(f.swap->counters().writes == 3);
  for (int64_t t = 0; t < 3; ++t) CHECK(at::equal(f.read(t), f.values[size_t(t)].to(at::kBFloat16)));
  f.swap->trim();
  CHECK(f.swap->counters().resident_numel == 0);
  CHECK(f.host_bytes() == 0);
  CHECK(f.swap->counters().writes == 3);  // read and left unchanged: dropped, not written again
  CHECK(f.swap->mapped_bytes() <= 4 * 4096);
}

TEST_CASE("the step's new values reach chunks on disk and in host memory, whole or in part") {
  Fixture f(0);
  const int64_t total = 5000 + 300 + 12000;
  // Chunk 1 in host memory (held), chunks 0 and 2 on disk; new values for all of them.
  f.swap->hold(0, {1});
  const at::Tensor fresh = (at::arange(total, at::kFloat).remainder(97) - 40).to(at::kBFloat16);
  f.swap->store(0, 0, fresh);
  f.swap->unhold(0, {1}, false);
  for (int64_t t = 0; t < 3; ++t) {
    CHECK(at::equal(f.read(t), fresh.narrow(0, f.group->chunk_layout().local_offsets[size_t(t)], kNumels[size_t(t)])));
  }
  // A store that covers the end of chunk 0, chunk 1 and the start of chunk 2: chunks 0 and 2
  // are read first, so their other parts keep their values.
  const at::Tensor part = at::full({1000}, 3.0f, at::kBFloat16);
  f.swap->store(0, 4700, part);
  at::Tensor want = fresh.clone();
  want.narrow(0, 4700, 1000).fill_(3.0f);
  for (int64_t t = 0; t < 3; ++t) {
    CHECK(at::equal(f.read(t), want.narrow(0, f.group->chunk_layout().local_offsets[size_t(t)], kNumels[size_t(t)])));
  }
  f.swap->trim();  // the last one read leaves at the next trim (unhold never writes)
  CHECK(f.swap->counters().resident_numel == 0);
}

TEST_CASE("max_in_cpu bounds what stays in host memory, least recently used leaving first") {
  Fixture f(12300);
  f.swap->hold(0, {0, 1});
  CHECK(f.swap->counters().resident_numel == 5300);
  CHECK(f.host_bytes() == 5300 * 2);
  f.swap->unhold(0, {0, 1}, false);
  f.swap->trim();
  CHECK(f.swap->counters().resident_numel == 5300);  // they fit
  const int64_t reads = f.swap->counters().reads;
  f.read(1);  // resident: no read, and 1 is now more recently used than 0
  CHECK(f.swap->counters().reads == reads);
  f.swap->hold(0, {2});
  CHECK(f.swap->counters().resident_numel == 17300);  // the 5300 not held still fit
  f.swap->unhold(0, {2}, true);
  f.swap->trim();  // 17300 not held: 0, the least recently used, leaves
  CHECK(f.swap->counters().resident_numel == 12300);
  CHECK(f.host_bytes() == 12300 * 2);
  CHECK(f.swap->counters().peak_resident_numel == 17300);
  f.read(1);
  f.read(2);
  CHECK(f.swap->counters().reads == reads + 1);  // 2's own first read only
  f.read(0);
  CHECK(f.swap->counters().reads == reads + 2);
}

TEST_CASE("persistent chunks stay in host memory and never go to disk") {
  Fixture f(0, {false, true, false});
  CHECK(f.swap->counters().resident_numel == 300);
  CHECK(f.swap->counters().persistent_numel == 300);
  CHECK(f.swap->counters().writes == 2);
  CHECK(at::equal(f.read(1), f.values[1].to(at::kBFloat16)));
  CHECK(f.swap->counters().reads == 0);
}

TEST_CASE("hold_all brings every chunk in; unhold_all(written) sends changed ones back") {
  Fixture f(0);
  f.swap->hold_all();
  CHECK(f.swap->all_held());
  CHECK(f.swap->counters().resident_numel == 17300);
  f.chunk(2).fill_(5.0f);
  f.swap->unhold_all(true);
  f.swap->trim();
  CHECK(f.swap->counters().resident_numel == 0);
  CHECK(at::equal(f.read(2), at::full({12000}, 5.0f, at::kBFloat16)));
}

TEST_CASE("a file rewritten under the run is an IoError naming it; buffer_size must hold a chunk") {
  {
    Fixture f(0);
    f.swap->settle();
    std::string file;
    for (const auto& entry : fs::recursive_directory_iterator(f.dir)) {
      if (entry.path().extension() == ".swp") file = entry.path().string();
    }
    REQUIRE(!file.empty());
    const int fd = ::open(file.c_str(), O_WRONLY);
    REQUIRE(fd >= 0);
    const std::vector<char> zeros(4096, 0);
    REQUIRE(::pwrite(fd, zeros.data(), zeros.size(), 0) == 4096);
    ::fsync(fd);
    ::close(fd);
    CHECK_THROWS_WITH(f.swap->hold(0, {0}), Catch::Contains(file) && Catch::Contains("parameter chunk at offset 0"));
    CHECK(f.swap->counters().resident_numel == 0);
  }
  CHECK_THROWS_WITH(Fixture(0, {false, false, false}, 4096),
                    Catch::Contains("zero_optimization.offload_param.buffer_size: got 4096") &&
                        Catch::Contains("12000"));
}

TEST_CASE("reads started ahead never win over newer values, and share the staging buffers") {
  SECTION("a whole store over reads in flight") {
    Fixture f(0);
    f.swap->prefetch(0, {0, 1, 2});
    CHECK(f.swap->counters().prefetched == 2);  // two buffers
    const at::Tensor v = Fixture::fresh(1);
    f.swap->store(0, 0, v);
    for (int64_t t = 0; t < 3; ++t) CHECK(at::equal(f.read(t), f.part(v, t)));
  }
  SECTION("a partial store over a read in flight keeps the rest of the chunk") {
    Fixture f(0);
    f.swap->prefetch(0, {0});
    f.swap->store(0, 100, at::full({50}, 7.0f, at::kBFloat16));
    at::Tensor want = f.values[0].to(at::kBFloat16);
    want.narrow(0, 100, 50).fill_(7.0f);
    CHECK(at::equal(f.read(0), want));
    f.swap->trim();
    CHECK(f.swap->counters().resident_numel == 0);
  }
  SECTION("a hold while every buffer holds a read in flight") {
    Fixture f(0);
    f.swap->prefetch(0, {0, 2});
    for (int64_t t : {1, 0, 2}) CHECK(at::equal(f.read(t), f.values[size_t(t)].to(at::kBFloat16)));
    CHECK(f.swap->counters().peak_lent <= 2);
  }
  SECTION("one buffer: writes in flight, stores whole and in part, reads ahead") {
    Fixture f(0, {false, false, false}, 100000, 1);
    f.swap->hold(0, {2});
    f.chunk(2).fill_(9.0f);
    f.swap->unhold(0, {2}, true);
    f.swap->trim();  // its write is in flight
    const at::Tensor v = Fixture::fresh(2);
    f.swap->store(0, 0, v);
    f.swap->prefetch(0, {0, 1, 2});
    f.swap->store(0, 5000, v.narrow(0, 5000, 300));
    f.swap->hold(0, {0, 1, 2});  // more chunks than buffers
    for (int64_t t = 0; t < 3; ++t) CHECK(at::equal(f.chunk(t), f.part(v, t)));
    f.swap->unhold(0, {0, 1, 2}, false);
    f.swap->trim();
    CHECK(f.swap->counters().resident_numel == 0);
    CHECK(f.host_bytes() == 0);
    CHECK(f.swap->counters().peak_lent == 1);
  }
}

TEST_CASE("a hold that fails is not left held, and a hold ended twice is named") {
  SECTION("a write error while making room") {
    Fixture f(0, {false, false, false}, 100000, 1);
    f.swap->hold_all();
    f.swap->unhold_all(true);  // all three changed and in host memory; none has left yet
    f.swap->engine().inject_fault(parse_aio_fault("eio:write:1", "test"));
    // Chunk 1 needs no read; making room writes 0 and 2 out, and the first write fails.
    CHECK_THROWS_WITH(f.swap->hold(0, {1}), Catch::Contains("Input/output error"));
    try {
      f.swap->settle();
    } catch (const Error&) {
    }
    f.swap->trim();  // 1 is held by nobody: it leaves (the failed chunk is lost until rewritten)
    CHECK(f.swap->counters().resident_numel == 0);
  }
  SECTION("an end without a hold") {
    Fixture f(0);
    f.read(0);
    f.swap->unhold(0, {0}, false);
    CHECK_THROWS_WITH(f.swap->hold(0, {1}), Catch::Contains("group 0 tensor 0 ended more often than it began"));
  }
}
