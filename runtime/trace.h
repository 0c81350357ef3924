// The runtime's timeline: spans (a collective from issue to completion, a wait that blocked the
// caller, a gather, a copy, a disk transfer, an optimizer sub-group's step) and counters (bytes by
// memory category) on the monotonic clock Python's time.monotonic_ns() also reads, recorded only
// while a trace is on. zeroshard/observe/trace.py adds the module and pipeline spans and writes
// the Chrome trace. Off, every recording site costs one relaxed atomic load.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard::trace {

struct Event {
  char phase = 'X';      // Chrome trace phases: 'X' a span, 'C' a counter sample
  std::string category;  // "comm", "wait", "gather", "copy", "io", "step", ...
  std::string name;
  int64_t start_ns = 0;
  int64_t duration_ns = 0;
  int track = 0;         // the recording thread's small number (thread_track())
  std::string args;      // a JSON object's members without braces: "\"seq\": 3, \"bytes\": 4096"
};

// CLOCK_MONOTONIC in nanoseconds (std::chrono::steady_clock on Linux).
int64_t now_ns();
// This thread's track: 0 for the first thread that asks (Python's main thread, in practice),
// then 1, 2, ... in the order threads first record.
int track();

bool on();
// Starts recording (drops what an earlier trace left); at most max_events are kept, later ones
// are counted in dropped() instead, so a trace left on cannot grow without bound.
void start(int64_t max_events);
void stop();
int64_t dropped();
// Everything recorded since start(), oldest first; the buffer is emptied.
std::vector<Event> drain();

void span(const char* category, std::string name, int64_t start_ns, int64_t end_ns,
          std::string args = {});

// The per-phase timers (wall_clock_breakdown): while timing is on, each collective's wait adds
// the time it blocked its caller to that thread's total, which the engine reads around backward
// to split it into compute and exposed reduction.
void set_timing(bool on);
bool timing();
void add_blocked_ns(int64_t ns);
int64_t blocked_ns();  // this thread's total since the process started
void counter(std::string name, std::string args);

// Records a span from construction to destruction when tracing was on at construction.
// `describe()` returns the span's name, or {name, args}; it runs only then, so a site whose
// name is built from numbers costs one relaxed atomic load while tracing is off.
class Scope {
 public:
  template <class Describe>
  Scope(const char* category, Describe&& describe) : category_(category) {
    if (!on()) return;
    set(describe());
    start_ns_ = now_ns();
  }
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  void set(std::string name) { name_ = std::move(name); }
  void set(std::pair<std::string, std::string> described) {
    name_ = std::move(described.first);
    args_ = std::move(described.second);
  }

  const char* category_;
  std::string name_;
  std::string args_;
  int64_t start_ns_ = -1;  // -1: not recording
};

}  // namespace zeroshard::trace
