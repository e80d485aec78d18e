// Error types and the DG_CHECK / DG_ASSERT macros shared by every module.
//
// DG_CHECK validates a caller's input at a public entry point and throws distgrad::ValueError whose
// message names the op, the bad value and what was expected. DG_ASSERT guards our own invariants and
// throws distgrad::InternalError. Library code never aborts: a long-running worker must survive bad input.
// Thread-safety: stateless.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace distgrad {

// The caller passed something invalid (shape, dtype, argument value, missing file).
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A distgrad invariant was broken: a bug in distgrad, never the caller's fault.
class InternalError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

namespace detail {
template <typename... Args>
std::string concatMessage(Args&&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace distgrad

#define DG_CHECK(cond, ...)                                                           \
  do {                                                                                \
    if (!(cond)) [[unlikely]] {                                                       \
      throw ::distgrad::ValueError(::distgrad::detail::concatMessage(__VA_ARGS__));   \
    }                                                                                 \
  } while (0)

#define DG_ASSERT(cond, ...)                                                                   \
  do {                                                                                         \
    if (!(cond)) [[unlikely]] {                                                                \
      throw ::distgrad::InternalError(::distgrad::detail::concatMessage(                       \
          "internal invariant failed at ", __FILE__, ":", __LINE__, " (" #cond "): ", ##__VA_ARGS__)); \
    }                                                                                          \
  } while (0)
