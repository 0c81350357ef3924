// The in-process world (runtime/in_process_world.cpp): every collective the Comm wrapper issues,
// at world 1-4, with ranks as threads; and a rank that never issues ends the others' wait with
// the monitor's timeout error instead of a hang.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include "runtime/error.h"
#include "runtime/in_process_world.h"

using namespace zeroshard;

namespace {
at::Tensor ramp(int64_t n, double from) {
  return at::arange(n, at::kFloat).add_(from);
}
}  // namespace

TEST_CASE("collectives over the in-process world match their definitions at world 1-4") {
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const int64_t n = 6;
    auto results = run_in_process_world<std::vector<at::Tensor>>(
        world, [&](int rank, std::shared_ptr<Comm> comm) {
          std::vector<at::Tensor> out;
          at::Tensor sum = ramp(n, rank);
          comm->all_reduce(sum, "sum").wait();
          at::Tensor max = ramp(n, 10.0 * rank);
          comm->all_reduce_max(max, "max").wait();
          at::Tensor root = ramp(n, 100.0 * rank);
          comm->broadcast(root, world - 1, "broadcast").wait();
          at::Tensor gathered = at::zeros({n * world});
          at::Tensor mine = ramp(n, rank);
          comm->all_gather(gathered, mine, "gather").wait();
          at::Tensor in = ramp(n * world, rank);
          at::Tensor part = at::zeros({n});
          comm->reduce_scatter(part, in, "scatter").wait();
          at::Tensor buffer = ramp(n * world, rank);
          comm->reduce_scatter_in_place(buffer, "in place").wait();
          comm->barrier("end");
          return std::vector<at::Tensor>{sum, max, root, gathered, part,
                                         buffer.narrow(0, rank * n, n)};
        });
    at::Tensor want_sum = at::zeros({n});
    at::Tensor want_scatter = at::zeros({n * world});
    for (int r = 0; r < world; ++r) {
      want_sum += ramp(n, r);
      want_scatter += ramp(n * world, r);
    }
    for (int r = 0; r < world; ++r) {
      CAPTURE(r);
      const auto& got = results[size_t(r)];
      REQUIRE(at::equal(got[0], want_sum));
      REQUIRE(at::equal(got[1], ramp(n, 10.0 * (world - 1))));
      REQUIRE(at::equal(got[2], ramp(n, 100.0 * (world - 1))));
      for (int q = 0; q < world; ++q) REQUIRE(at::equal(got[3].narrow(0, q * n, n), ramp(n, q)));
      REQUIRE(at::equal(got[4], want_scatter.narrow(0, r * n, n)));
      REQUIRE(at::equal(got[5], want_scatter.narrow(0, r * n, n)));
    }
  }
}

TEST_CASE("collectives may be waited in any order, as with an asynchronous backend") {
  auto results = run_in_process_world<std::vector<double>>(3, [](int rank, std::shared_ptr<Comm> comm) {
    at::Tensor a = at::full({2}, double(rank));
    at::Tensor b = at::full({2}, 10.0 * rank);
    CommWork first = comm->all_reduce(a, "first");
    CommWork second = comm->all_reduce(b, "second");
    (rank == 1 ? first : second).wait();
    (rank == 1 ? second : first).wait();
    return std::vector<double>{a[0].item<double>(), b[0].item<double>()};
  });
  for (const auto& r : results) REQUIRE((r == std::vector<double>{3.0, 30.0}));
}

TEST_CASE("point-to-point messages arrive in order") {
  auto results = run_in_process_world<std::vector<double>>(2, [](int rank, std::shared_ptr<Comm> comm) {
    std::vector<double> got;
    if (rank == 0) {
      for (int i = 0; i < 3; ++i) comm->send(at::full({4}, double(i)), 1, 0, "activation").wait();
    } else {
      for (int i = 0; i < 3; ++i) {
        at::Tensor t = at::empty({4});
        comm->recv(t, 0, 0, "activation").wait();
        got.push_back(t[3].item<double>());
      }
    }
    return got;
  });
  REQUIRE((results[1] == std::vector<double>{0.0, 1.0, 2.0}));
}

TEST_CASE("a rank that never issues ends the others' wait with an error naming the collective") {
  auto comms = make_in_process_world(2, std::chrono::milliseconds(300));
  at::Tensor t = at::ones({3});
  CHECK_THROWS_AS(comms[0]->all_reduce(t, "gradient bucket 0").wait(), CommError);
  CHECK_THROWS_WITH(comms[0]->all_reduce(t, "gradient bucket 1").wait(),
                    Catch::Contains("gradient bucket 1") && Catch::Contains("rank 1"));
}
