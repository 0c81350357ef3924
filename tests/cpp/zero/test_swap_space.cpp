// NVMe residency (zero/swap_space.cpp, zero/swap_pipeline.cpp) against real files in a temp
// directory: a sub-group's region round-trips master and state; a read before any state was
// written gives the initial value; a buffer kept from put() is handed out again without a read
// while the region is unchanged, and read again after a write from outside the step; a region
// rewritten under the run (zeros where its header was) is an IoError naming the file and offset;
// staging buffers never exceed buffer_count.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "runtime/host_pool.h"
#include "runtime/memory.h"
#include "zero/swap_pipeline.h"
#include "zero/swap_space.h"

using namespace zeroshard;
namespace fs = std::filesystem;

namespace {

struct Fixture {
  fs::path dir;
  MemoryAccount memory;
  HostPool pool{false, c10::Device(c10::kCPU), memory};
  std::unique_ptr<SwapSpace> space;
  std::unique_ptr<SwappedPart> part;
  // Sub-groups of 1000, 300 and 2500 elements, two state slots (Adam).
  std::vector<SubGroup> sub_groups{{0, 1000, Residency::nvme}, {1000, 300, Residency::nvme},
                                   {1300, 2500, Residency::nvme}};

  explicit Fixture(int64_t buffer_count) {
    char tmpl[] = "/tmp/zs-swap-space-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    dir = tmpl;
    Config c;
    c.zero_optimization.offload_optimizer.device = "nvme";
    c.zero_optimization.offload_optimizer.nvme_path = dir.string();
    c.zero_optimization.offload_optimizer.buffer_count = buffer_count;
    c.zero_optimization.offload_optimizer.pipeline_read = true;
    c.zero_optimization.offload_optimizer.pipeline_write = true;
    space = std::make_unique<SwapSpace>(c, 0, pool);
    part = std::make_unique<SwappedPart>(*space, "part.swp", sub_groups, 2);
    part->preallocate();
  }
  ~Fixture() {
    part.reset();
    space.reset();
    fs::remove_all(dir);
  }
  // Writes sub-group `sg` from host tensors whose values are `seed` + position.
  void store(const SubGroup& sg, float seed) {
    at::Tensor m = at::arange(sg.numel, at::kFloat) + seed;
    part->store(sg.begin, m, {m + 1, m + 2});
  }
};

}  // namespace

TEST_CASE("a sub-group's region round-trips its master and state, and starts from the initial state") {
  Fixture f(4);
  const SubGroup& sg = f.sub_groups[2];
  at::Tensor master = at::empty({sg.numel}, at::kFloat);
  std::vector<at::Tensor> state{at::empty({sg.numel}, at::kFloat), at::empty({sg.numel}, at::kFloat)};
  // Master only so far: the state reads as its initial value.
  f.part->store(sg.begin, at::full({sg.numel}, 7.0f), {});
  CHECK_FALSE(f.part->has_state(sg.begin));
  f.part->load(sg.begin, master, state, 0.5);
  CHECK(at::equal(master, at::full({sg.numel}, 7.0f)));
  CHECK(at::equal(state[1], at::full({sg.numel}, 0.5f)));
  f.store(sg, 3.0f);
  CHECK(f.part->has_state(sg.begin));
  f.part->load(sg.begin, master, state, 0.5);
  CHECK(at::equal(master, at::arange(sg.numel, at::kFloat) + 3.0f));
  CHECK(at::equal(state[0], at::arange(sg.numel, at::kFloat) + 4.0f));
  CHECK(at::equal(state[1], at::arange(sg.numel, at::kFloat) + 5.0f));
  // The other sub-groups' regions are untouched by it.
  f.store(f.sub_groups[0], 100.0f);
  f.part->load(sg.begin, master, state, 0.5);
  CHECK(at::equal(master, at::arange(sg.numel, at::kFloat) + 3.0f));
}

TEST_CASE("a kept buffer is handed out again without a read until the region is written from outside") {
  Fixture f(4);
  for (const SubGroup& sg : f.sub_groups) f.store(sg, 1.0f);
  SwapPipeline pipe(*f.space);
  const SubGroup& sg = f.sub_groups[1];
  pipe.begin_step();
  at::Tensor buffer = pipe.take(*f.part, sg.begin, 0.0);
  f.part->view(buffer, sg.begin, -1).fill_(42.0f);  // "the update"
  pipe.put(*f.part, sg.begin, buffer);
  pipe.end_step();
  // Kept: the same buffer comes back with the update in it.
  pipe.begin_step();
  at::Tensor again = pipe.take(*f.part, sg.begin, 0.0);
  CHECK(again.data_ptr() == buffer.data_ptr());
  CHECK(at::equal(f.part->view(again, sg.begin, -1), at::full({sg.numel}, 42.0f)));
  pipe.put(*f.part, sg.begin, again);
  pipe.end_step();
  // The disk has it too.
  at::Tensor master = at::empty({sg.numel}, at::kFloat);
  std::vector<at::Tensor> state{at::empty({sg.numel}, at::kFloat), at::empty({sg.numel}, at::kFloat)};
  f.part->load(sg.begin, master, state, 0.0);
  CHECK(at::equal(master, at::full({sg.numel}, 42.0f)));
  // A write from outside the step (a checkpoint load) makes the kept buffer stale: read again.
  f.store(sg, 9.0f);
  pipe.begin_step();
  at::Tensor fresh = pipe.take(*f.part, sg.begin, 0.0);
  CHECK(at::equal(f.part->view(fresh, sg.begin, -1), at::arange(sg.numel, at::kFloat) + 9.0f));
  pipe.put(*f.part, sg.begin, fresh);
  pipe.end_step();
  // So does dropping the state: the state views start from the initial value again.
  f.part->forget_state();
  pipe.begin_step();
  at::Tensor dropped = pipe.take(*f.part, sg.begin, 0.25);
  CHECK(at::equal(f.part->view(dropped, sg.begin, 1), at::full({sg.numel}, 0.25f)));
  pipe.put(*f.part, sg.begin, dropped);
  pipe.end_step();
}

TEST_CASE("staging buffers never exceed buffer_count, and every sub-group survives the eviction") {
  Fixture f(2);
  for (const SubGroup& sg : f.sub_groups) f.store(sg, 0.0f);
  SwapPipeline pipe(*f.space);
  for (int step = 0; step < 3; ++step) {
    pipe.begin_step();
    for (size_t j = 0; j < f.sub_groups.size(); ++j) {
      const SubGroup& sg = f.sub_groups[j];
      at::Tensor b = pipe.take(*f.part, sg.begin, 0.0);
      if (j + 1 < f.sub_groups.size()) pipe.prefetch(*f.part, f.sub_groups[j + 1].begin);
      f.part->view(b, sg.begin, -1).add_(1.0f);
      pipe.put(*f.part, sg.begin, b);
      // One staging size for the space: the pool holds at most buffer_count of it.
      CHECK(f.memory.bytes(MemoryCategory::host_buffers) <=
            2 * (f.space->staging_bytes() + kDirectAlignment));
    }
    pipe.end_step();
  }
  at::Tensor master = at::empty({2500}, at::kFloat);
  std::vector<at::Tensor> state{at::empty({2500}, at::kFloat), at::empty({2500}, at::kFloat)};
  for (const SubGroup& sg : f.sub_groups) {
    f.part->load(sg.begin, master.narrow(0, 0, sg.numel), {state[0].narrow(0, 0, sg.numel), state[1].narrow(0, 0, sg.numel)}, 0.0);
    CHECK(at::equal(master.narrow(0, 0, sg.numel), at::arange(sg.numel, at::kFloat) + 3.0f));
  }
}

TEST_CASE("a region rewritten under the run is an IoError naming the file and the offset") {
  Fixture f(1);
  for (const SubGroup& sg : f.sub_groups) f.store(sg, 0.0f);
  std::string file;
  for (const auto& sub : fs::recursive_directory_iterator(f.dir)) {
    if (sub.path().extension() == ".swp") file = sub.path().string();
  }
  REQUIRE_FALSE(file.empty());
  // Zeros over the second region's first block (its header): what a truncate and a later write
  // elsewhere in the file leave behind.
  const int fd = ::open(file.c_str(), O_WRONLY);
  REQUIRE(fd >= 0);
  std::vector<char> zeros(4096, 0);
  const int64_t second = 4096 + 3 * 4096;  // header + master + two slots of sub-group 0
  REQUIRE(::pwrite(fd, zeros.data(), zeros.size(), second) == 4096);
  ::close(fd);
  at::Tensor master = at::empty({300}, at::kFloat);
  std::vector<at::Tensor> state{at::empty({300}, at::kFloat), at::empty({300}, at::kFloat)};
  CHECK_THROWS_WITH(f.part->load(1000, master, state, 0.0),
                    Catch::Contains(file) && Catch::Contains("offset " + std::to_string(second)) &&
                        Catch::Contains("does not hold what this run wrote"));
}
