// Errors that cross threads or the network, and Result<T> (a value or an Error).
//
// Failures in asynchronous paths travel as Error values (never as exceptions between threads). The kind
// tells the caller what to do: give up (failed, unimplemented), back off (overloaded), reconnect
// (disconnected), or that a deadline/cancel ended the call (timeout, cancelled); `remote` means the
// handler on the peer threw (type and message preserved). Future::get() rethrows an Error as RpcError,
// which names the worker.
// Thread-safety: value types.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

#include "tensor/error.h"

namespace distgrad::rpc {

enum class ErrorKind : uint8_t {
  kFailed = 0,
  kOverloaded = 1,
  kDisconnected = 2,
  kUnimplemented = 3,
  kTimeout = 4,
  kCancelled = 5,
  kRemote = 6,
};

const char* errorKindName(ErrorKind kind);

struct Error {
  ErrorKind kind = ErrorKind::kFailed;
  std::string message;
  std::string worker;      // the worker the failure is about (the callee, the dead peer), if known
  std::string remoteType;  // for kRemote: the exception type the handler threw

  static Error failed(std::string message) { return {ErrorKind::kFailed, std::move(message), {}, {}}; }
  static Error disconnected(std::string message) { return {ErrorKind::kDisconnected, std::move(message), {}, {}}; }
  static Error timeout(std::string message) { return {ErrorKind::kTimeout, std::move(message), {}, {}}; }
  static Error cancelled(std::string message) { return {ErrorKind::kCancelled, std::move(message), {}, {}}; }
  static Error unimplemented(std::string message) { return {ErrorKind::kUnimplemented, std::move(message), {}, {}}; }
  static Error overloaded(std::string message) { return {ErrorKind::kOverloaded, std::move(message), {}, {}}; }
  Error& onWorker(std::string name) {
    worker = std::move(name);
    return *this;
  }

  // "timeout on worker1: rpc 'add' exceeded its 500 ms deadline"
  std::string describe() const;
};

// The exception Future::get() throws for an Error.
class RpcError : public std::runtime_error {
 public:
  explicit RpcError(Error error) : std::runtime_error(error.describe()), error_(std::move(error)) {}
  const Error& error() const { return error_; }
  ErrorKind kind() const { return error_.kind; }

 private:
  Error error_;
};

// A value or an Error. Minimal by design (std::expected is C++23).
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::in_place_index<0>, std::move(value)) {}  // NOLINT: implicit by design
  Result(Error error) : state_(std::in_place_index<1>, std::move(error)) {}  // NOLINT
  bool ok() const { return state_.index() == 0; }
  explicit operator bool() const { return ok(); }
  T& value() & {
    throwIfError();
    return std::get<0>(state_);
  }
  T&& value() && {
    throwIfError();
    return std::get<0>(std::move(state_));
  }
  const Error& error() const {
    DG_ASSERT(!ok(), "Result::error() on a value");
    return std::get<1>(state_);
  }

 private:
  void throwIfError() const {
    if (!ok()) throw RpcError(std::get<1>(state_));
  }
  std::variant<T, Error> state_;
};

// Result<void>: success or an Error.
template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : error_(std::move(error)) {}  // NOLINT
  bool ok() const { return !error_.has_value(); }
  explicit operator bool() const { return ok(); }
  void value() const {
    if (error_) throw RpcError(*error_);
  }
  const Error& error() const {
    DG_ASSERT(!ok(), "Result::error() on success");
    return *error_;
  }

 private:
  std::optional<Error> error_;
};

}  // namespace distgrad::rpc
