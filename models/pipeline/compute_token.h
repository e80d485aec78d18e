#pragma once

// A pipeline stage's compute token (Note [Stage compute token] and Note [1F1B alternation] in
// models/pipeline/rpc_pipeline.cpp): the stage's forwards and backwards compute one at a time.

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

#include "rpc/executor.h"

namespace distgrad::models::pipeline {

class ComputeToken {
 public:
  // Blocks until the token is this caller's.
  void acquireBlocking() {
    // An executor worker may block here: what it queued to follow its task must not wait on it (Note
    // [Following the task] in rpc/executor.cpp).
    rpc::Executor::wakeOwed();
    rpc::Executor* const executor = rpc::Executor::current();
    std::unique_lock<std::mutex> lock(mutex_);
    ++blocked_;
    if (executor != nullptr) blockedWorkers_.push_back(executor);
    freed_.wait(lock, [&] {
      if (reserved_ && starvedLocked()) reserved_ = false;  // Note [Starved reservation]
      return !held_ && !reserved_;
    });
    --blocked_;
    if (executor != nullptr) blockedWorkers_.erase(std::find(blockedWorkers_.begin(), blockedWorkers_.end(), executor));
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
      reserved_ = forwardNext && !starvedLocked();  // Note [Starved reservation]
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
  // Note [Starved reservation]: a reservation waits for the forward runner, which a wake-up posts to an
  // executor. When every worker of an executor is blocked here, none is left to run it: the reservation
  // would never be taken and the blocked backwards would wait for it for ever (a stage whose agent has one
  // executor thread deadlocked this way under 1F1B: the next backward's task was queued before the runner
  // and blocked the only worker). So no reservation is made, or one is dropped, while some executor has all
  // its workers blocked on this token; the runner then takes the token after those backwards, as without
  // 1F1B's alternation. Not exact for a runner on another executor (a stage's runner and backwards use
  // its agent's), where it only costs the alternation. It counts this token's waiters only: two stages on
  // one worker, each with a backward blocked while a reservation waits, can still take every thread of a
  // pool of two (not handled).
  bool starvedLocked() const {
    return std::any_of(blockedWorkers_.begin(), blockedWorkers_.end(), [&](rpc::Executor* executor) {
      return static_cast<size_t>(std::count(blockedWorkers_.begin(), blockedWorkers_.end(), executor)) >=
             executor->numThreads();
    });
  }

  mutable std::mutex mutex_;
  std::condition_variable freed_;
  bool held_ = false;           // GUARDED_BY(mutex_)
  bool reserved_ = false;       // GUARDED_BY(mutex_): free, but only for the forward runner
  int blocked_ = 0;             // GUARDED_BY(mutex_)
  // The executor of each blocked caller that is an executor worker (one entry per caller).
  std::vector<rpc::Executor*> blockedWorkers_;  // GUARDED_BY(mutex_)
  std::function<void()> wake_;  // GUARDED_BY(mutex_)
};

}  // namespace distgrad::models::pipeline
