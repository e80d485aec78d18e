// CancellationSource / CancellationToken: how the agent tells a running handler that its call was
// cancelled by the caller or ran past its deadline.
//
// The source (owned by whoever decides: the agent's call record) hands out tokens (cheap shared handles)
// to handlers. A handler polls token.isCancelled() between steps, or registers a callback with onCancel()
// to abort outstanding work (fail a promise, cancel a nested call). cancel() is idempotent: the first call
// records the reason (an Error, kCancelled by default; the agent passes kTimeout for deadlines) and runs
// every registered callback exactly once, on the cancelling thread, outside any lock, in registration
// order. A callback registered after cancellation runs immediately, inline in onCancel() on the caller's
// thread (so "register, then check" races cannot lose a cancellation).
//
// onCancel() returns a CancellationRegistration; destroying it (or calling reset()) unregisters the
// callback. If the callback is running at that moment on another thread, the destructor waits for it to
// return, so the callback may safely capture objects that die with the registration (as with
// std::stop_callback); a callback may destroy its own registration without deadlocking.
//
// Thread-safety: all methods may be called from any thread. A default-constructed token is never
// cancelled.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "rpc/detail/move_only_function.h"
#include "rpc/error.h"

namespace distgrad::rpc {

namespace detail {
class CancellationState;
}

class CancellationRegistration {
 public:
  CancellationRegistration() = default;
  CancellationRegistration(CancellationRegistration&& other) noexcept;
  CancellationRegistration& operator=(CancellationRegistration&& other) noexcept;
  CancellationRegistration(const CancellationRegistration&) = delete;
  CancellationRegistration& operator=(const CancellationRegistration&) = delete;
  ~CancellationRegistration() { reset(); }

  // Unregisters (waiting for a concurrently running callback, see above). Idempotent.
  void reset();
  // True while the callback is registered and has not started running.
  bool active() const;

 private:
  friend class CancellationToken;
  CancellationRegistration(std::shared_ptr<detail::CancellationState> state, uint64_t id)
      : state_(std::move(state)), id_(id) {}
  std::shared_ptr<detail::CancellationState> state_;
  uint64_t id_ = 0;
};

class CancellationToken {
 public:
  using Callback = detail::MoveOnlyFunction<void(const Error&)>;

  CancellationToken() = default;
  bool isCancelled() const;
  // The reason given to cancel(), or nullopt while not cancelled.
  std::optional<Error> reason() const;
  // See the header comment; the callback receives the reason. On a default token the callback never runs.
  [[nodiscard]] CancellationRegistration onCancel(Callback callback) const;

 private:
  friend class CancellationSource;
  explicit CancellationToken(std::shared_ptr<detail::CancellationState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::CancellationState> state_;
};

class CancellationSource {
 public:
  CancellationSource();
  CancellationToken token() const { return CancellationToken(state_); }
  // Returns true for the call that cancelled, false if already cancelled.
  bool cancel(Error reason = Error::cancelled("the call was cancelled"));
  bool isCancelled() const;

 private:
  std::shared_ptr<detail::CancellationState> state_;
};

}  // namespace distgrad::rpc
