// The runtime's channels for warnings and for information it prints (the comms logger's verbose
// lines): sinks that the Python package points at its logger (zeroshard.log), standard error and
// standard output until then or once Python is gone. Never for errors: those are thrown
// (runtime/error.h). kernels/ warnings (kernels/warn.h) come here once a sink is set.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace zeroshard {

// "[zeroshard] warning: rank 0: ..." through the sink; callable from any thread.
void warn(const std::string& message);
// "[zeroshard] ..." through the information sink; callable from any thread.
void info(const std::string& message);
// Replace the sinks (nullptr: standard error / output again). A sink must not throw.
void set_warning_sink(std::function<void(const std::string&)> sink);
void set_info_sink(std::function<void(const std::string&)> sink);

// Long work's progress (NVMe files written at start): `done` of `total` steps of `what`, through
// a sink the Python package points at its progress bars (rank 0 draws them); nothing without one.
using ProgressSink = std::function<void(const std::string& what, int64_t done, int64_t total)>;
void progress(const std::string& what, int64_t done, int64_t total);
void set_progress_sink(ProgressSink sink);

}  // namespace zeroshard
