#include "rpc/clock.h"

#include <utility>

#include "tensor/error.h"

namespace distgrad::rpc {

ManualClock::TimePoint ManualClock::now() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return now_;
}

uint64_t ManualClock::addListener(Listener listener) {
  DG_CHECK(static_cast<bool>(listener), "ManualClock::addListener: the listener must not be empty");
  std::lock_guard<std::mutex> notifyLock(notifyMutex_);
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t id = nextId_++;
  listeners_.emplace(id, std::move(listener));
  return id;
}

void ManualClock::removeListener(uint64_t id) {
  std::lock_guard<std::mutex> notifyLock(notifyMutex_);
  std::lock_guard<std::mutex> lock(mutex_);
  listeners_.erase(id);
}

void ManualClock::advance(Duration by) {
  DG_CHECK(by >= Duration::zero(), "ManualClock::advance: a steady clock cannot go back (got ",
           std::chrono::duration_cast<std::chrono::nanoseconds>(by).count(), " ns)");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    now_ += by;
  }
  notifyListeners();
}

void ManualClock::set(TimePoint to) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (to <= now_) return;
    now_ = to;
  }
  notifyListeners();
}

void ManualClock::notifyListeners() {
  std::lock_guard<std::mutex> notifyLock(notifyMutex_);
  // Listeners are only added/removed under notifyMutex_, which we hold, so iterating without mutex_ is safe.
  for (auto& [id, listener] : listeners_) listener();
}

}  // namespace distgrad::rpc
