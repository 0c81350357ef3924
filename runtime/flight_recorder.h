// A small per-rank ring of the most recent collectives (sequence number, description, state), kept
// so that a failure message can say what this rank did just before it got stuck.
#pragma once
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace zeroshard {

class FlightRecorder {
 public:
  enum class State { in_flight, done, failed };
  struct Entry {
    uint64_t seq = 0;
    std::string description;
    State state = State::in_flight;
  };

  explicit FlightRecorder(size_t capacity = 8);

  void started(uint64_t seq, const std::string& description);
  // Marks the entry with this sequence number, if it is still in the ring.
  void finished(uint64_t seq, bool ok = true);

  // Oldest first; at most capacity() entries.
  std::vector<Entry> recent() const;
  // "#55 all_reduce(...) done, #56 all_gather(...) in flight"; "none" when empty.
  std::string summary() const;
  size_t capacity() const { return ring_.size(); }

 private:
  mutable std::mutex mutex_;  // wait() may run on another thread than the issuing one
  std::vector<Entry> ring_;
  uint64_t count_ = 0;  // entries ever recorded; the next goes to ring_[count_ % capacity]
};

const char* flight_state_name(FlightRecorder::State state);

}  // namespace zeroshard
