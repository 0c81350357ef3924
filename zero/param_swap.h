// ZeRO-3 parameter chunks on NVMe (offload_param.device "nvme"). Each partitioned group keeps
// its chunk store in reserved host memory (FlatGroup with params_on_nvme: pages exist only where
// written) and one file with a region per chunk. A chunk is brought into host memory before it is
// used (a gather, a checkpoint, a whole-value read or write) and held while used; afterwards it
// stays while the resident chunks nobody holds fit in offload_param.max_in_cpu elements, beyond
// which the least recently used go back to disk (written only when changed since they were read)
// and their pages are given back. Chunks of persistent parameters (whole on every rank, under
// stage3_param_persistence_threshold) stay in host memory and never go to disk. Reads and writes
// pass through at most offload_param.buffer_count staging buffers of one chunk each, so
// offload_param.buffer_size must hold the largest chunk. ParamCoordinator starts reads of the
// chunks its fetch order needs next (prefetch); the optimizer step hands new values to store().
#pragma once
#include <ATen/core/Tensor.h>

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "runtime/config/config.h"
#include "runtime/host_pool.h"
#include "runtime/memory.h"
#include "zero/flat_group.h"
#include "zero/swap_space.h"

namespace zeroshard {

struct ParamSwapCounters {
  int64_t reads = 0, writes = 0;         // chunks read from and written to disk
  int64_t prefetched = 0;                // of the reads, those started ahead by prefetch()
  int64_t peak_lent = 0;                 // most staging buffers lent at once (<= buffer_count)
  int64_t resident_numel = 0;            // chunk elements in host memory (persistent ones too)
  int64_t peak_resident_numel = 0;
  int64_t persistent_numel = 0;          // of them, those that never leave
  double wait_ms = 0.0;                  // waiting for reads and writes
};

class ParamSwap {
 public:
  // The directory under offload_param.nvme_path and the I/O engine (the `aio` block); staging
  // buffers come from `pool`, resident chunks are accounted as host_parameters in `memory`.
  ParamSwap(const Config& config, int rank, HostPool& pool, MemoryAccount& memory);
  ~ParamSwap();
  ParamSwap(const ParamSwap&) = delete;
  ParamSwap& operator=(const ParamSwap&) = delete;

  // The gathered groups (in the gatherer's order; those with params_on_nvme are swapped) and,
  // per group and tensor, whether the tensor is persistent. The chunks hold their first values:
  // disk space is checked for every file, the files are preallocated, every chunk that does not
  // stay is written out and leaves host memory.
  void start(const std::vector<FlatGroup*>& groups, const std::vector<std::vector<bool>>& persistent);
  bool swapped(int64_t group) const;

  // Brings the tensors' chunks into host memory (reads started for all, then waited for) and
  // holds them there until unhold().
  void hold(int64_t group, const std::vector<int64_t>& tensors);
  // Ends holds; `written`: the holder changed the values (they go to disk before they leave).
  // Never throws (an end without a hold is raised by the next hold()); what no longer fits
  // leaves at the next hold(), store() or trim().
  void unhold(int64_t group, const std::vector<int64_t>& tensors, bool written) noexcept;
  // Starts reads of the tensors' chunks that are on disk, while staging buffers are free.
  void prefetch(int64_t group, const std::vector<int64_t>& tensors);
  // New values of the group's owned range [begin, begin + values.numel()) (the step's): copied
  // into resident chunks, written straight to disk for chunks on disk that they cover whole.
  void store(int64_t group, int64_t begin, const at::Tensor& values);
  // Every chunk into host memory and held (checkpoints): all or none, an error leaves none held.
  void hold_all();
  void unhold_all(bool written) noexcept;
  bool all_held() const { return all_held_; }
  // Sends the least recently used chunks nobody holds to disk until the rest fit max_in_cpu.
  void trim();
  // Waits for every write in flight (raising the first one's error).
  void settle();

  const ParamSwapCounters& counters() const { return counters_; }
  // Bytes of the chunk stores' pages in host memory as the kernel reports them (mincore), for
  // the tests that check the accounting.
  int64_t mapped_bytes() const;
  std::string backend() const { return space_->backend(); }
  AioEngine& engine() { return space_->engine(); }

 private:
  struct Chunk {
    int64_t group = 0, tensor = 0, begin = 0, numel = 0;
    bool stays = false, resident = true, dirty = false;
    int64_t holds = 0;
    uint64_t used = 0;                 // when last held: least recently used leave first
    at::Tensor read_buffer;            // a read in flight into it
    AioEngine::Handle reading;
  };
  struct Write {
    SwappedPart* part = nullptr;
    int64_t begin = 0;
    at::Tensor buffer;
  };
  Chunk& chunk(int64_t group, int64_t tensor);
  // The chunk's values in its group's store.
  at::Tensor values(const Chunk& c) const;
  void start_read(Chunk& c);
  // Waits for the chunk's read and copies it into place (or drops it: `keep` false).
  void land(Chunk& c, bool keep = true);
  void write_out(Chunk& c, const at::Tensor& from);
  void evict(Chunk& c);
  void set_resident(Chunk& c, bool resident);
  // A staging buffer, retiring writes (or landing reads) to stay within buffer_count.
  at::Tensor acquire_buffer();
  void retire_oldest_write();
  int64_t lent() const;

  std::unique_ptr<SwapSpace> space_;
  MemoryAccount& memory_;
  int64_t max_in_cpu_, buffer_size_;
  std::vector<FlatGroup*> groups_;
  std::vector<std::unique_ptr<SwappedPart>> parts_;    // by group; null where not swapped
  std::vector<std::vector<Chunk>> chunks_;             // by group, by tensor
  std::deque<Write> writes_;                           // in flight, oldest first
  int64_t reads_in_flight_ = 0;
  uint64_t clock_ = 0;
  bool all_held_ = false;
  std::string unbalanced_;  // a chunk whose holds ended more often than they began
  ParamSwapCounters counters_;
};

}  // namespace zeroshard
