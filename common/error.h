// Errors of the course runtime: one exception family, one macro family.
//
// Every message names where it was raised (file:line) and, when known, the rank, so that a
// failure among eight ranks says which rank failed.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace cp {

/// Base of every error the course throws; what() is "[rank R] file:line: message".
class Error : public std::runtime_error {
 public:
  Error(const std::string& message, const char* file, int line);
  explicit Error(const std::string& what_text) : std::runtime_error(what_text), message_(what_text) {}
  /// The message alone, without what()'s rank and file:line (for text that quotes it).
  const std::string& message() const { return message_; }

 private:
  std::string message_;
};

/// Thrown by a learner stub that has not been written yet; the test harness reports it as
/// NOT STARTED instead of a failure.
class NotImplemented : public Error {
 public:
  explicit NotImplemented(const std::string& what) : Error("not implemented yet: " + what) {}
};

/// Thrown on every rank of a local world when all live ranks wait on each other; the message
/// names the wait-for cycle ("rank 0 send→1, rank 1 send→0").
class DeadlockError : public Error {
 public:
  using Error::Error;
};

/// An error that every rank raises at the same call, having checked the same thing together
/// (check_same_on_every_rank in common/tensor_checks.h). Nobody is left waiting, so run_main()
/// (common/world.h) lets every rank report it and exit instead of aborting the world.
class ErrorOnEveryRank : public Error {
 public:
  using Error::Error;
};

/// Thrown on the other ranks of a local world after one rank failed, to release them.
class WorldAborted : public Error {
 public:
  using Error::Error;
};

/// Rank used in error messages of the calling thread (-1: unknown). Set by the worlds.
int this_rank();
void set_this_rank(int rank);

namespace detail {
/// Builds a message from any streamable pieces: CP_CHECK(x > 0, "x must be > 0, got ", x).
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace detail

}  // namespace cp

/// Throws cp::Error with file:line when cond is false; the rest is the message.
#define CP_CHECK(cond, ...)                                                      \
  do {                                                                           \
    if (!(cond)) throw ::cp::Error(::cp::detail::concat(__VA_ARGS__), __FILE__, __LINE__); \
  } while (0)

/// Throws cp::Error with file:line unconditionally.
#define CP_FAIL(...) throw ::cp::Error(::cp::detail::concat(__VA_ARGS__), __FILE__, __LINE__)
