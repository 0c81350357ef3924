// The warning and information channels; see log.h.
#include "runtime/log.h"

#include <cstdio>
#include <mutex>

#include "kernels/warn.h"

namespace zeroshard {
namespace {
enum Level { kWarning = 0, kInfo = 1 };

std::mutex sink_mutex;
std::function<void(const std::string&)>& sink(Level level) {
  // Leaked: a sink that holds a Python callable must not be destroyed after the interpreter.
  static auto* s = new std::function<void(const std::string&)>[2]();
  return s[level];
}

void forward_kernel_warning(const char* message) { warn(message); }

void emit(Level level, const std::string& message) {
  std::function<void(const std::string&)> to;
  {
    std::lock_guard<std::mutex> lock(sink_mutex);
    to = sink(level);
  }
  if (to) {
    to(message);
  } else if (level == kWarning) {
    std::fprintf(stderr, "[zeroshard] warning: %s\n", message.c_str());
  } else {
    std::fprintf(stdout, "[zeroshard] %s\n", message.c_str());
    std::fflush(stdout);
  }
}
}  // namespace

void warn(const std::string& message) { emit(kWarning, message); }

void info(const std::string& message) { emit(kInfo, message); }

void set_warning_sink(std::function<void(const std::string&)> s) {
  // kernels/ cannot include this file: its warnings come here from the first sink on.
  static std::once_flag kernels_forwarded;
  std::call_once(kernels_forwarded, [] { kernels::set_warning_handler(&forward_kernel_warning); });
  std::lock_guard<std::mutex> lock(sink_mutex);
  sink(kWarning) = std::move(s);
}

namespace {
ProgressSink& progress_sink() {
  static auto* s = new ProgressSink();  // leaked, as the other sinks
  return *s;
}
}  // namespace

void progress(const std::string& what, int64_t done, int64_t total) {
  ProgressSink to;
  {
    std::lock_guard<std::mutex> lock(sink_mutex);
    to = progress_sink();
  }
  if (to) to(what, done, total);
}

void set_progress_sink(ProgressSink s) {
  std::lock_guard<std::mutex> lock(sink_mutex);
  progress_sink() = std::move(s);
}

void set_info_sink(std::function<void(const std::string&)> s) {
  std::lock_guard<std::mutex> lock(sink_mutex);
  sink(kInfo) = std::move(s);
}

}  // namespace zeroshard
