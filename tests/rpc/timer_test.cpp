#include "rpc/timer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "rpc/async_test_util.h"
#include "rpc/future.h"

namespace distgrad::rpc {
namespace {

using namespace std::chrono_literals;
using testing::Event;
using testing::eventually;

TEST(ManualClock, MovesOnlyForwardWhenTold) {
  ManualClock clock;
  auto t0 = clock.now();
  clock.advance(5ms);
  EXPECT_EQ(clock.now() - t0, 5ms);
  clock.set(t0);  // backwards: ignored
  EXPECT_EQ(clock.now() - t0, 5ms);
  EXPECT_THROW(clock.advance(-1ms), ValueError);
  int heard = 0;
  uint64_t id = clock.addListener([&] { ++heard; });
  clock.advance(1ms);
  clock.removeListener(id);
  clock.advance(1ms);
  EXPECT_EQ(heard, 1);
}

TEST(TimerQueue, FiresInDeadlineOrderThenScheduleOrder) {
  ManualClock clock;
  TimerQueue timers(&clock);
  std::mutex mutex;
  std::vector<int> fired;
  Event firstBatch(3), all(5);
  auto record = [&](int v, Event& e) {
    return [&, v] {
      {
        std::lock_guard<std::mutex> lock(mutex);
        fired.push_back(v);
      }
      firstBatch.set();
      all.set();
    };
  };
  auto t0 = clock.now();
  timers.schedule(t0 + 30ms, record(30, all));
  timers.schedule(t0 + 10ms, record(10, all));
  timers.schedule(t0 + 20ms, record(20, all));
  timers.schedule(t0 + 10ms, record(11, all));  // same deadline: after 10
  timers.schedule(t0 + 50ms, record(50, all));
  EXPECT_EQ(timers.pending(), 5u);
  clock.advance(25ms);
  ASSERT_TRUE(firstBatch.waitFor());
  {
    std::lock_guard<std::mutex> lock(mutex);
    EXPECT_EQ(fired, (std::vector<int>{10, 11, 20}));
  }
  EXPECT_TRUE(eventually([&] { return timers.pending() == 2u; }));
  clock.advance(100ms);
  ASSERT_TRUE(all.waitFor());
  std::lock_guard<std::mutex> lock(mutex);
  EXPECT_EQ(fired, (std::vector<int>{10, 11, 20, 30, 50}));
}

TEST(TimerQueue, DueTimerFiresWithoutAdvancing) {
  ManualClock clock;
  TimerQueue timers(&clock);
  Event fired;
  timers.schedule(clock.now(), [&] { fired.set(); });
  EXPECT_TRUE(fired.waitFor());
}

TEST(TimerQueue, CancelledTimersNeverFire) {
  ManualClock clock;
  TimerQueue timers(&clock);
  std::atomic<int> fired{0};
  Event last;
  auto t0 = clock.now();
  TimerId a = timers.schedule(t0 + 10ms, [&] { fired += 1; });
  TimerId b = timers.schedule(t0 + 20ms, [&] { fired += 100; });
  timers.schedule(t0 + 30ms, [&] { last.set(); });
  EXPECT_NE(a, kInvalidTimerId);
  EXPECT_TRUE(timers.cancel(b));
  EXPECT_FALSE(timers.cancel(b));
  EXPECT_FALSE(timers.cancel(12345));
  clock.advance(40ms);
  ASSERT_TRUE(last.waitFor());
  EXPECT_EQ(fired.load(), 1);
  EXPECT_FALSE(timers.cancel(a));  // already fired
  EXPECT_EQ(timers.pending(), 0u);
}

TEST(TimerQueue, RealClockFiresAfterTheDeadline) {
  TimerQueue timers;
  Event fired;
  auto start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point firedAt;
  timers.scheduleAfter(20ms, [&] {
    firedAt = std::chrono::steady_clock::now();
    fired.set();
  });
  ASSERT_TRUE(fired.waitFor());
  EXPECT_GE(firedAt - start, 20ms);
}

TEST(TimerQueue, EarlierTimerScheduledLaterStillFiresFirst) {
  TimerQueue timers;  // real clock: the loop is already waiting for the 1 h timer
  Event fired;
  timers.scheduleAfter(std::chrono::hours(1), [] {});
  timers.scheduleAfter(1ms, [&] { fired.set(); });
  EXPECT_TRUE(fired.waitFor());
  EXPECT_EQ(timers.pending(), 1u);
}

TEST(TimerQueue, ShutdownDropsPendingTimersAndBreaksTheirPromises) {
  Executor ex(2);
  ManualClock clock;
  auto timers = std::make_unique<TimerQueue>(&clock);
  Promise<int> p(ex);
  Future<int> f = p.getFuture();
  timers->schedule(clock.now() + 1s, [p = std::move(p)]() mutable { p.setValue(1); });
  timers->shutdown();
  timers->shutdown();  // idempotent
  EXPECT_EQ(timers->pending(), 0u);
  EXPECT_EQ(timers->schedule(clock.now(), [] {}), kInvalidTimerId);
  Result<int> r = f.result();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("broken promise"), std::string::npos);
}

TEST(TimerQueue, DeadlineCompletesAPromiseRacingWithItsResponse) {
  // The agent's pattern: a response and a deadline race to complete one promise; exactly one wins.
  Executor ex(2);
  ManualClock clock;
  TimerQueue timers(&clock);
  auto p = std::make_shared<Promise<int>>(ex);
  Future<int> f = p->getFuture();
  TimerId deadline = timers.schedule(clock.now() + 50ms, [p] { p->trySetError(Error::timeout("50 ms deadline")); });
  clock.advance(60ms);
  ASSERT_TRUE(f.wait(testing::kTestTimeout));
  EXPECT_FALSE(p->trySetValue(1));  // the late response loses
  EXPECT_FALSE(timers.cancel(deadline));
  Result<int> r = f.result();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, ErrorKind::kTimeout);
}

TEST(TimerQueue, CallbacksMayScheduleAndCancel) {
  ManualClock clock;
  TimerQueue timers(&clock);
  Event done;
  TimerId victim = timers.schedule(clock.now() + 100ms, [] { FAIL() << "cancelled timer fired"; });
  timers.schedule(clock.now(), [&] {
    EXPECT_TRUE(timers.cancel(victim));
    timers.schedule(timers.clock().now(), [&] { done.set(); });
    EXPECT_THROW(timers.shutdown(), ValueError);
  });
  ASSERT_TRUE(done.waitFor());
  clock.advance(1s);
  EXPECT_TRUE(eventually([&] { return timers.pending() == 0u; }));
}

}  // namespace
}  // namespace distgrad::rpc
