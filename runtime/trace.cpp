// See trace.h. One mutex-guarded event store (event_store.h: outside malloc's heap): spans come
// from the compute thread and the backends' completion callbacks, a few thousand per step at most,
// so a lock per event costs far less than the work each event describes.
#include "runtime/trace.h"

#include <atomic>
#include <chrono>
#include <mutex>

#include "runtime/event_store.h"

namespace zeroshard::trace {

namespace {

std::atomic<bool> g_on{false};
std::atomic<int> g_next_track{0};
std::atomic<int64_t> g_dropped{0};
std::mutex g_mutex;
int64_t g_max_events = 0;  // guarded by g_mutex

EventStore& store() {  // guarded by g_mutex; never destroyed: a callback may record during exit
  static EventStore* const the_store = new EventStore();
  return *the_store;
}

void record(char phase, const char* category, const std::string& name, int64_t start_ns,
            int64_t duration_ns, const std::string& args) {
  const int my_track = track();
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_on.load(std::memory_order_relaxed)) return;  // stopped since the caller looked
  // Over max_events, or no memory to map for it: counted, never thrown (a Scope's destructor and
  // the backends' callbacks record).
  if (store().size() >= g_max_events ||
      !store().append(phase, category, name, start_ns, duration_ns, my_track, args)) {
    g_dropped.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int track() {
  thread_local const int mine = g_next_track.fetch_add(1);
  return mine;
}

bool on() { return g_on.load(std::memory_order_relaxed); }

void start(int64_t max_events) {
  std::lock_guard<std::mutex> lock(g_mutex);
  store().clear();
  g_max_events = max_events;
  g_dropped.store(0);
  g_on.store(true);
}

void stop() { g_on.store(false); }

int64_t dropped() { return g_dropped.load(); }

std::vector<Event> drain() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return store().take();
}

void span(const char* category, std::string name, int64_t start_ns, int64_t end_ns,
          std::string args) {
  if (!on()) return;
  record('X', category, name, start_ns, end_ns - start_ns, args);
}

void counter(std::string name, std::string args) {
  if (!on()) return;
  record('C', "memory", name, now_ns(), 0, args);
}

namespace {
std::atomic<bool> g_timing{false};
thread_local int64_t t_blocked_ns = 0;
}  // namespace

void set_timing(bool on) { g_timing.store(on); }
bool timing() { return g_timing.load(std::memory_order_relaxed); }
void add_blocked_ns(int64_t ns) { t_blocked_ns += ns; }
int64_t blocked_ns() { return t_blocked_ns; }

Scope::~Scope() {
  if (start_ns_ >= 0) span(category_, std::move(name_), start_ns_, now_ns(), std::move(args_));
}

}  // namespace zeroshard::trace
