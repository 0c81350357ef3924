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
  count
};

const char* memory_category_name(MemoryCategory c);

class MemoryAccount {
 public:
  void add(MemoryCategory c, int64_t bytes);
  void release(MemoryCategory c, int64_t bytes);
  int64_t bytes(MemoryCategory c) const { return current_[idx(c)]; }
  int64_t peak_bytes(MemoryCategory c) const { return peak_[idx(c)]; }
  int64_t total_bytes() const;
  int64_t peak_total_bytes() const { return peak_total_; }
  void reset_peaks();
  // "parameters=1.2MB gradients=..." for log lines.
  std::string summary() const;

 private:
  static size_t idx(MemoryCategory c) { return static_cast<size_t>(c); }
  std::array<int64_t, size_t(MemoryCategory::count)> current_{};
  std::array<int64_t, size_t(MemoryCategory::count)> peak_{};
  int64_t peak_total_ = 0;
};

std::string format_bytes(int64_t bytes);

}  // namespace zeroshard
