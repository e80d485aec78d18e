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
  uint32_t slot;
  if (!freeSlots_.empty()) {
    slot = freeSlots_.back();
    freeSlots_.pop_back();
  } else {
    slot = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  Slot& s = slots_[slot];
  s.deadline = deadline;
  s.sequence = nextSequence_++;
  s.callback = std::move(callback);
  s.active = true;
  s.heapIndex = heap_.size();
  heap_.push_back(slot);
  siftUpLocked(s.heapIndex);
  // The thread needs waking only when it would sleep past this deadline. Cancelled timers do not move
  // its wake-up time, so after a burst of timers armed and cancelled (every RPC's deadline) the queue is
  // often empty while the thread still sleeps until an old deadline: a new, later one then costs no
  // wake-up (the thread re-reads the queue when it wakes).
  if (deadline < sleepsUntil_) changed_.notify_all();
  return (static_cast<TimerId>(s.generation) << 32) | (static_cast<TimerId>(slot) + 1);
}

bool TimerQueue::cancel(TimerId id) {
  Callback dropped;  // destroyed outside the lock: it may own promises whose breaking posts work
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t index = (id & 0xffffffffu);
  if (index == 0 || index > slots_.size()) return false;
  const auto slot = static_cast<uint32_t>(index - 1);
  if (!slots_[slot].active || slots_[slot].generation != static_cast<uint32_t>(id >> 32)) return false;
  dropped = releaseLocked(slot);
  return true;
}

bool TimerQueue::earlierLocked(uint32_t a, uint32_t b) const {
  const Slot& x = slots_[a];
  const Slot& y = slots_[b];
  return x.deadline < y.deadline || (x.deadline == y.deadline && x.sequence < y.sequence);
}

void TimerQueue::siftUpLocked(size_t index) {
  while (index > 0) {
    const size_t parent = (index - 1) / 2;
    if (!earlierLocked(heap_[index], heap_[parent])) break;
    std::swap(heap_[index], heap_[parent]);
    slots_[heap_[index]].heapIndex = index;
    slots_[heap_[parent]].heapIndex = parent;
    index = parent;
  }
}

void TimerQueue::siftDownLocked(size_t index) {
  for (;;) {
    const size_t left = 2 * index + 1;
    if (left >= heap_.size()) break;
    size_t child = left;
    if (left + 1 < heap_.size() && earlierLocked(heap_[left + 1], heap_[left])) child = left + 1;
    if (!earlierLocked(heap_[child], heap_[index])) break;
    std::swap(heap_[index], heap_[child]);
    slots_[heap_[index]].heapIndex = index;
    slots_[heap_[child]].heapIndex = child;
    index = child;
  }
}

TimerQueue::Callback TimerQueue::releaseLocked(uint32_t slot) {
  Slot& s = slots_[slot];
  const size_t index = s.heapIndex;
  const size_t last = heap_.size() - 1;
  if (index != last) {
    heap_[index] = heap_[last];
    slots_[heap_[index]].heapIndex = index;
    heap_.pop_back();
    // The moved entry may belong above or below its new place (if it rose, what took its place is in
    // order already and the sift down does nothing).
    siftUpLocked(index);
    siftDownLocked(index);
  } else {
    heap_.pop_back();
  }
  Callback callback = std::move(s.callback);
  s.callback = nullptr;
  s.active = false;
  ++s.generation;
  freeSlots_.push_back(slot);
  return callback;
}

size_t TimerQueue::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return heap_.size();
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
  std::vector<Callback> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!heap_.empty()) dropped.push_back(releaseLocked(heap_.front()));
  }
  // `dropped` is destroyed here, unrun.
}

void TimerQueue::loop() {
  pthread_setname_np(pthread_self(), "dg-timer");
  trace::setThreadName("dg-timer");
  if (onThreadStart_) onThreadStart_();
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    sleepsUntil_ = Clock::TimePoint::min();  // awake: schedule() need not wake us
    if (heap_.empty()) {
      sleepsUntil_ = Clock::TimePoint::max();
      changed_.wait(lock);
      continue;
    }
    Clock::TimePoint deadline = slots_[heap_.front()].deadline;
    if (deadline <= clock_->now()) {
      Callback callback = releaseLocked(heap_.front());
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
    sleepsUntil_ = deadline;
    if (clock_->isReal()) {
      changed_.wait_until(lock, deadline);
    } else {
      changed_.wait(lock);  // the clock's listener wakes us when test time moves
    }
  }
}

}  // namespace distgrad::rpc
