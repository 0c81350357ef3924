// NVMe residency (offload_optimizer.device and offload_param.device "nvme"): a rank's swap space
// (its directory, its I/O engine and the host buffers regions are staged in) and the files that
// hold, per shard part, each sub-group's fp32 master and optimizer state, or, per parameter group
// at stage 3, each parameter chunk (param_swap.h). A sub-group or chunk is one region of its file:
// a header block, the values, then each state slot, each padded to the direct-I/O alignment, so
// one read brings the whole region into one buffer and one write takes it back. The header (a
// magic, the region, the number of its last write) is checked on every read: a file truncated or
// rewritten under the run is an error, never zeros taken for state.
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "offload/aio_engine.h"
#include "offload/swap_dir.h"
#include "runtime/config/config.h"
#include "runtime/host_pool.h"
#include "zero/sub_groups.h"

namespace zeroshard {

// A region's header block (magic, region, write number), before its values.
constexpr int64_t kSwapHeaderBytes = kDirectAlignment;

// One region's bytes in its file, and what a staging buffer holding it is: the header, then the
// values (`value_bytes`) and each of `slots` state slots, each padded to the direct-I/O alignment.
// The memory planner (python/zeroshard/planner) reads it through _C.layout.
inline int64_t swap_region_bytes(int64_t value_bytes, int64_t slots) {
  return kSwapHeaderBytes + align_up(value_bytes) * (1 + slots);
}

// What a staging buffer of `staging_bytes` takes from the host pool: one alignment's slack, as
// host allocators align to less than a page.
inline int64_t staging_allocation_bytes(int64_t staging_bytes) { return staging_bytes + kDirectAlignment; }

// The first `bytes` of `base` (a flat uint8 CPU tensor of at least bytes + kDirectAlignment)
// from its first address aligned for direct I/O.
at::Tensor aligned_for_direct_io(const at::Tensor& base, int64_t bytes);

// What one offload block says about its swap space.
struct SwapSettings {
  std::string nvme_path;
  std::string key;         // the nvme_path key, for errors: "zero_optimization.offload_...nvme_path"
  int64_t buffer_count = 0;
  bool pipeline_read = false, pipeline_write = false;
};
SwapSettings optimizer_swap_settings(const Config& config);
SwapSettings param_swap_settings(const Config& config);

class SwapSpace {
 public:
  // The directory under settings.nvme_path (checked: a clear error names the key) and an engine
  // with the `aio` block's settings; staging buffers come from `pool`.
  SwapSpace(const SwapSettings& settings, const AioConfig& aio, int rank, HostPool& pool);
  // The optimizer's: offload_optimizer's settings.
  SwapSpace(const Config& config, int rank, HostPool& pool);
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  AioEngine& engine() { return *engine_; }
  SwapDir& dir() { return *dir_; }
  // The settings' buffer_count, pipeline_read, pipeline_write.
  int64_t buffer_count() const { return buffer_count_; }
  bool pipeline_read() const { return pipeline_read_; }
  bool pipeline_write() const { return pipeline_write_; }
  // "io_uring: ..." or "libaio: ...": the engine in use and why.
  std::string backend() const;
  // A staging buffer, `staging_bytes()` long (one size for every part, so the pool holds at
  // most the buffers in use at once), whose data starts on an address aligned for direct I/O;
  // give it back with release().
  at::Tensor acquire();
  int64_t staging_bytes() const { return staging_bytes_; }
  // A part's largest sub-group region: the staging size covers it.
  void note_region(int64_t bytes) { staging_bytes_ = std::max(staging_bytes_, bytes); }
  void release(const at::Tensor& buffer);

 private:
  HostPool& pool_;
  std::unique_ptr<SwapDir> dir_;
  std::unique_ptr<AioEngine> engine_;
  int64_t buffer_count_;
  bool pipeline_read_, pipeline_write_;
  int64_t staging_bytes_ = kDirectAlignment;
  std::vector<std::pair<at::Tensor, at::Tensor>> lent_;  // (aligned view, pool buffer)
};

// One shard part's sub-groups (or one group's parameter chunks) in one file.
class SwappedPart {
 public:
  // `sub_groups`: the part's, in order, ranges in the owned range; `slots`: optimizer state
  // tensors per element; `dtype`: of the values and state. The file is named `name` in the
  // space's directory; not yet allocated. `unit` names a region in errors.
  SwappedPart(SwapSpace& space, const std::string& name, const std::vector<SubGroup>& sub_groups, size_t slots,
              at::ScalarType dtype = at::kFloat, std::string unit = "sub-group");
  ~SwappedPart();
  SwappedPart(const SwappedPart&) = delete;
  SwappedPart& operator=(const SwappedPart&) = delete;

  int64_t file_bytes() const { return file_bytes_; }
  size_t slots() const { return slots_; }
  // Reserves the file's bytes on disk (the caller checked the space for every part first).
  void preallocate();
  // Bytes of a staging buffer that holds any of this part's sub-groups.
  int64_t max_region_bytes() const;
  // Starts reading the sub-group that begins at `begin` into `buffer`: its master, and its state
  // when has_state(begin) (else the caller fills the state views with their initial value). A
  // write of the sub-group still in flight is waited for first, so a read sees the last write.
  AioEngine::Handle read(int64_t begin, const at::Tensor& buffer);
  // Starts writing the sub-group back from `buffer`: its master, and its state when `with_state`
  // (has_state(begin) is true from then on). The write stays the sub-group's pending one until
  // settle() or the next read or write of it waits for it (raising its IoError, if any).
  AioEngine::Handle write(int64_t begin, const at::Tensor& buffer, bool with_state);
  void settle(int64_t begin);
  // Counts the writes of the sub-group made outside the step (store) and the state being dropped:
  // a staging buffer kept from an earlier step is current only while this has not changed.
  int64_t generation(int64_t begin) const { return region(begin).generation; }
  // Synchronously, through one staging buffer: the sub-group's master and `state` (its state on
  // disk, else filled with `init`) read into host tensors, or written from them (the state only
  // when `state` is not empty).
  void load(int64_t begin, const at::Tensor& master, const std::vector<at::Tensor>& state, double init);
  void store(int64_t begin, const at::Tensor& master, const std::vector<at::Tensor>& state);
  // Views into a staging buffer of the sub-group's master (slot -1) and state slots, in dtype.
  at::Tensor view(const at::Tensor& buffer, int64_t begin, int64_t slot) const;
  // After a read into `buffer` completed: an IoError naming the file and offset unless the
  // buffer holds the sub-group's last write.
  void check(int64_t begin, const at::Tensor& buffer) const;
  bool has_state(int64_t begin) const;
  // The state on disk is stale (the shard dropped its state): reads give the master only.
  void forget_state();

 private:
  static constexpr int64_t kHeaderBytes = kSwapHeaderBytes;
  struct Header {
    char magic[8] = {'Z', 'S', 'S', 'W', 'A', 'P', '0', '1'};
    int64_t begin = 0, sequence = 0;
  };
  struct Region {
    int64_t begin = 0, numel = 0, offset = 0, slot_bytes = 0;
    int64_t sequence = 0;  // writes so far
    bool has_state = false;
    AioEngine::Handle pending;  // the last write, until waited for
    int64_t generation = 0;
    std::string lost;  // the error of a write that failed: the region holds nothing usable
  };
  const Region& region(int64_t begin) const;
  Region& region_mut(int64_t begin);
  void settle(Region& r);

  SwapSpace& space_;
  std::unique_ptr<DirectFile> file_;
  std::vector<Region> regions_;  // by begin
  size_t slots_;
  at::ScalarType dtype_;
  std::string unit_;
  int64_t file_bytes_ = 0;
};

}  // namespace zeroshard
