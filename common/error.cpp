#include "common/error.h"

namespace cp {
namespace {
// Each rank of a local world is a thread, so the rank for messages is per thread.
thread_local int current_rank = -1;

std::string locate(const std::string& message, const char* file, int line) {
  std::ostringstream out;
  if (current_rank >= 0) out << "[rank " << current_rank << "] ";
  out << file << ":" << line << ": " << message;
  return out.str();
}
}  // namespace

Error::Error(const std::string& message, const char* file, int line)
    : std::runtime_error(locate(message, file, line)), message_(message) {}

int this_rank() { return current_rank; }
void set_this_rank(int rank) { current_rank = rank; }

}  // namespace cp
