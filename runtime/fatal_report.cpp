// See fatal_report.h.
#include "runtime/fatal_report.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <typeinfo>

#include <cxxabi.h>

namespace zeroshard {

namespace {

struct Registry {
  std::mutex mutex;
  std::map<int, FatalReporter> reporters;
  int next_id = 0;
  std::terminate_handler previous = nullptr;
  bool installed = false;
};

// Never destroyed: a terminate during static destruction must still find it.
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

std::atomic<bool> reporting{false};
std::atomic<std::thread::id> reporting_thread{};

[[noreturn]] void on_terminate() {
  Registry& r = registry();
  // Only the first thread to terminate reports; any other waits here for the abort.
  if (!reporting.exchange(true)) {
    reporting_thread = std::this_thread::get_id();
    const std::string cause = current_exception_text();
    {
      // Held while reporting: a reporter's owner being destroyed meanwhile (the process exiting
      // on another thread) waits in remove_fatal_reporter instead of freeing what is in use.
      std::lock_guard<std::mutex> lock(r.mutex);
      for (auto& [id, report] : r.reporters) {
        try {
          report(cause);
        } catch (...) {
        }
      }
    }
    std::fflush(nullptr);  // every stdio stream: abort() flushes none
    if (r.previous != nullptr && r.previous != on_terminate) r.previous();
    std::abort();
  }
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace

int add_fatal_reporter(FatalReporter reporter) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!r.installed) {
    r.previous = std::set_terminate(on_terminate);
    r.installed = true;
  }
  const int id = r.next_id++;
  r.reporters.emplace(id, std::move(reporter));
  return id;
}

void remove_fatal_reporter(int id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.reporters.erase(id);
}

bool another_thread_is_terminating() {
  return reporting.load() && reporting_thread.load() != std::this_thread::get_id();
}

std::string current_exception_text() {
  std::exception_ptr current = std::current_exception();
  if (!current) return "no exception";
  std::string type = "unknown exception";
  if (const std::type_info* t = abi::__cxa_current_exception_type()) {
    int status = 0;
    char* demangled = abi::__cxa_demangle(t->name(), nullptr, nullptr, &status);
    type = status == 0 && demangled != nullptr ? demangled : t->name();
    std::free(demangled);
  }
  try {
    std::rethrow_exception(current);
  } catch (const std::exception& e) {
    return type + ": " + e.what();
  } catch (...) {
    return type;
  }
}

}  // namespace zeroshard
