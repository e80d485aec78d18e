#include "rpc/cancellation.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "rpc/async_test_util.h"

namespace distgrad::rpc {
namespace {

using testing::Event;

TEST(Cancellation, CallbacksRunOnceInOrderWithTheReason) {
  CancellationSource source;
  CancellationToken token = source.token();
  EXPECT_FALSE(token.isCancelled());
  EXPECT_FALSE(token.reason().has_value());
  std::vector<std::string> calls;
  auto a = token.onCancel([&](const Error& e) { calls.push_back("a:" + e.message); });
  auto b = token.onCancel([&](const Error& e) { calls.push_back(std::string("b:") + errorKindName(e.kind)); });
  EXPECT_TRUE(a.active());
  EXPECT_TRUE(source.cancel(Error::timeout("deadline of 50 ms passed")));
  EXPECT_FALSE(source.cancel());  // idempotent: the first reason stays
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0], "a:deadline of 50 ms passed");
  EXPECT_EQ(calls[1], "b:timeout");
  EXPECT_FALSE(a.active());
  EXPECT_TRUE(token.isCancelled());
  EXPECT_TRUE(source.isCancelled());
  EXPECT_EQ(token.reason()->kind, ErrorKind::kTimeout);
}

TEST(Cancellation, DefaultReasonIsCancelled) {
  CancellationSource source;
  source.cancel();
  EXPECT_EQ(source.token().reason()->kind, ErrorKind::kCancelled);
}

TEST(Cancellation, RegisteringAfterCancellationRunsImmediatelyOnCaller) {
  CancellationSource source;
  source.cancel();
  const auto caller = std::this_thread::get_id();
  std::thread::id ranOn;
  int runs = 0;
  auto reg = source.token().onCancel([&](const Error&) {
    ranOn = std::this_thread::get_id();
    ++runs;
  });
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(ranOn, caller);
  EXPECT_FALSE(reg.active());
}

TEST(Cancellation, DestroyedRegistrationNeverRuns) {
  CancellationSource source;
  int runs = 0;
  {
    auto reg = source.token().onCancel([&](const Error&) { ++runs; });
  }
  auto kept = source.token().onCancel([&](const Error&) { runs += 10; });
  auto reset = source.token().onCancel([&](const Error&) { runs += 100; });
  reset.reset();
  source.cancel();
  EXPECT_EQ(runs, 10);
}

TEST(Cancellation, DefaultTokenIsNeverCancelled) {
  CancellationToken token;
  EXPECT_FALSE(token.isCancelled());
  auto reg = token.onCancel([](const Error&) { FAIL() << "must not run"; });
  EXPECT_FALSE(reg.active());
}

TEST(Cancellation, UnregisterWaitsForARunningCallback) {
  using namespace std::chrono_literals;
  CancellationSource source;
  Event inCallback, release, resetReturned;
  std::atomic<bool> finished{false};
  CancellationRegistration reg = source.token().onCancel([&](const Error&) {
    inCallback.set();
    release.waitFor();
    finished = true;
  });
  std::thread canceller([&] { source.cancel(); });
  ASSERT_TRUE(inCallback.waitFor());
  std::thread unregisterer([&] {
    reg.reset();  // must not return while the callback runs on the canceller
    EXPECT_TRUE(finished.load());
    resetReturned.set();
  });
  EXPECT_FALSE(resetReturned.waitFor(20ms));
  release.set();
  EXPECT_TRUE(resetReturned.waitFor());
  unregisterer.join();
  canceller.join();
}

TEST(Cancellation, CallbackMayDestroyItsOwnRegistration) {
  CancellationSource source;
  CancellationRegistration reg;
  bool ran = false;
  reg = source.token().onCancel([&](const Error&) {
    reg.reset();  // same thread: must not deadlock
    ran = true;
  });
  source.cancel();
  EXPECT_TRUE(ran);
}

TEST(Cancellation, ConcurrentRegistrationAndCancelRunEachCallbackOnce) {
  for (int round = 0; round < 20; ++round) {
    CancellationSource source;
    constexpr int kThreads = 4, kPerThread = 50;
    std::atomic<int> runs{0};
    std::vector<std::vector<CancellationRegistration>> regs(kThreads);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = 0; i < kPerThread; ++i) regs[t].push_back(source.token().onCancel([&](const Error&) { runs++; }));
      });
    }
    std::thread canceller([&] { source.cancel(); });
    for (auto& t : threads) t.join();
    canceller.join();
    EXPECT_EQ(runs.load(), kThreads * kPerThread);
  }
}

TEST(Cancellation, ThrowingCallbackDoesNotStopTheOthers) {
  CancellationSource source;
  int runs = 0;
  auto a = source.token().onCancel([](const Error&) { throw std::runtime_error("callback failure (expected)"); });
  auto b = source.token().onCancel([&](const Error&) { ++runs; });
  source.cancel();
  EXPECT_EQ(runs, 1);
}

}  // namespace
}  // namespace distgrad::rpc
