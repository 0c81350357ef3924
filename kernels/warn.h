// The kernels' one channel for warnings (a bad ZEROSHARD_CPU_ISA or ZEROSHARD_CPU_THREADS value).
// kernels/ sits below runtime/ and cannot include its logger, so runtime/log.cpp installs a
// handler that forwards to zeroshard::warn; until one is installed, standard error.
#pragma once

namespace zeroshard::kernels {

// Gets the message without a prefix or newline. Must not throw; may be called from any thread.
using WarningHandler = void (*)(const char* message);

// Replaces the handler (nullptr: standard error again).
void set_warning_handler(WarningHandler handler);
void warn(const char* message);

}  // namespace zeroshard::kernels
