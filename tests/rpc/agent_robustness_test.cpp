// Agent robustness: concurrent and misplaced shutdown() calls, deadline timers that must not outlive their
// call, the callee's own deadline for a call whose cancel message never arrives, and reply continuations
// bound to a user executor that was shut down. Run over both transports.
#include <gtest/gtest.h>

#include <atomic>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "tests/rpc/agent_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::rpc::testing {
namespace {

// Waits on its token and returns the cancellation reason's message (so the caller sees who cancelled).
const Function<std::string(int64_t)> kWaitCancelReason{"wait_cancel_reason"};

class AgentRobustnessTest : public AgentFixture {
 protected:
  void start(ClusterSpec spec = {}) {
    spec.transport = GetParam();
    registry_ = makeRegistry(world_);
    World& world = world_;
    registry_.bind(kWaitCancelReason, [&world](const CallContext& ctx, int64_t) -> Future<std::string> {
      auto promise = std::make_shared<Promise<std::string>>(*Executor::current());
      Future<std::string> future = promise->getFuture();
      auto registration = ctx.token.onCancel([promise](const Error& reason) {
        promise->trySetValue(std::string(errorKindName(reason.kind)) + ": " + reason.message);
      });
      std::lock_guard<std::mutex> lock(world.mutex);
      world.registrations.push_back(std::move(registration));
      return future;
    });
    startCluster(cluster_, spec, world_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) {
      if (cluster_.errors[i]) {
        try {
          std::rethrow_exception(cluster_.errors[i]);
        } catch (const std::exception& e) {
          FAIL() << "rank " << i << " failed to start: " << e.what();
        }
      }
    }
  }
};

// (d) A shutdown() that arrives while another is tearing down must not return before the teardown is
// complete: its caller may destroy the agent (or what the agent's handlers use) as soon as it returns.
TEST_P(AgentRobustnessTest, ConcurrentShutdownWaitsUntilTheTeardownIsComplete) {
  start();
  Agent& a0 = agent(0);
  std::exception_ptr firstError;
  std::thread first([&] {
    try {
      a0.shutdown();  // graceful: waits at the first barrier until worker1 shuts down too
    } catch (...) {
      firstError = std::current_exception();
    }
  });
  ASSERT_TRUE(eventually([&] { return a0.shutdownStarted(); }));
  // While it waits for worker1 at the first barrier, worker0 still serves and calls as usual.
  EXPECT_EQ(a0.rpcSync("worker1", kAddInt, int64_t{1}, int64_t{1}), 2);
  Event secondReturned;
  std::atomic<bool> executorDownWhenSecondReturned{false};
  std::thread second([&] {
    a0.shutdown(false);
    executorDownWhenSecondReturned = a0.executor().isShutdown();
    secondReturned.set();
  });
  // The first call is parked at the barrier, so the second must still be waiting for it.
  EXPECT_FALSE(secondReturned.waitFor(100ms));
  agent(1).shutdown();  // meets worker0 at the barriers: the first shutdown completes
  first.join();
  second.join();
  EXPECT_TRUE(executorDownWhenSecondReturned.load()) << "shutdown() returned while another call was still tearing down";
  EXPECT_FALSE(firstError);
  a0.shutdown();  // later calls return at once
}

// (d) shutdown() on the agent's loop or timer thread (an inline-safe continuation runs on the thread that
// completed the future) would join that thread: it must be refused before anything is torn down.
TEST_P(AgentRobustnessTest, ShutdownOnTheLoopOrTimerThreadIsRefusedWithoutTearingDown) {
  start();
  const auto testThread = std::this_thread::get_id();
  // Loop thread: a reply completes its call's promise on the transport loop.
  Future<int64_t> hung = agent(0).rpcAsync("worker1", kHang, int64_t{1});
  ASSERT_TRUE(world_.hangStarted.waitFor());
  std::string loopError;
  bool loopOnTestThread = false;
  Event loopDone;
  Future<void> afterReply = std::move(hung).then(kInlineSafe, [&](Result<int64_t>&&) {
    loopOnTestThread = std::this_thread::get_id() == testThread;
    try {
      agent(0).shutdown(false);
    } catch (const ValueError& e) {
      loopError = e.what();
    }
    loopDone.set();
  });
  world_.completeHanging(0, 5);
  ASSERT_TRUE(loopDone.waitFor());
  ASSERT_FALSE(loopOnTestThread);
  EXPECT_NE(loopError.find("transport loop"), std::string::npos) << loopError;
  EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, int64_t{2}, int64_t{2}), 4);

  // Timer thread: a deadline fails its call from the timer thread.
  CallOptions options;
  options.timeout = 300ms;
  Future<int64_t> late = agent(0).rpcAsyncWith(options, "worker1", kHang, int64_t{2});
  std::string timerError;
  bool timerOnTestThread = false;
  std::optional<ErrorKind> lateKind;
  Event timerDone;
  Future<void> afterDeadline = std::move(late).then(kInlineSafe, [&](Result<int64_t>&& r) {
    timerOnTestThread = std::this_thread::get_id() == testThread;
    if (!r.ok()) lateKind = r.error().kind;
    try {
      agent(0).shutdown(false);
    } catch (const ValueError& e) {
      timerError = e.what();
    }
    timerDone.set();
  });
  ASSERT_TRUE(timerDone.waitFor());
  ASSERT_FALSE(timerOnTestThread) << "the deadline fired before then() was registered";
  EXPECT_EQ(lateKind, ErrorKind::kTimeout);
  EXPECT_NE(timerError.find("timer thread"), std::string::npos) << timerError;
  // Nothing was torn down: calls both ways still work.
  EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, int64_t{3}, int64_t{4}), 7);
  EXPECT_EQ(agent(1).rpcSync("worker0", kAddInt, int64_t{5}, int64_t{6}), 11);
  EXPECT_TRUE(afterReply.result().ok());
  EXPECT_TRUE(afterDeadline.result().ok());
}

// (f) Every deadline timer is cancelled when its call completes, on both sides, including a reply that
// beats the caller to recording its timer: afterwards only the heartbeat timer may be armed.
TEST_P(AgentRobustnessTest, NoDeadlineTimerOutlivesItsCall) {
  start();
  constexpr int kThreads = 4;
  constexpr int kCallsPerThread = 150;
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Agent& caller = agent(t % 2);
      const std::string callee = t % 2 == 0 ? "worker1" : "worker0";
      std::vector<Future<int64_t>> batch;
      for (int i = 0; i < kCallsPerThread; ++i) {
        batch.push_back(caller.rpcAsync(callee, kAddInt, int64_t{i}, int64_t{t}));  // default 20 s deadline
      }
      for (int i = 0; i < kCallsPerThread; ++i) {
        if (batch[i].get() != i + t) ++wrong;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
  // The callee cancels its own timer right after sending the reply, so give it a moment (bounded).
  EXPECT_TRUE(eventually([&] { return agent(0).armedTimers() <= 1 && agent(1).armedTimers() <= 1; }, 10s))
      << "armed timers: worker0 " << agent(0).armedTimers() << ", worker1 " << agent(1).armedTimers();
}

// (h) The callee cancels a call's token at the call's deadline on its own, even when the caller's cancel
// message never comes. Here the caller's timer thread is held by an inline-safe continuation (it runs on
// the thread that failed its call: the caller's timer thread), so the caller neither times the second call
// out nor sends a cancel for it; only the callee's own timer can end that handler.
TEST_P(AgentRobustnessTest, CalleeCancelsTheHandlerAtTheDeadlineWhenNoCancelArrives) {
  start();
  const auto testThread = std::this_thread::get_id();
  Event timerHeld;
  Event release;
  struct Release {
    Event& event;
    ~Release() { event.set(); }
  } releaseAtExit{release};
  std::atomic<bool> ranOnTestThread{false};
  CallOptions shortDeadline;
  shortDeadline.timeout = 200ms;
  Future<void> holder = agent(0).rpcAsyncWith(shortDeadline, "worker1", kHang, int64_t{1})
                            .then(kInlineSafe, [&](Result<int64_t>&&) {
                              if (std::this_thread::get_id() == testThread) {
                                ranOnTestThread = true;  // the deadline fired before then(): cannot hold it
                              } else {
                                timerHeld.set();
                                release.waitFor();
                              }
                            });
  ASSERT_FALSE(ranOnTestThread.load()) << "the deadline fired before then() was registered";
  ASSERT_TRUE(timerHeld.waitFor());

  CallOptions deadline;
  deadline.timeout = 300ms;
  const auto begin = SteadyTime::now();
  Future<std::string> waiting = agent(0).rpcAsyncWith(deadline, "worker1", kWaitCancelReason, int64_t{2});
  // Well under the 3 s heartbeat timeout (the caller's heartbeats stop while its timer thread is held).
  ASSERT_TRUE(waiting.wait(2500ms)) << "the callee did not cancel its handler at the call's deadline";
  const auto elapsed = SteadyTime::now() - begin;
  Result<std::string> r = waiting.result();
  // The handler returned normally with its token's reason: the caller never gave up on the call.
  ASSERT_TRUE(r.ok()) << r.error().describe();
  EXPECT_NE(r.value().find("timeout"), std::string::npos) << r.value();
  EXPECT_NE(r.value().find("expired on the callee"), std::string::npos) << r.value();
  EXPECT_NE(r.value().find("300 ms"), std::string::npos) << r.value();
  EXPECT_GE(elapsed, 300ms);
  release.set();
  EXPECT_TRUE(holder.result().ok());
  // Everything works afterwards.
  EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, int64_t{1}, int64_t{2}), 3);
}

// (g) A reply continuation bound to a user executor that was shut down before the reply came still runs
// (inline, on the thread completing the call) instead of being dropped with its side effects.
TEST_P(AgentRobustnessTest, ReplyContinuationOnAShutDownUserExecutorStillRuns) {
  start();
  auto user = std::make_unique<Executor>(1, "user");
  Future<int64_t> reply = agent(0).rpcAsync("worker1", kHang, int64_t{1}).via(*user);
  ASSERT_TRUE(world_.hangStarted.waitFor());
  Event ran;
  std::atomic<int64_t> seen{0};
  Future<void> after = std::move(reply).then([&](int64_t v) {
    seen = v;
    ran.set();
  });
  user->shutdown();
  world_.completeHanging(0, 7);
  ASSERT_TRUE(ran.waitFor(10s)) << "the continuation was dropped";
  EXPECT_EQ(seen.load(), 7);
  EXPECT_TRUE(after.result().ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, AgentRobustnessTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::rpc::testing
