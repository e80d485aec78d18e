#include "rpc/cancellation.h"

#include <condition_variable>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

namespace distgrad::rpc {

namespace detail {

class CancellationState {
 public:
  using Callback = CancellationToken::Callback;

  bool isCancelled() {
    std::lock_guard<std::mutex> lock(mutex_);
    return reason_.has_value();
  }

  std::optional<Error> reason() {
    std::lock_guard<std::mutex> lock(mutex_);
    return reason_;
  }

  // Returns the registration id, or 0 when already cancelled (the callback then ran inline).
  uint64_t add(Callback callback) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!reason_) {
      uint64_t id = nextId_++;
      callbacks_.emplace(id, std::move(callback));
      return id;
    }
    Error reason = *reason_;
    lock.unlock();
    callback(reason);
    return 0;
  }

  void remove(uint64_t id) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (callbacks_.erase(id) != 0) return;
    // Already taken by cancel(): wait until it returns unless we are that callback (self-unregistration).
    if (runningId_ == id && runningThread_ != std::this_thread::get_id()) {
      callbackDone_.wait(lock, [&] { return runningId_ != id; });
    }
  }

  bool isRegistered(uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    return callbacks_.count(id) != 0;
  }

  bool cancel(Error reason) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (reason_) return false;
    reason_ = std::move(reason);
    const Error delivered = *reason_;
    // One at a time, in id (registration) order, so remove() knows which callback is running.
    while (!callbacks_.empty()) {
      auto first = callbacks_.begin();
      runningId_ = first->first;
      runningThread_ = std::this_thread::get_id();
      Callback callback = std::move(first->second);
      callbacks_.erase(first);
      lock.unlock();
      try {
        callback(delivered);
      } catch (const std::exception& e) {
        // A cancellation callback must not stop the others from running; its failure is its own.
        std::fprintf(stderr, "distgrad: a cancellation callback threw: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "distgrad: a cancellation callback threw a non-std exception\n");
      }
      callback.reset();
      lock.lock();
      runningId_ = 0;
      callbackDone_.notify_all();
    }
    return true;
  }

 private:
  std::mutex mutex_;
  std::condition_variable callbackDone_;
  std::optional<Error> reason_;               // GUARDED_BY(mutex_)
  std::map<uint64_t, Callback> callbacks_;    // GUARDED_BY(mutex_)
  uint64_t nextId_ = 1;                       // GUARDED_BY(mutex_)
  uint64_t runningId_ = 0;                    // GUARDED_BY(mutex_)
  std::thread::id runningThread_;             // GUARDED_BY(mutex_)
};

}  // namespace detail

CancellationRegistration::CancellationRegistration(CancellationRegistration&& other) noexcept
    : state_(std::move(other.state_)), id_(std::exchange(other.id_, 0)) {}

CancellationRegistration& CancellationRegistration::operator=(CancellationRegistration&& other) noexcept {
  if (this != &other) {
    reset();
    state_ = std::move(other.state_);
    id_ = std::exchange(other.id_, 0);
  }
  return *this;
}

void CancellationRegistration::reset() {
  if (state_ != nullptr && id_ != 0) state_->remove(id_);
  state_.reset();
  id_ = 0;
}

bool CancellationRegistration::active() const { return state_ != nullptr && id_ != 0 && state_->isRegistered(id_); }

bool CancellationToken::isCancelled() const { return state_ != nullptr && state_->isCancelled(); }

std::optional<Error> CancellationToken::reason() const {
  if (state_ == nullptr) return std::nullopt;
  return state_->reason();
}

CancellationRegistration CancellationToken::onCancel(Callback callback) const {
  DG_CHECK(static_cast<bool>(callback), "CancellationToken::onCancel: the callback must not be empty");
  if (state_ == nullptr) return {};
  uint64_t id = state_->add(std::move(callback));
  if (id == 0) return {};
  return CancellationRegistration(state_, id);
}

CancellationSource::CancellationSource() : state_(std::make_shared<detail::CancellationState>()) {}

bool CancellationSource::cancel(Error reason) { return state_->cancel(std::move(reason)); }

bool CancellationSource::isCancelled() const { return state_->isCancelled(); }

}  // namespace distgrad::rpc
