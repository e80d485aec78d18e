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
