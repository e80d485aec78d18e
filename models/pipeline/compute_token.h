#pragma once

// A pipeline stage's compute token (Note [Stage compute token] and Note [1F1B alternation] in
// models/pipeline/rpc_pipeline.cpp): the stage's forwards and backwards compute one at a time.

#include <condition_variable>
#include <functional>
#include <mutex>
#include <utility>

#include "rpc/executor.h"

namespace distgrad::models::pipeline {

class ComputeToken {
 public:
  // Blocks until the token is this caller's.
  void acquireBlocking() {
    // An executor worker may block here: what it queued to follow its task must not wait on it (Note
    // [Following the task] in rpc/executor.cpp).
    rpc::Executor::wakeOwed();
    std::unique_lock<std::mutex> lock(mutex_);
    ++blocked_;
    freed_.wait(lock, [&] { return !held_ && !reserved_; });
    --blocked_;
    held_ = true;
  }
  // The forward runner's acquire: takes the token if it is free and reserved for the runner or nobody is
  // blocked on it; else keeps `wake` (replacing an earlier one) and calls it once the token is released to
  // the runner.
  bool tryAcquireOrNotify(std::function<void()> wake) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!held_ && (reserved_ || blocked_ == 0)) {
      held_ = true;
      reserved_ = false;
      return true;
    }
    wake_ = std::move(wake);
    return false;
  }
  // `forwardNext`: reserve the token for the forward runner (Note [1F1B alternation]).
  void release(bool forwardNext = false) {
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      held_ = false;
      reserved_ = forwardNext;
      if (blocked_ > 0 && !reserved_) {
        freed_.notify_one();
        return;
      }
      wake.swap(wake_);
    }
    if (wake) wake();
  }
  // Callers blocked in acquireBlocking (for tests).
  int blocked() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return blocked_;
  }
  // The runner will not take a reservation it may hold: blocked backwards go on.
  void dropReservation() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!std::exchange(reserved_, false)) return;
    if (!held_ && blocked_ > 0) freed_.notify_one();
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable freed_;
  bool held_ = false;           // GUARDED_BY(mutex_)
  bool reserved_ = false;       // GUARDED_BY(mutex_): free, but only for the forward runner
  int blocked_ = 0;             // GUARDED_BY(mutex_)
  std::function<void()> wake_;  // GUARDED_BY(mutex_)
};

}  // namespace distgrad::models::pipeline
