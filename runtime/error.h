// The error family shared by every layer, mapped at the Python edge (python/csrc/module.cpp):
//   UsageError  (ValueError)   the caller's input is wrong: a config key, an argument, a tensor;
//   ConfigError (ValueError)   a UsageError in the ds_config, named by its key path;
//   CommError   (RuntimeError) a collective failed or timed out (names the rank, number and op);
//   Error       (RuntimeError) something the caller asked cannot be done in this state;
//   InternalError (RuntimeError) a broken invariant: a bug in zeroshard, and says so.
// ZS_REQUIRE checks the caller's input, ZS_CHECK an invariant.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace zeroshard {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct UsageError : Error {
  using Error::Error;
};
struct ConfigError : UsageError {
  using UsageError::UsageError;
};
struct CommError : Error {
  using Error::Error;
};
struct InternalError : Error {
  explicit InternalError(const std::string& what)
      : Error(what + " (internal error: this is a bug in zeroshard, please report it)") {}
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

// Checks an invariant: a failure is a bug (InternalError), with the message pieces joined.
#define ZS_CHECK(cond, ...)                                                                \
  do {                                                                                     \
    if (!(cond)) throw ::zeroshard::InternalError(::zeroshard::detail::cat(__VA_ARGS__));  \
  } while (0)

// Checks the caller's input: a failure is the caller's (UsageError, a ValueError in Python).
#define ZS_REQUIRE(cond, ...)                                                           \
  do {                                                                                  \
    if (!(cond)) throw ::zeroshard::UsageError(::zeroshard::detail::cat(__VA_ARGS__));  \
  } while (0)
