// Clock: the time source for deadlines, timers and heartbeats, injectable so tests control time.
//
// SteadyClock reads std::chrono::steady_clock. ManualClock only moves when a test calls advance() or
// set(), and tells its listeners (a TimerQueue waiting for the next deadline) so they re-check without any
// real waiting. Both use steady_clock::time_point so code is written once for either.
// Thread-safety: all methods may be called from any thread. A clock must outlive its users.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>

#include "rpc/detail/move_only_function.h"

namespace distgrad::rpc {

class Clock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  using Duration = std::chrono::steady_clock::duration;
  using Listener = detail::MoveOnlyFunction<void()>;

  virtual ~Clock() = default;
  virtual TimePoint now() const = 0;
  // False for clocks that only move when told to: waiters then wait for a listener call, not real time.
  virtual bool isReal() const = 0;
  // Listeners run (on the thread that moved the clock) after every jump of a manual clock; real clocks
  // never call them. The id is for removeListener.
  virtual uint64_t addListener(Listener listener) = 0;
  virtual void removeListener(uint64_t id) = 0;
};

class SteadyClock final : public Clock {
 public:
  TimePoint now() const override { return std::chrono::steady_clock::now(); }
  bool isReal() const override { return true; }
  uint64_t addListener(Listener) override { return 0; }
  void removeListener(uint64_t) override {}
};

class ManualClock final : public Clock {
 public:
  explicit ManualClock(TimePoint start = TimePoint{} + std::chrono::hours(1)) : now_(start) {}
  TimePoint now() const override;
  bool isReal() const override { return false; }
  uint64_t addListener(Listener listener) override;
  void removeListener(uint64_t id) override;

  void advance(Duration by);
  // Moves to `to` (never backwards: a steady clock is monotonic; earlier times are ignored).
  void set(TimePoint to);

 private:
  void notifyListeners();

  mutable std::mutex mutex_;
  TimePoint now_;                          // GUARDED_BY(mutex_)
  std::map<uint64_t, Listener> listeners_; // GUARDED_BY(mutex_)
  uint64_t nextId_ = 1;                    // GUARDED_BY(mutex_)
  // Listeners run under this lock (not mutex_) so removeListener() returning means none is running.
  std::mutex notifyMutex_;
};

}  // namespace distgrad::rpc
