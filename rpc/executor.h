// Executor: the fixed thread pool that runs RPC handlers and future continuations.
//
// Work is posted as move-only callables and run in FIFO order by `numThreads` workers named
// "dg-exec-N" (visible in top/gdb). Nothing ever blocks a worker on behalf of a pending request: a
// handler that needs another result awaits a Future (co_await / then), whose continuation is posted back
// here when the result arrives, so a pool of two threads serves any depth of nested calls.
//
// Shutdown is graceful: shutdown() stops accepting work from other threads, lets the workers drain the
// queue (work posted BY the draining tasks, e.g. the continuations of futures they complete, is still
// accepted so chains finish), then joins. post() after that returns false and destroys the callable
// without running it; a future continuation refused that way runs inline on the completing thread instead
// (Note [Refused continuations] in rpc/future.h), so waiters never hang. A task that throws is reported on
// stderr and counted; the worker lives on.
//
// One mutex-guarded queue; a post wakes at most one sleeping worker, and only when no wake-up is already
// on its way; a woken worker that leaves work queued wakes the next one (Note [Wake-up chaining] in
// executor.cpp), so a burst of posts costs one wake-up, not one per task.
//
// Thread-safety: every method may be called from any thread, except shutdown()/the destructor, which must
// not run on one of the executor's own workers (that would join itself; it throws ValueError instead).
// The Executor must outlive every Future bound to it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "rpc/detail/move_only_function.h"

namespace distgrad::rpc {

using Task = detail::MoveOnlyFunction<void()>;

class Executor {
 public:
  // numThreads == 0 picks the number of hardware threads (at least 2). `name` prefixes the thread names
  // (at most 10 characters are kept so "NAME-NN" fits Linux's 15-character limit). `onThreadStart`, if
  // set, runs first on every worker thread, before any task (the agent binds its threads to its trace
  // worker there); it must not throw.
  explicit Executor(size_t numThreads = 0, std::string name = "dg-exec", std::function<void()> onThreadStart = {});
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Queues `task`. Returns false (and destroys `task` after releasing the lock) once shutdown has begun,
  // unless called from one of this executor's workers while it drains.
  bool post(Task task);
  // post() without waking a worker now (Note [Batched hand-offs] in rpc/agent.cpp): the caller owes a
  // wakeDeferred() soon after, once it has queued the rest of its batch. Same refusal rules as post().
  bool postDeferred(Task task);
  // Wakes one sleeping worker if tasks are queued and none is awake or being woken: ends a run of
  // postDeferred() calls.
  void wakeDeferred();
  // Note [Following the task] (executor.cpp): post() from one of this executor's workers, inside a task,
  // that wakes no other worker: this worker runs it once its task ends, unless another worker, awake for
  // other work, takes it first. Should the task block in a library wait first (a Future's get/wait, an
  // rpcSync), wakeOwed() wakes one worker for it. From any other thread: post().
  bool postAfterTask(Task task);
  // Wakes a worker for what this thread posted with postAfterTask() during its current task, if anything:
  // called before the thread blocks. Harmless on any thread.
  static void wakeOwed();

  // Note [Waiting outside the queue] (executor.cpp): a worker, inside a task, that waits for work arriving
  // some other way (the agent: the next call on the connection it just answered, which it reads itself)
  // registers here with `interrupt`, which must make that wait check outsideWaitOver(). Returns false
  // (and registers nothing) when work is queued or the executor is stopping; otherwise the caller must call
  // endOutsideWait() on this thread afterwards. While registered: a post() or wakeDeferred() from another
  // thread that has no sleeping worker to wake calls one registered worker's `interrupt` (after unlocking),
  // and a post() from the registered thread itself wakes nobody (the thread comes back for it). Workers
  // only; `interrupt` may run on any thread, also after endOutsideWait (a spurious call must be harmless).
  bool beginOutsideWait(std::function<void()> interrupt);
  void endOutsideWait();
  // On the registered worker: true once the executor wants it back (work is queued, it was interrupted, or
  // shutdown began), so its wait should end.
  bool outsideWaitOver() const;

  // Stops accepting work, runs what is queued, joins the workers. Idempotent; concurrent callers all
  // return after the join.
  void shutdown();

  size_t numThreads() const { return numThreads_; }
  // Tasks queued and not yet started (a gauge for overload decisions and metrics).
  size_t queueDepth() const;
  // Counters since construction.
  uint64_t tasksRun() const { return tasksRun_.load(std::memory_order_relaxed); }
  uint64_t tasksFailed() const { return tasksFailed_.load(std::memory_order_relaxed); }
  bool isShutdown() const;

  // True when the calling thread is one of this executor's workers.
  bool isCurrentThread() const { return current() == this; }
  // The executor whose worker is running the calling thread, or nullptr.
  static Executor* current();

 private:
  void workerLoop(size_t index);
  // True when the caller must notify one sleeping worker (Note [Wake-up chaining]). Caller holds mutex_.
  bool wakeOneLocked();
  // Note [Waiting outside the queue]: queued work found no sleeping worker to wake (and was not posted by an
  // outside waiter itself). Returns the `interrupt` to call after unlocking, or an empty function. Caller
  // holds mutex_.
  std::function<void()> interruptOneLocked();

  const size_t numThreads_;
  const std::string name_;
  const std::function<void()> onThreadStart_;
  mutable std::mutex mutex_;
  std::condition_variable workAvailable_;
  std::deque<Task> queue_;  // GUARDED_BY(mutex_)
  bool accepting_ = true;   // GUARDED_BY(mutex_)
  bool stopping_ = false;   // GUARDED_BY(mutex_): workers exit once the queue is empty
  size_t sleeping_ = 0;     // GUARDED_BY(mutex_): workers waiting for work
  bool waking_ = false;     // GUARDED_BY(mutex_): a notify went out that no worker has answered yet
  // GUARDED_BY(mutex_): workers waiting outside the queue (Note [Waiting outside the queue]), at most one
  // entry per worker: its interrupt, and whether that was handed out since it registered.
  struct OutsideWaiter {
    std::function<void()> interrupt;
    bool interrupted = false;
    const void* thread = nullptr;  // the registered worker's tOutsideWait marker
  };
  std::vector<OutsideWaiter> outside_;
  std::mutex joinMutex_;    // serialises shutdown() callers around the join
  bool joined_ = false;     // GUARDED_BY(joinMutex_)
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> tasksRun_{0};
  std::atomic<uint64_t> tasksFailed_{0};
};

}  // namespace distgrad::rpc
