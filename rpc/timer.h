// TimerQueue: one thread that runs callbacks at deadlines (RPC deadlines, heartbeats, retry backoff).
//
// schedule() returns a TimerId; cancel() removes a timer that has not started firing. Timers fire in
// deadline order, and timers with equal deadlines in the order they were scheduled. Callbacks run on the
// timer thread ("dg-timer") one at a time and must be short: the usual callback posts to an Executor or
// completes a Promise (whose continuations are posted, Note [Continuations never run inline]). A callback
// that throws is reported on stderr; the queue lives on.
//
// The queue reads time from an injected Clock (rpc/clock.h): with a ManualClock, tests move time with
// advance() and timers fire without any real waiting. shutdown() (idempotent; the destructor calls it)
// joins the thread after the running callback, if any, returns; timers still pending are dropped unrun
// (their callbacks are destroyed, so promises they own break rather than hang). schedule() after
// shutdown drops the callback and returns kInvalidTimerId.
//
// Thread-safety: every method may be called from any thread, including from inside a callback, except
// shutdown()/the destructor from inside a callback (it would join itself; it throws ValueError).
// cancel() does not wait for a callback that is already running; it then returns false.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "rpc/clock.h"
#include "rpc/detail/move_only_function.h"

namespace distgrad::rpc {

using TimerId = uint64_t;
inline constexpr TimerId kInvalidTimerId = 0;

class TimerQueue {
 public:
  using Callback = detail::MoveOnlyFunction<void()>;

  // `clock` must outlive the queue; nullptr uses the real steady clock. `onThreadStart`, if set, runs
  // first on the timer thread (the agent binds it to its trace worker there); it must not throw.
  explicit TimerQueue(Clock* clock = nullptr, std::function<void()> onThreadStart = {});
  ~TimerQueue();
  TimerQueue(const TimerQueue&) = delete;
  TimerQueue& operator=(const TimerQueue&) = delete;

  TimerId schedule(Clock::TimePoint deadline, Callback callback);
  TimerId scheduleAfter(Clock::Duration delay, Callback callback) {
    return schedule(clock_->now() + delay, std::move(callback));
  }
  // True if the timer was pending and will now never run.
  bool cancel(TimerId id);
  void shutdown();

  // Timers scheduled and not yet fired or cancelled.
  size_t pending() const;
  Clock& clock() const { return *clock_; }
  // True on the timer thread (inside a callback, or a continuation a callback ran inline).
  bool isCurrentThread() const { return std::this_thread::get_id() == threadId_; }

 private:
  void loop();

  SteadyClock steadyClock_;
  Clock* clock_;
  std::function<void()> onThreadStart_;
  uint64_t listenerId_ = 0;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  // Note [Timer slots]: every RPC arms a deadline and nearly always cancels it, so the queue must not
  // allocate per timer. A timer lives in a reused slot (its id: the slot's generation << 32 | index + 1,
  // so a stale id never matches a reused slot) and the pending slots form a binary min-heap on (deadline,
  // sequence), each slot knowing its heap position, so cancel() removes in O(log n) in place.
  struct Slot {
    Clock::TimePoint deadline{};
    uint64_t sequence = 0;  // schedule order: equal deadlines fire first come, first served
    Callback callback;
    size_t heapIndex = 0;
    uint32_t generation = 0;
    bool active = false;
  };
  bool earlierLocked(uint32_t a, uint32_t b) const;
  void siftUpLocked(size_t index);
  void siftDownLocked(size_t index);
  // Removes slot `slot` from the heap and frees it; returns its callback (destroy it outside the lock).
  Callback releaseLocked(uint32_t slot);

  std::vector<Slot> slots_;         // GUARDED_BY(mutex_)
  std::vector<uint32_t> freeSlots_;  // GUARDED_BY(mutex_)
  std::vector<uint32_t> heap_;       // GUARDED_BY(mutex_): active slots, earliest first
  uint64_t nextSequence_ = 0;        // GUARDED_BY(mutex_)
  bool stopping_ = false;            // GUARDED_BY(mutex_)
  // GUARDED_BY(mutex_): when the thread will next look at the queue by itself (max: only when woken; min:
  // it is awake and will look before it sleeps again).
  Clock::TimePoint sleepsUntil_ = Clock::TimePoint::min();
  std::mutex joinMutex_;
  bool joined_ = false;  // GUARDED_BY(joinMutex_)
  std::thread::id threadId_;
  std::thread thread_;
};

}  // namespace distgrad::rpc
