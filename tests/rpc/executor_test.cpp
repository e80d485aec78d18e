#include "rpc/executor.h"

#include <gtest/gtest.h>
#include <pthread.h>

#include <array>
#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "rpc/async_test_util.h"
#include "rpc/future.h"

namespace distgrad::rpc {
namespace {

using testing::Event;
using testing::eventually;

TEST(Executor, DefaultSizeIsHardwareThreadsAtLeastTwo) {
  Executor ex;
  EXPECT_GE(ex.numThreads(), 2u);
  EXPECT_GE(ex.numThreads(), std::thread::hardware_concurrency());
  Executor three(3);
  EXPECT_EQ(three.numThreads(), 3u);
}

TEST(Executor, RunsTasksOnNamedWorkerThreads) {
  Executor ex(2);
  constexpr int kTasks = 200;
  Event done(kTasks);
  std::mutex mutex;
  std::set<std::thread::id> threads;
  std::set<std::string> names;
  std::atomic<int> onExecutor{0};
  for (int i = 0; i < kTasks; ++i) {
    ASSERT_TRUE(ex.post([&] {
      char name[16] = {};
      pthread_getname_np(pthread_self(), name, sizeof(name));
      if (Executor::current() == &ex && ex.isCurrentThread()) onExecutor.fetch_add(1);
      {
        std::lock_guard<std::mutex> lock(mutex);
        threads.insert(std::this_thread::get_id());
        names.insert(name);
      }
      done.set();
    }));
  }
  ASSERT_TRUE(done.waitFor());
  EXPECT_EQ(onExecutor.load(), kTasks);
  EXPECT_EQ(threads.count(std::this_thread::get_id()), 0u);
  EXPECT_LE(threads.size(), 2u);
  for (const auto& name : names) EXPECT_TRUE(name == "dg-exec-0" || name == "dg-exec-1") << name;
  EXPECT_EQ(Executor::current(), nullptr);
  EXPECT_FALSE(ex.isCurrentThread());
  ex.shutdown();
  EXPECT_EQ(ex.tasksRun(), static_cast<uint64_t>(kTasks));
}

TEST(Executor, RunsInFifoOrderOnOneThread) {
  Executor ex(1);
  std::vector<int> order;
  Event done;
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(ex.post([&order, i] { order.push_back(i); }));
  ASSERT_TRUE(ex.post([&] { done.set(); }));
  ASSERT_TRUE(done.waitFor());
  ASSERT_EQ(order.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(order[i], i);
}

TEST(Executor, AcceptsMoveOnlyTasks) {
  Executor ex(2);
  auto value = std::make_unique<int>(41);
  Event done;
  int seen = 0;
  ASSERT_TRUE(ex.post([v = std::move(value), &seen, &done] {
    seen = *v + 1;
    done.set();
  }));
  ASSERT_TRUE(done.waitFor());
  EXPECT_EQ(seen, 42);
}

TEST(Executor, QueueDepthCountsWaitingTasks) {
  Executor ex(1);
  Event started, release;
  ASSERT_TRUE(ex.post([&] {
    started.set();
    release.waitFor();
  }));
  ASSERT_TRUE(started.waitFor());
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(ex.post([] {}));
  EXPECT_EQ(ex.queueDepth(), 5u);
  release.set();
  ex.shutdown();
  EXPECT_EQ(ex.queueDepth(), 0u);
  EXPECT_EQ(ex.tasksRun(), 6u);
}

TEST(Executor, DeferredPostsRunOnceWokenAndAnAwakeWorkerTakesThemWithoutAWakeUp) {
  Executor ex(2);
  // Both workers asleep: deferred posts queue up, and wakeDeferred() wakes a worker for the batch.
  ASSERT_TRUE(eventually([&] { return ex.queueDepth() == 0; }));
  std::atomic<int> ran{0};
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(ex.postDeferred([&] { ran.fetch_add(1); }));
  ex.wakeDeferred();
  ASSERT_TRUE(eventually([&] { return ran.load() == 10; }));
  // One worker blocked in a task: its queue-mates must not wait for it.
  Event started, release;
  ASSERT_TRUE(ex.post([&] {
    started.set();
    release.waitFor();
    ran.fetch_add(100);
  }));
  ASSERT_TRUE(started.waitFor());
  for (int i = 0; i < 10; ++i) ASSERT_TRUE(ex.postDeferred([&] { ran.fetch_add(1); }));
  ex.wakeDeferred();  // wakes the other worker: a blocked task never holds back the queue
  ASSERT_TRUE(eventually([&] { return ran.load() == 20; }));
  release.set();
  ASSERT_TRUE(eventually([&] { return ran.load() == 120; }));
  // wakeDeferred() with nothing queued is a no-op; after shutdown deferred posts are refused (and destroyed).
  ex.wakeDeferred();
  ex.shutdown();
  auto token = std::make_shared<int>(0);
  EXPECT_FALSE(ex.postDeferred([token] {}));
  EXPECT_EQ(token.use_count(), 1);
  ex.wakeDeferred();
  EXPECT_EQ(ex.tasksRun(), 21u);
}

// Note [Waiting outside the queue]: a worker waiting for work that comes another way (the agent's serving
// reader) registers an interrupt. Work nobody else can take interrupts it; what it posts itself wakes
// nobody; shutdown interrupts it; it cannot register with work queued or off the executor's workers.
TEST(Executor, AnOutsideWaiterIsInterruptedByWorkNoSleepingWorkerCanTake) {
  Executor ex(1);
  Event waiting, interrupted, ran;
  std::atomic<bool> registered{false}, sawWork{false};
  ASSERT_TRUE(ex.post([&] {
    registered = ex.beginOutsideWait([&] { interrupted.set(); });
    waiting.set();
    if (!registered) return;
    sawWork = interrupted.waitFor() && ex.outsideWaitOver();
    ex.endOutsideWait();
  }));
  ASSERT_TRUE(waiting.waitFor());
  ASSERT_TRUE(registered);
  ASSERT_TRUE(ex.post([&] { ran.set(); }));  // the only worker waits outside: interrupted, then runs it
  EXPECT_TRUE(ran.waitFor());
  EXPECT_TRUE(sawWork);
  // Ended: a later post finds the worker asleep on the queue (no interrupt needed, none left registered).
  Event again;
  ASSERT_TRUE(ex.post([&] { again.set(); }));
  EXPECT_TRUE(again.waitFor());
}

TEST(Executor, WhatAnOutsideWaiterPostsItselfWakesNobodyAndItComesBackForIt) {
  Executor ex(2);
  ASSERT_TRUE(eventually([&] { return ex.queueDepth() == 0; }));
  std::atomic<bool> interruptedBySelf{false};
  std::thread::id waiter, runner;
  Event done;
  ASSERT_TRUE(ex.post([&] {
    waiter = std::this_thread::get_id();
    ASSERT_TRUE(ex.beginOutsideWait([&] { interruptedBySelf = true; }));
    ASSERT_TRUE(ex.post([&] {
      runner = std::this_thread::get_id();
      done.set();
    }));
    EXPECT_TRUE(ex.outsideWaitOver());  // work is queued: its wait would end here
    ex.endOutsideWait();
  }));
  ASSERT_TRUE(done.waitFor());
  EXPECT_FALSE(interruptedBySelf);
  EXPECT_EQ(runner, waiter) << "the other worker was woken for work the waiter posted itself";
}

// Note [Following the task]: postAfterTask from a worker wakes nobody; that worker runs the task once its
// current task ended. A library wait inside the task wakes a worker for it first (wakeOwed), so a task
// waiting for what it queued does not hang. Off the workers it is post().
TEST(Executor, WorkPostedAfterTheTaskRunsOnThatWorkerOnceTheTaskEnds) {
  Executor ex(2);
  std::atomic<bool> taskEnded{false}, ranAfterTheTask{false};
  std::thread::id poster, runner;
  Event done;
  ASSERT_TRUE(ex.post([&] {
    poster = std::this_thread::get_id();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the other worker is asleep by now
    ASSERT_TRUE(ex.postAfterTask([&] {
      runner = std::this_thread::get_id();
      ranAfterTheTask = taskEnded.load();
      done.set();
    }));
    // Had the other worker been woken, it would have run the task by now.
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    taskEnded = true;
  }));
  ASSERT_TRUE(done.waitFor());
  EXPECT_EQ(runner, poster);
  EXPECT_TRUE(ranAfterTheTask);
  // Off the workers it is a plain post.
  Event offWorkers;
  ASSERT_TRUE(ex.postAfterTask([&] { offWorkers.set(); }));
  EXPECT_TRUE(offWorkers.waitFor());
}

TEST(Executor, ATaskWaitingForWhatItPostedAfterItselfWakesAWorkerForIt) {
  Executor ex(2);
  Event done;
  std::atomic<bool> completed{false};
  ASSERT_TRUE(ex.post([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the other worker is asleep by now
    Promise<void> promise(ex);
    Future<void> future = promise.getFuture();
    ASSERT_TRUE(ex.postAfterTask([promise = std::move(promise)]() mutable { promise.setValue(); }));
    completed = future.wait(std::chrono::seconds(5));  // a library wait: wakeOwed() first
    done.set();
  }));
  ASSERT_TRUE(done.waitFor());
  EXPECT_TRUE(completed);
  Executor::wakeOwed();  // harmless off the workers
}

TEST(Executor, ShutdownInterruptsOutsideWaiters) {
  Executor ex(2);
  std::atomic<int> interrupts{0};
  for (int i = 0; i < 2; ++i) {
    Event registered;  // one at a time: the second is posted once the first waits outside
    ASSERT_TRUE(ex.post([&] {
      Event interrupted;
      ASSERT_TRUE(ex.beginOutsideWait([&interrupts, &interrupted] {
        interrupts.fetch_add(1);
        interrupted.set();
      }));
      registered.set();
      interrupted.waitFor();
      ex.endOutsideWait();
    }));
    ASSERT_TRUE(registered.waitFor());
  }
  const auto begin = std::chrono::steady_clock::now();
  ex.shutdown();  // both workers wait outside: shutdown ends their waits, not the test's timeout
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(5));
  // Each waiter was interrupted by shutdown (a second post that found the other worker not yet asleep may
  // have interrupted the first waiter once more before it, which then waited again).
  EXPECT_GE(interrupts.load(), 2);
}

TEST(Executor, BeginOutsideWaitRefusesWithWorkQueuedOrOffTheWorkers) {
  Executor ex(1);
  EXPECT_THROW(ex.beginOutsideWait([] {}), ValueError);  // not a worker of this executor
  Event release, done;
  std::atomic<bool> refused{false};
  ASSERT_TRUE(ex.post([&] {
    release.waitFor();
    refused = !ex.beginOutsideWait([] {});  // the task below is queued
    done.set();
  }));
  ASSERT_TRUE(ex.post([] {}));
  release.set();
  ASSERT_TRUE(done.waitFor());
  EXPECT_TRUE(refused);
}

TEST(Executor, ShutdownDrainsQueuedWorkAndRefusesNewWork) {
  Executor ex(1);
  Event started, release;
  std::atomic<int> ran{0};
  ASSERT_TRUE(ex.post([&] {
    started.set();
    release.waitFor();
  }));
  ASSERT_TRUE(started.waitFor());
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(ex.post([&] { ran.fetch_add(1); }));
  std::thread stopper([&] { ex.shutdown(); });
  ASSERT_TRUE(eventually([&] { return ex.isShutdown(); }));
  // Refused from outside while draining; the refused task is destroyed, not run.
  auto token = std::make_shared<int>(0);
  EXPECT_FALSE(ex.post([token, &ran] { ran.fetch_add(1000); }));
  EXPECT_EQ(token.use_count(), 1);
  release.set();
  stopper.join();
  EXPECT_EQ(ran.load(), 100);
  EXPECT_EQ(ex.queueDepth(), 0u);
  EXPECT_FALSE(ex.post([] {}));
}

TEST(Executor, WorkPostedByDrainingTasksStillRuns) {
  Executor ex(2);
  Event started, release;
  std::atomic<int> ran{0};
  ASSERT_TRUE(ex.post([&] {
    started.set();
    release.waitFor();
    // A continuation posted while the executor drains: must be accepted so chains finish.
    EXPECT_TRUE(ex.post([&] {
      ran.fetch_add(1);
      EXPECT_TRUE(ex.post([&] { ran.fetch_add(1); }));
    }));
  }));
  ASSERT_TRUE(started.waitFor());
  std::thread stopper([&] { ex.shutdown(); });
  ASSERT_TRUE(eventually([&] { return ex.isShutdown(); }));
  release.set();
  stopper.join();
  EXPECT_EQ(ran.load(), 2);
}

TEST(Executor, ShutdownIsIdempotentAndConcurrent) {
  Executor ex(2);
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(ex.post([&] { ran.fetch_add(1); }));
  std::thread a([&] { ex.shutdown(); });
  std::thread b([&] { ex.shutdown(); });
  a.join();
  b.join();
  ex.shutdown();
  EXPECT_EQ(ran.load(), 50);
}

TEST(Executor, ShutdownFromOwnThreadIsRefused) {
  Executor ex(2);
  Event done;
  bool threw = false;
  ASSERT_TRUE(ex.post([&] {
    try {
      ex.shutdown();
    } catch (const ValueError& e) {
      threw = std::string(e.what()).find("own threads") != std::string::npos;
    }
    done.set();
  }));
  ASSERT_TRUE(done.waitFor());
  EXPECT_TRUE(threw);
}

TEST(Executor, ThrowingTaskIsCountedAndWorkerSurvives) {
  Executor ex(1);
  Event done;
  ASSERT_TRUE(ex.post([] { throw std::runtime_error("task failure (expected by the test)"); }));
  ASSERT_TRUE(ex.post([&] { done.set(); }));
  ASSERT_TRUE(done.waitFor());
  ex.shutdown();
  EXPECT_EQ(ex.tasksFailed(), 1u);
  EXPECT_EQ(ex.tasksRun(), 2u);
}

TEST(Executor, EmptyTaskIsRejected) {
  Executor ex(2);
  EXPECT_THROW(ex.post(Task()), ValueError);
}

TEST(MoveOnlyFunction, StoresSmallAndLargeCallables) {
  detail::MoveOnlyFunction<int(int)> small = [](int x) { return x + 1; };
  std::array<char, 200> big{};
  big[0] = 5;
  detail::MoveOnlyFunction<int(int)> large = [big](int x) { return x + big[0]; };
  EXPECT_EQ(small(1), 2);
  EXPECT_EQ(large(1), 6);
  auto moved = std::move(large);
  EXPECT_FALSE(static_cast<bool>(large));  // NOLINT: testing the moved-from state
  EXPECT_EQ(moved(2), 7);
  auto counter = std::make_shared<int>(0);
  {
    detail::MoveOnlyFunction<void()> f = [counter] { ++*counter; };
    detail::MoveOnlyFunction<void()> g;
    g = std::move(f);
    g();
    EXPECT_EQ(counter.use_count(), 2);
  }
  EXPECT_EQ(*counter, 1);
  EXPECT_EQ(counter.use_count(), 1);
}

}  // namespace
}  // namespace distgrad::rpc
