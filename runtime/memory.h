// Byte accounting of model state per rank. Every buffer the runtime allocates for model state is
// registered here by category, so the log line and the memory tests read one source of truth.
#pragma once
#include <array>
#include <cstdint>
#include <string>

namespace zeroshard {

enum class MemoryCategory : int {
  parameters = 0,     // the model's own (16-bit or fp32) parameter storage held by this rank
  gradients,          // gradient storage held by this rank
  master_weights,     // fp32 master copy (mixed precision only)
  optimizer_state,    // optimizer moments / accumulators
  gathered_parameters,// ZeRO-3: parameters gathered for compute, released after use
  comm_buffers,       // staging buffers for gradient reduction (not model state)
  // Host memory (CPU offload). On a CPU-only run host and device are the same memory, but the
  // offloaded state is still a separate copy, accounted here.
  host_parameters,    // ZeRO-3 parameter chunks held in host memory (offload_param)
  host_master_weights,// fp32 master copy in host memory (offload_optimizer)
  host_optimizer_state,
  host_buffers,       // the host staging pool: gradients down, updated parameters up
  count
};

const char* memory_category_name(MemoryCategory c);
// Whether a category counts host memory (the host_* ones) rather than the device's.
bool on_host(MemoryCategory c);
// The host category that holds what `c` holds on the device (parameters -> host_parameters ...);
// `c` itself when it is a host category.
MemoryCategory host_category(MemoryCategory c);

class MemoryAccount {
 public:
  void add(MemoryCategory c, int64_t bytes);
  void release(MemoryCategory c, int64_t bytes);
  int64_t bytes(MemoryCategory c) const { return current_[idx(c)]; }
  int64_t peak_bytes(MemoryCategory c) const { return peak_[idx(c)]; }
  // Device bytes (every category but the host_* ones), and host bytes.
  int64_t total_bytes() const;
  int64_t host_total_bytes() const;
  int64_t peak_total_bytes() const { return peak_total_; }
  void reset_peaks();
  // "parameters=1.2MB gradients=..." for log lines; host categories after "| host".
  std::string summary() const;
  // Every category's bytes now, as one counter sample of the trace (runtime/trace.h); add and
  // release take one while a trace is on.
  void trace_sample() const;

 private:
  static size_t idx(MemoryCategory c) { return static_cast<size_t>(c); }
  std::array<int64_t, size_t(MemoryCategory::count)> current_{};
  std::array<int64_t, size_t(MemoryCategory::count)> peak_{};
  int64_t peak_total_ = 0;
};

std::string format_bytes(int64_t bytes);

}  // namespace zeroshard
