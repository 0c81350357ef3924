// ZeRO-3's per-parameter gathering (zero/param_gatherer.cpp) in one process at world 1-4, without
// modules: reference counts, persistent parameters, the batched and the direct all-gather,
// prefetch, the reuse rule under the live cap, write-back from a modifier rank, overwrite and
// the refresh after a step.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/in_process_world.h"
#include "runtime/memory.h"
#include "zero/flat_group.h"
#include "zero/param_gatherer.h"

using namespace zeroshard;

namespace {

// Trainable 0-4, then frozen 5-6. Under kPersistence elements (1, 3, 6) stay whole; 4 is large
// enough for an all-gather of its own.
const std::vector<int64_t> kNumels = {15, 7, 16, 1, (int64_t(1) << 20) + 5, 9, 3};
constexpr int64_t kTrainable = 5;
constexpr int64_t kPersistence = 8;
constexpr int64_t kBig = 4;

at::Tensor initial(size_t i) {
  return at::linspace(-1.0, 1.0, kNumels[i], at::kFloat).mul_(double(i + 1));
}

// One rank's storage (a trainable and a frozen group, partitioned) and the Parameters.
struct Setup {
  MemoryAccount memory;
  std::unique_ptr<FlatGroup> trainable, frozen;
  std::vector<at::Tensor> params;
};

std::unique_ptr<Setup> make_setup(const Comm& comm) {
  auto s = std::make_unique<Setup>();
  GroupSpec spec;
  spec.world_size = comm.world_size();
  spec.rank = comm.rank();
  spec.shard_state = true;
  spec.full_grads = false;
  spec.partition_params = true;
  std::vector<at::Tensor> a, b;
  for (size_t i = 0; i < kNumels.size(); ++i) (int64_t(i) < kTrainable ? a : b).push_back(initial(i));
  s->trainable = std::make_unique<FlatGroup>(a, spec, s->memory);
  spec.trainable = false;
  s->frozen = std::make_unique<FlatGroup>(b, spec, s->memory);
  for (size_t i = 0; i < kNumels.size(); ++i) s->params.push_back(initial(i));
  return s;
}

ZeroConfig config(int64_t max_live_numel) {
  ZeroConfig c;
  c.stage3_param_persistence_threshold = kPersistence;
  c.stage3_max_live_parameters = max_live_numel;
  return c;
}

// What one rank saw: each Parameter's size (0 while released), the live count, and whether the
// gathered bytes the memory account holds agree with it.
struct Seen {
  const Setup& s;
  const ParamGatherer& g;
  std::vector<int64_t> out;
  void sizes() {
    for (const auto& p : s.params) out.push_back(p.numel());
    out.push_back(g.counters().live_numel);
    out.push_back(s.memory.bytes(MemoryCategory::gathered_parameters) == g.counters().live_numel * 4);
  }
  void push(int64_t x) { out.push_back(x); }
};

// Gathers and releases by reference count, with and without prefetch; persistent parameters
// stay whole throughout.
std::vector<int64_t> counting(int, std::shared_ptr<Comm> comm) {
  auto s = make_setup(*comm);
  ParamGatherer g({s->trainable.get(), s->frozen.get()}, comm, config(int64_t(1) << 40), s->memory);
  Seen seen{*s, g, {}};
  for (int64_t i = 0; i < int64_t(kNumels.size()); ++i) {
    seen.push(g.param(i).persistent);
    seen.push(g.param(i).frozen);
  }
  g.attach(s->params);
  seen.sizes();                                  // persistent ones whole, the rest released
  seen.push(at::equal(s->params[1], initial(1)) && at::equal(s->params[6], initial(6)));
  g.fetch_params({0, 0, kBig});                  // two references to 0
  seen.sizes();
  seen.push(at::equal(s->params[0], initial(0)) && at::equal(s->params[kBig], initial(kBig)));
  g.release_params({0});
  seen.sizes();                                  // 0 keeps its second reference
  g.release_params({0, kBig});
  seen.sizes();
  seen.push(g.counters().peak_live_numel);
  g.reset_peak();
  seen.push(g.counters().peak_live_numel);
  // Prefetched: whole (in flight) and counted before any reference; the fetch waits for it.
  g.prefetch({2, 5});
  seen.push(g.whole(2) && g.whole(5) && !g.whole(0));
  seen.push(g.counters().live_numel);
  seen.push(g.counters().prefetched_ahead_numel);
  g.fetch_params({2});
  seen.push(g.counters().prefetched_ahead_numel);  // 5 is still ahead
  seen.sizes();                                  // 5 in flight: live, its Parameter still empty
  seen.push(at::equal(s->params[2], initial(2)));
  // The end of a forward without autograd: what nothing references goes, 2 stays.
  g.release_unreferenced();
  seen.sizes();
  seen.push(g.counters().prefetched_ahead_numel);  // 5 was dropped unused
  g.prefetch({0});
  g.release_all();                               // the end of an iteration: every reference too
  seen.sizes();
  g.release_params({2});                         // a reference release_all forgot: nothing
  seen.sizes();
  seen.push(g.counters().prefetched_params);
  seen.push(g.counters().peak_live_numel);
  return seen.out;
}

// Released parameters the reuse rule keeps stay gathered within the cap, and go first when a
// gather needs the room.
std::vector<int64_t> reuse(int, std::shared_ptr<Comm> comm) {
  auto s = make_setup(*comm);
  const int64_t cap = kNumels[0] + kNumels[2];
  auto soon = [](int64_t i) { return i == 0 || i == 2 || i == 5; };
  ParamGatherer g({s->trainable.get(), s->frozen.get()}, comm, config(cap), s->memory, {}, soon);
  Seen seen{*s, g, {}};
  g.attach(s->params);
  g.fetch_params({0});
  g.release_params({0});
  seen.sizes();                                  // kept: reused soon, within the cap
  g.fetch_params({2});
  g.release_params({2});
  seen.sizes();                                  // kept: exactly at the cap
  seen.push(g.room_numel());
  g.fetch_params({5});                           // makes room: 0 goes, 2 is enough
  seen.sizes();
  seen.push(g.room_numel());
  g.fetch_params({kBig});                        // alone over the cap: everything kept goes
  seen.sizes();
  seen.push(g.room_numel());
  g.release_params({5, kBig});                   // over the cap: 5 is not kept either
  seen.sizes();
  g.fetch_params({5});
  g.release_params({5});
  seen.sizes();                                  // back under the cap: kept
  g.release_all();
  seen.sizes();
  return seen.out;
}

// Values in: a modifier rank's edit, safe_set_full_fp32_param's overwrite (also of a gather in
// flight), and persistent parameters refreshed after a step (frozen ones never change).
std::vector<int64_t> values(int rank, std::shared_ptr<Comm> comm) {
  auto s = make_setup(*comm);
  ParamGatherer g({s->trainable.get(), s->frozen.get()}, comm, config(int64_t(1) << 40), s->memory);
  Seen seen{*s, g, {}};
  const int modifier = comm->world_size() - 1;
  g.attach(s->params);
  g.fetch_params({0, kBig});
  s->params[0].detach().mul_(double(rank + 2));  // every rank edits; the modifier's edit stays
  s->params[kBig].detach().mul_(double(rank + 2));
  g.write_back(0, modifier);
  g.write_back(kBig, modifier);
  g.release_params({0, kBig});
  g.fetch_params({0, kBig});
  seen.push(at::equal(s->params[0], initial(0).mul(double(modifier + 2))));
  seen.push(at::equal(s->params[kBig], initial(kBig).mul(double(modifier + 2))));
  g.release_params({0, kBig});
  int64_t threw = 0;
  try {
    g.write_back(0);
  } catch (const std::exception&) {
    threw = 1;  // released: nothing to write back
  }
  seen.push(threw);
  const at::Tensor two = at::full({kNumels[2]}, 2.0f), three = at::full({kNumels[0]}, 3.0f);
  g.prefetch({2});
  g.overwrite(2, two);                           // the gather in flight lands first
  seen.push(at::equal(s->params[2], two));
  g.overwrite(0, three);                         // not gathered: the chunks only
  seen.sizes();
  g.fetch_params({0, 2});
  seen.push(at::equal(s->params[0], three) && at::equal(s->params[2], two));
  g.release_params({0, 2});
  // A step wrote the chunks of every parameter; persistent ones take the trainable values.
  const at::Tensor one = at::ones({kNumels[1]}), six = at::ones({kNumels[6]});
  s->trainable->write_tensor(1, one);
  s->frozen->write_tensor(1, six);
  seen.push(at::equal(s->params[1], initial(1)));
  g.refresh_persistent();
  seen.push(at::equal(s->params[1], one));
  seen.push(at::equal(s->params[6], initial(6)));
  seen.sizes();
  return seen.out;
}

// Sizes with nothing but the persistent parameters gathered, then live and the memory check.
std::vector<int64_t> at_rest() {
  return {0, kNumels[1], 0, kNumels[3], 0, 0, kNumels[6], 0, 1};
}

// at_rest() with the given parameters gathered too, and that live count.
std::vector<int64_t> with(const std::vector<size_t>& gathered) {
  std::vector<int64_t> v = at_rest();
  int64_t live = 0;
  for (size_t i : gathered) {
    v[i] = kNumels[i];
    live += kNumels[i];
  }
  v[kNumels.size()] = live;
  return v;
}

void append(std::vector<int64_t>& to, const std::vector<int64_t>& more) {
  to.insert(to.end(), more.begin(), more.end());
}

void check(const std::function<std::vector<int64_t>(int, std::shared_ptr<Comm>)>& scenario,
           const std::vector<int64_t>& want) {
  for (int world = 1; world <= 4; ++world) {
    CAPTURE(world);
    const auto got = run_in_process_world<std::vector<int64_t>>(world, scenario);
    for (int rank = 0; rank < world; ++rank) {
      CAPTURE(rank);
      REQUIRE(got[size_t(rank)] == want);
    }
  }
}

}  // namespace

TEST_CASE("the gatherer gathers by reference count and prefetches at world 1-4") {
  const int64_t a = kNumels[0], big = kNumels[kBig], c = kNumels[2], f = kNumels[5];
  std::vector<int64_t> want = {0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1};  // persistent, frozen
  append(want, at_rest());
  want.push_back(1);
  append(want, with({0, kBig}));
  want.push_back(1);
  append(want, with({0, kBig}));
  append(want, at_rest());
  append(want, {a + big, 0});                     // the peak, then reset
  append(want, {1, c + f, c + f, f});             // prefetched: whole, live, ahead; 2 fetched
  std::vector<int64_t> in_flight = with({2, 5});
  in_flight[5] = 0;
  append(want, in_flight);
  want.push_back(1);
  append(want, with({2}));
  want.push_back(0);
  append(want, at_rest());
  append(want, at_rest());
  append(want, {3, a + c});                       // parameters prefetched, peak since the reset
  check(counting, want);
}

TEST_CASE("the gatherer keeps what the reuse rule names within the cap at world 1-4") {
  const int64_t a = kNumels[0], c = kNumels[2], f = kNumels[5], big = kNumels[kBig];
  std::vector<int64_t> want;
  append(want, with({0}));
  append(want, with({0, 2}));
  want.push_back(0);
  append(want, with({2, 5}));
  want.push_back(a - f);
  append(want, with({5, kBig}));
  want.push_back(a + c - f - big);
  append(want, at_rest());
  append(want, with({5}));
  append(want, at_rest());
  check(reuse, want);
}

TEST_CASE("the gatherer writes values back, overwrites and refreshes at world 1-4") {
  std::vector<int64_t> want = {1, 1, 1, 1};
  append(want, with({2}));
  append(want, {1, 1, 1, 1});
  append(want, at_rest());
  check(values, want);
}
