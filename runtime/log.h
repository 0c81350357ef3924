// The runtime's one channel for warnings: a sink that the Python package points at its logger
// (zeroshard.log), standard error until then or once Python is gone. Never for errors: those
// are thrown (runtime/error.h). kernels/ warnings (kernels/warn.h) come here once a sink is set.
#pragma once
#include <functional>
#include <string>

namespace zeroshard {

// "[zeroshard] warning: rank 0: ..." through the sink; callable from any thread.
void warn(const std::string& message);
// Replaces the sink (nullptr: standard error again). The sink must not throw.
void set_warning_sink(std::function<void(const std::string&)> sink);

}  // namespace zeroshard
