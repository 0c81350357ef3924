// The trace's event store: records appended to chunks mapped straight from the kernel (only the
// small chunk index is on malloc's heap). Events outlive the step's tensors; kept on the heap they
// made traced steps slower, we believe by filling the holes freed tensors left (bench/RESULTS.md:
// ZeRO-3 on CPU, world 1, same day, the runtime's recording +10.5% on the heap, -0.7% here).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "runtime/trace.h"

namespace zeroshard::trace {

class EventStore {
 public:
  static constexpr size_t kDefaultChunkBytes = size_t(4) << 20;
  explicit EventStore(size_t chunk_bytes = kDefaultChunkBytes);
  ~EventStore();
  EventStore(const EventStore&) = delete;
  EventStore& operator=(const EventStore&) = delete;

  // Copies the strings into the store; a record larger than a chunk gets a chunk of its own.
  // False when no memory could be mapped for it (nothing kept): a trace never ends the run.
  bool append(char phase, std::string_view category, std::string_view name, int64_t start_ns,
              int64_t duration_ns, int track, std::string_view args);
  int64_t size() const { return count_; }
  int64_t mapped_bytes() const;
  // Every record, oldest first, as Events; the store is emptied and its memory unmapped.
  std::vector<Event> take();
  void clear();

 private:
  struct Chunk {
    char* data;
    size_t bytes;
    size_t used;
  };
  char* reserve(size_t bytes);  // nullptr when mapping failed

  size_t chunk_bytes_;
  std::vector<Chunk> chunks_;  // one entry per chunk: a few, grown rarely
  int64_t count_ = 0;
};

}  // namespace zeroshard::trace
