// Error types shared by every layer. ConfigError is for bad user input (it reaches Python as
// ValueError); Error is for runtime failures (RuntimeError), CommError for collectives that failed
// or timed out (it names the rank, the sequence number and the op).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace zeroshard {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct ConfigError : Error {
  using Error::Error;
};
struct CommError : Error {
  using Error::Error;
};

namespace detail {
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace zeroshard

// Checks an invariant or a user-facing precondition and throws with the message pieces joined.
#define ZS_CHECK(cond, ...)                                                        \
  do {                                                                             \
    if (!(cond)) throw ::zeroshard::Error(::zeroshard::detail::cat(__VA_ARGS__));  \
  } while (0)
