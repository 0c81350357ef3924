// See flight_recorder.h.
#include "runtime/flight_recorder.h"

#include "runtime/error.h"

namespace zeroshard {

const char* flight_state_name(FlightRecorder::State state) {
  switch (state) {
    case FlightRecorder::State::in_flight: return "in flight";
    case FlightRecorder::State::done: return "done";
    case FlightRecorder::State::failed: return "failed";
  }
  return "?";
}

FlightRecorder::FlightRecorder(size_t capacity) : ring_(capacity) {
  ZS_CHECK(capacity > 0, "FlightRecorder: capacity must be at least 1, got 0");
}

void FlightRecorder::started(uint64_t seq, const std::string& description) {
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = ring_[count_ % ring_.size()];
  e.seq = seq;
  e.description = description;
  e.state = State::in_flight;
  ++count_;
}

void FlightRecorder::finished(uint64_t seq, bool ok) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t held = count_ < ring_.size() ? count_ : ring_.size();
  for (uint64_t i = 0; i < held; ++i) {
    Entry& e = ring_[(count_ - 1 - i) % ring_.size()];
    if (e.seq == seq) {
      e.state = ok ? State::done : State::failed;
      return;
    }
  }
}

std::vector<FlightRecorder::Entry> FlightRecorder::recent() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t held = count_ < ring_.size() ? count_ : ring_.size();
  std::vector<Entry> out;
  out.reserve(held);
  for (uint64_t i = count_ - held; i < count_; ++i) out.push_back(ring_[i % ring_.size()]);
  return out;
}

std::string FlightRecorder::summary() const {
  std::string out;
  for (const Entry& e : recent()) {
    if (!out.empty()) out += ", ";
    out += detail::cat("#", e.seq, " ", e.description, " ", flight_state_name(e.state));
  }
  return out.empty() ? "none" : out;
}

}  // namespace zeroshard
