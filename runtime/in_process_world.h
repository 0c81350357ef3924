// N ranks of one process as a c10d backend: each rank's Comm runs over its own ProcessGroup, and
// the collectives meet in shared memory. ZeRO logic (coordinator, reducers, optimizer step) then
// runs at world 1-4 inside one Catch2 binary, through the same Comm wrapper (sequence numbers,
// monitor, store) as on Gloo or NCCL. CPU tensors only.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <type_traits>
#include <memory>
#include <vector>

#include "runtime/comm.h"

namespace zeroshard {

// world_size communicators, rank r at index r, sharing one HashStore (so errors name every rank).
// Collectives are issued without blocking and meet in wait(): as with an asynchronous backend,
// every rank must issue the same collectives in the same order.
std::vector<std::shared_ptr<Comm>> make_in_process_world(
    int world_size, std::chrono::milliseconds timeout = std::chrono::seconds(60));

// Runs fn(rank) on one thread per rank and returns when all have returned. A rank's exception is
// rethrown here, one that is not a CommError first (the others' are then timeouts of waiting for
// it). Catch2's assertions are not thread-safe: return what to check, assert in the caller.
void run_ranks(int world_size, const std::function<void(int)>& fn);

// run_ranks over a new world: fn(rank, comm) for each rank, results by rank.
template <typename T>
std::vector<T> run_in_process_world(int world_size,
                                    const std::function<T(int, std::shared_ptr<Comm>)>& fn) {
  static_assert(!std::is_same_v<T, bool>, "vector<bool> packs bits: ranks would race on one word");
  auto comms = make_in_process_world(world_size);
  std::vector<T> results(static_cast<size_t>(world_size));
  run_ranks(world_size, [&](int rank) { results[size_t(rank)] = fn(rank, comms[size_t(rank)]); });
  return results;
}

}  // namespace zeroshard
