#include "rpc/timer.h"

#include <pthread.h>

#include <cstdio>
#include <exception>
#include <vector>

#include "rpc/trace.h"
#include "tensor/error.h"

namespace distgrad::rpc {

TimerQueue::TimerQueue(Clock* clock, std::function<void()> onThreadStart)
    : clock_(clock != nullptr ? clock : &steadyClock_), onThreadStart_(std::move(onThreadStart)) {
  if (!clock_->isReal()) {
    // A manual clock jumped: wake the loop so it re-reads now().
    listenerId_ = clock_->addListener([this] {
      std::lock_guard<std::mutex> lock(mutex_);
      changed_.notify_all();
    });
  }
  thread_ = std::thread([this] { loop(); });
  threadId_ = thread_.get_id();
}

TimerQueue::~TimerQueue() { shutdown(); }

TimerId TimerQueue::schedule(Clock::TimePoint deadline, Callback callback) {
  DG_CHECK(static_cast<bool>(callback), "TimerQueue::schedule: the callback must not be empty");
  std::lock_guard<std::mutex> lock(mutex_);
  if (stopping_) return kInvalidTimerId;  // `callback` is destroyed after the lock is released
  TimerId id = nextId_++;
  bool first = timers_.empty() || deadline < timers_.begin()->first.first;
  timers_.emplace(std::make_pair(deadline, id), std::move(callback));
  deadlines_.emplace(id, deadline);
  if (first) changed_.notify_all();
  return id;
}

bool TimerQueue::cancel(TimerId id) {
  Callback dropped;  // destroyed outside the lock: it may own promises whose breaking posts work
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = deadlines_.find(id);
  if (it == deadlines_.end()) return false;
  auto timer = timers_.find(std::make_pair(it->second, id));
  DG_ASSERT(timer != timers_.end(), "timer ", id, " has a deadline but no callback");
  dropped = std::move(timer->second);
  timers_.erase(timer);
  deadlines_.erase(it);
  return true;
}

size_t TimerQueue::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return timers_.size();
}

void TimerQueue::shutdown() {
  DG_CHECK(std::this_thread::get_id() != threadId_,
           "TimerQueue::shutdown must not be called from a timer callback (it would join its own thread)");
  std::lock_guard<std::mutex> joinLock(joinMutex_);
  if (joined_) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    changed_.notify_all();
  }
  thread_.join();
  joined_ = true;
  if (listenerId_ != 0) clock_->removeListener(listenerId_);
  std::map<std::pair<Clock::TimePoint, TimerId>, Callback> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dropped.swap(timers_);
    deadlines_.clear();
  }
  // `dropped` is destroyed here, unrun.
}

void TimerQueue::loop() {
  pthread_setname_np(pthread_self(), "dg-timer");
  trace::setThreadName("dg-timer");
  if (onThreadStart_) onThreadStart_();
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    if (timers_.empty()) {
      changed_.wait(lock);
      continue;
    }
    auto first = timers_.begin();
    Clock::TimePoint deadline = first->first.first;
    if (deadline <= clock_->now()) {
      Callback callback = std::move(first->second);
      deadlines_.erase(first->first.second);
      timers_.erase(first);
      lock.unlock();
      try {
        callback();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "distgrad: a timer callback threw: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "distgrad: a timer callback threw a non-std exception\n");
      }
      callback.reset();
      lock.lock();
      continue;
    }
    if (clock_->isReal()) {
      changed_.wait_until(lock, deadline);
    } else {
      changed_.wait(lock);  // the clock's listener wakes us when test time moves
    }
  }
}

}  // namespace distgrad::rpc
