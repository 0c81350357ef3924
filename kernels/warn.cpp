// The kernels' warning hook; see warn.h.
#include "kernels/warn.h"

#include <atomic>
#include <cstdio>

namespace zeroshard::kernels {
namespace {
// Constant-initialised, so a handler installed from any static initialiser is never lost.
std::atomic<WarningHandler> g_handler{nullptr};
}  // namespace

void set_warning_handler(WarningHandler handler) { g_handler.store(handler); }

void warn(const char* message) {
  if (const WarningHandler handler = g_handler.load()) {
    handler(message);
  } else {
    // The same line runtime/log.cpp prints when it has no sink.
    std::fprintf(stderr, "[zeroshard] warning: %s\n", message);
  }
}

}  // namespace zeroshard::kernels
