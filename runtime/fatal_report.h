// Last words when the process is about to die in std::terminate. A backend can end a rank from
// one of its own threads, where no caller can catch anything: Gloo's I/O thread throws when a
// peer sends more bytes than the collective expects (the ranks' collectives differ), and the
// exception escapes into std::terminate. Each registered reporter (one per communicator) then
// gets the exception's message, so that it can say which collective this rank was in and tell
// the other ranks, before the previous terminate handler aborts the process.
#pragma once
#include <functional>
#include <string>

namespace zeroshard {

// cause: the escaping exception's type and message, or "no exception" when terminate was called
// directly. A reporter must not throw (exceptions are swallowed) and should be quick.
using FatalReporter = std::function<void(const std::string& cause)>;

// Installs the terminate handler on first use. Returns an id for remove_fatal_reporter.
int add_fatal_reporter(FatalReporter reporter);
void remove_fatal_reporter(int id);

// True while another thread of this process is in the terminate handler (the process is about
// to abort): a rank's own failure path then waits for the abort instead of racing it.
bool another_thread_is_terminating();

// The message of the exception being handled in this thread: "<type>: <what>".
std::string current_exception_text();

}  // namespace zeroshard
