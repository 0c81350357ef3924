// The warning channel; see log.h.
#include "runtime/log.h"

#include <cstdio>
#include <mutex>

#include "kernels/warn.h"

namespace zeroshard {
namespace {
std::mutex sink_mutex;
std::function<void(const std::string&)>& sink() {
  // Leaked: a sink that holds a Python callable must not be destroyed after the interpreter.
  static auto* s = new std::function<void(const std::string&)>();
  return *s;
}

void forward_kernel_warning(const char* message) { warn(message); }
}  // namespace

void warn(const std::string& message) {
  std::function<void(const std::string&)> to;
  {
    std::lock_guard<std::mutex> lock(sink_mutex);
    to = sink();
  }
  if (to) {
    to(message);
  } else {
    std::fprintf(stderr, "[zeroshard] warning: %s\n", message.c_str());
  }
}

void set_warning_sink(std::function<void(const std::string&)> s) {
  // kernels/ cannot include this file: its warnings come here from the first sink on.
  static std::once_flag kernels_forwarded;
  std::call_once(kernels_forwarded, [] { kernels::set_warning_handler(&forward_kernel_warning); });
  std::lock_guard<std::mutex> lock(sink_mutex);
  sink() = std::move(s);
}

}  // namespace zeroshard
