// Helpers for the asynchronous tests: wait on the event itself with a bounded timeout, never sleep.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>

namespace distgrad::rpc::testing {

// Generous: only reached when something is broken, and then it turns a hang into a failure.
inline constexpr std::chrono::seconds kTestTimeout{30};

// A one-shot (or counting) event: set() / add(); waitFor() returns false on timeout.
class Event {
 public:
  explicit Event(size_t target = 1) : target_(target) {}
  void set() { add(1); }
  void add(size_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    count_ += n;
    if (count_ >= target_) changed_.notify_all();
  }
  bool waitFor(std::chrono::milliseconds timeout = kTestTimeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_for(lock, timeout, [&] { return count_ >= target_; });
  }
  bool isSet() {
    std::lock_guard<std::mutex> lock(mutex_);
    return count_ >= target_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  size_t count_ = 0;
  size_t target_;
};

// Spins (yielding) until pred() holds or the timeout passes, for state with no event to wait on.
template <typename Pred>
bool eventually(Pred pred, std::chrono::milliseconds timeout = kTestTimeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

}  // namespace distgrad::rpc::testing
