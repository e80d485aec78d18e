#include "rpc/future.h"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "rpc/async_test_util.h"

namespace distgrad::rpc {
namespace {

using namespace std::chrono_literals;
using testing::Event;
using testing::kTestTimeout;

Result<int> waitResult(Future<int>& f) {
  EXPECT_TRUE(f.wait(kTestTimeout));
  return f.result();
}

// Note [Inline handlers]: under a ForbidBlockingScope a wait for a future that is not ready throws instead
// of blocking; a ready one is still taken, and the scope restores what was there before.
TEST(Future, BlockingWaitsThrowWhereBlockingIsForbidden) {
  Executor ex(2);
  Promise<int> ready(ex), pending(ex);
  ready.setValue(7);
  Future<int> readyFuture = ready.getFuture();
  Future<int> pendingFuture = pending.getFuture();
  {
    detail::ForbidBlockingScope outer;
    {
      detail::ForbidBlockingScope inner;
    }
    EXPECT_EQ(readyFuture.get(), 7);
    try {
      pendingFuture.wait();
      ADD_FAILURE() << "wait() blocked where blocking is forbidden";
    } catch (const RpcError& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kFailed);
      EXPECT_NE(std::string(e.what()).find("inside an inline handler"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)pendingFuture.wait(1ms), RpcError);
  }
  pending.setValue(8);
  EXPECT_EQ(pendingFuture.get(), 8);  // allowed again once the scope ended
}

TEST(Future, ValueAndErrorReachGetAndResult) {
  Executor ex(2);
  Promise<int> p(ex);
  Future<int> f = p.getFuture();
  EXPECT_TRUE(f.valid());
  EXPECT_FALSE(f.isReady());
  p.setValue(7);
  EXPECT_TRUE(f.isReady());
  EXPECT_EQ(f.get(), 7);
  EXPECT_FALSE(f.valid());  // get() consumes
  EXPECT_THROW(f.get(), ValueError);

  Promise<int> q(ex);
  Future<int> g = q.getFuture();
  q.setError(Error::timeout("rpc 'add' exceeded its 5 ms deadline").onWorker("worker1"));
  try {
    g.get();
    FAIL() << "get() should throw";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
    EXPECT_EQ(e.error().worker, "worker1");
    EXPECT_EQ(std::string(e.what()), "timeout on worker1: rpc 'add' exceeded its 5 ms deadline");
  }

  Promise<void> v(ex);
  Future<void> fv = v.getFuture();
  v.setValue();
  Result<void> r = fv.result();
  EXPECT_TRUE(r.ok());
}

TEST(Future, MoveOnlyValues) {
  Executor ex(2);
  Promise<std::unique_ptr<int>> p(ex);
  auto f = p.getFuture();
  p.setValue(std::make_unique<int>(3));
  auto g = std::move(f).then([](std::unique_ptr<int> v) { return std::make_unique<int>(*v * 2); });
  EXPECT_EQ(*g.get(), 6);
}

TEST(Future, CompletesExactlyOnce) {
  Executor ex(2);
  Promise<int> p(ex);
  auto f = p.getFuture();
  EXPECT_THROW(p.getFuture(), ValueError);
  p.setValue(1);
  EXPECT_THROW(p.setValue(2), InternalError);
  EXPECT_THROW(p.setError(Error::failed("late")), InternalError);
  EXPECT_FALSE(p.trySetValue(3));
  EXPECT_FALSE(p.trySetError(Error::failed("late")));
  EXPECT_TRUE(p.isCompleted());
  EXPECT_EQ(f.get(), 1);
}

TEST(Future, ConcurrentCompletionsHaveOneWinner) {
  Executor ex(2);
  for (int round = 0; round < 20; ++round) {
    auto p = std::make_shared<Promise<int>>(ex);
    auto f = p->getFuture();
    std::atomic<int> winners{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        bool won = (t % 2 == 0) ? p->trySetValue(t) : p->trySetError(Error::timeout("deadline"));
        if (won) winners.fetch_add(1);
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(winners.load(), 1);
    Result<int> r = waitResult(f);
    if (r.ok()) {
      EXPECT_EQ(r.value() % 2, 0);
    } else {
      EXPECT_EQ(r.error().kind, ErrorKind::kTimeout);
    }
  }
}

TEST(Future, BrokenPromiseFailsTheWaiter) {
  Executor ex(2);
  Future<int> f;
  {
    Promise<int> p(ex);
    f = p.getFuture();
  }
  Result<int> r = waitResult(f);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, ErrorKind::kFailed);
  EXPECT_NE(r.error().message.find("broken promise"), std::string::npos);

  // Move-assigning over a pending promise breaks the old one.
  Promise<int> a(ex);
  auto fa = a.getFuture();
  a = Promise<int>(ex);
  Result<int> ra = waitResult(fa);
  ASSERT_FALSE(ra.ok());
  EXPECT_NE(ra.error().message.find("broken promise"), std::string::npos);
}

TEST(Future, WaitTimesOutThenSucceeds) {
  Executor ex(2);
  Promise<int> p(ex);
  auto f = p.getFuture();
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(f.wait(20ms));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 20ms);
  std::thread setter([&] { p.setValue(5); });
  EXPECT_TRUE(f.wait(kTestTimeout));
  setter.join();
  EXPECT_TRUE(f.isReady());
  EXPECT_EQ(f.get(), 5);
}

TEST(Future, ThenOnReadyFutureDoesNotRunInsideThen) {
  Executor ex(2);
  auto f = makeReadyFuture(1, ex);
  const auto caller = std::this_thread::get_id();
  std::atomic<bool> thenReturned{false};
  std::atomic<bool> ranInline{false};
  std::thread::id ranOn;
  auto g = f.then([&](int v) {
    ranOn = std::this_thread::get_id();
    ranInline = !thenReturned.load();
    return v + 1;
  });
  thenReturned = true;
  EXPECT_EQ(g.get(), 2);
  EXPECT_NE(ranOn, caller);
  EXPECT_FALSE(ranInline.load() && ranOn == caller);
}

TEST(Future, ContinuationDoesNotRunInsideSetValue) {
  Executor ex(2);
  Promise<int> p(ex);
  const auto caller = std::this_thread::get_id();
  std::thread::id ranOn;
  Executor* ranOnExecutor = nullptr;
  auto g = p.getFuture().then([&](int v) {
    ranOn = std::this_thread::get_id();
    ranOnExecutor = Executor::current();
    return v * 10;
  });
  p.setValue(4);
  EXPECT_EQ(g.get(), 40);
  EXPECT_NE(ranOn, caller);
  EXPECT_EQ(ranOnExecutor, &ex);
}

TEST(Future, InlineSafeContinuationRunsOnCompletingThread) {
  Executor ex(2);
  Promise<int> p(ex);
  const auto caller = std::this_thread::get_id();
  std::thread::id ranOn;
  auto g = p.getFuture().then(kInlineSafe, [&](int v) {
    ranOn = std::this_thread::get_id();
    return v + 1;
  });
  p.setValue(1);
  EXPECT_EQ(ranOn, caller);  // ran inside setValue, before it returned
  EXPECT_EQ(g.get(), 2);
}

// Note [Continuations here]: on a worker of the continuations' executor, inside the scope, a completion
// runs the chain of continuations it triggers before it returns, on this thread; outside the scope, or for
// a continuation bound to another executor, they are posted as usual.
TEST(Future, ContinuationsHereRunTheChainOnTheCompletingWorker) {
  Executor ex(1);  // one worker: what is posted cannot run before this task returns
  Executor other(1, "other");
  Event done;
  std::thread::id worker;
  std::vector<std::thread::id> ranOn(2);
  bool ranBeforeReturn = false;
  bool postedOutsideScope = false;
  std::atomic<bool> otherRanHere{true};
  ASSERT_TRUE(ex.post([&] {
    worker = std::this_thread::get_id();
    Promise<int> p(ex);
    auto chain = p.getFuture()
                     .then([&](int v) {
                       ranOn[0] = std::this_thread::get_id();
                       return v + 1;
                     })
                     .then([&](int v) {
                       ranOn[1] = std::this_thread::get_id();
                       return v + 1;
                     });
    Promise<int> elsewhere(ex);
    auto onOther = elsewhere.getFuture().via(other).then([&](int) { otherRanHere = Executor::current() == &ex; });
    {
      ContinuationsHere here;
      p.setValue(1);
      elsewhere.setValue(0);
    }
    ranBeforeReturn = chain.isReady() && chain.result().value() == 3;
    // Outside the scope: posted, so not run before setValue returns.
    Promise<int> q(ex);
    auto later = q.getFuture().then([](int) {});
    q.setValue(0);
    postedOutsideScope = !later.isReady();
    done.set();
  }));
  ASSERT_TRUE(done.waitFor());
  EXPECT_TRUE(ranBeforeReturn);
  EXPECT_EQ(ranOn[0], worker);
  EXPECT_EQ(ranOn[1], worker);
  EXPECT_TRUE(postedOutsideScope);
  ex.shutdown();
  other.shutdown();
  EXPECT_FALSE(otherRanHere.load());
}

// Note [Following the task] (rpc/executor.cpp): then() on a ready future, called on a worker of its
// executor, runs after the current task on that worker (never inside then(), and the other worker is not
// woken for it).
TEST(Future, ThenOnAReadyFutureOnAWorkerRunsAfterTheTaskOnThatWorker) {
  Executor ex(2);
  std::atomic<bool> taskEnded{false}, ranAfterTheTask{false};
  std::thread::id worker, ranOn;
  Event done;
  ASSERT_TRUE(ex.post([&] {
    worker = std::this_thread::get_id();
    std::this_thread::sleep_for(20ms);  // the other worker is asleep by now
    (void)makeReadyFuture(1, ex).then([&](int) {
      ranOn = std::this_thread::get_id();
      ranAfterTheTask = taskEnded.load();
      done.set();
    });
    std::this_thread::sleep_for(50ms);
    taskEnded = true;
  }));
  ASSERT_TRUE(done.waitFor());
  EXPECT_EQ(ranOn, worker);
  EXPECT_TRUE(ranAfterTheTask);
}

// A continuation completed once a posted continuation's function returned (the task's tail) follows it on
// the same worker; one completed inside the function's body is posted at once, so it runs beside the body.
TEST(Future, TheTailOfAContinuationKeepsTheNextOnItsWorkerAndItsBodyDoesNot) {
  Executor ex(2);
  int elsewhere = 0;  // a posted second continuation often lands on the first's worker too: repeat
  for (int round = 0; round < 20; ++round) {
    std::this_thread::sleep_for(5ms);  // both workers asleep
    Promise<int> start(ex);
    std::thread::id first, second;
    auto chain = start.getFuture()
                     .then([&](int v) {
                       first = std::this_thread::get_id();
                       return v + 1;
                     })
                     .then([&](int v) {
                       second = std::this_thread::get_id();
                       return v + 1;
                     });
    start.setValue(1);
    ASSERT_TRUE(chain.wait(kTestTimeout));
    EXPECT_EQ(chain.get(), 3);
    elsewhere += second != first;
  }
  EXPECT_EQ(elsewhere, 0);

  Promise<int> outer(ex);
  std::atomic<bool> innerRanDuringBody{false};
  Event innerRan;
  auto body = outer.getFuture().then([&](int) {
    Promise<int> inner(ex);
    auto innerDone = inner.getFuture().then([&](int) { innerRan.set(); });
    inner.setValue(0);
    innerRanDuringBody = innerRan.waitFor();  // runs on the other worker while this body waits
  });
  outer.setValue(0);
  ASSERT_TRUE(body.wait(kTestTimeout));
  EXPECT_TRUE(innerRanDuringBody);
}

// The scope changes nothing on a thread that is no worker of the continuation's executor.
TEST(Future, ContinuationsHereOffTheExecutorStillPost) {
  Executor ex(1);
  Promise<int> p(ex);
  std::thread::id ranOn;
  auto g = p.getFuture().then([&](int) { ranOn = std::this_thread::get_id(); });
  {
    ContinuationsHere here;
    p.setValue(0);
  }
  ASSERT_TRUE(g.wait(kTestTimeout));
  EXPECT_NE(ranOn, std::this_thread::get_id());
}

TEST(Future, ViaRebindsContinuations) {
  Executor a(1, "exec-a");
  Executor b(1, "exec-b");
  Promise<int> p(a);
  Executor* ranOn = nullptr;
  auto g = p.getFuture().via(b).then([&](int v) {
    ranOn = Executor::current();
    return v;
  });
  EXPECT_EQ(g.executor(), &b);
  p.setValue(3);
  EXPECT_EQ(g.get(), 3);
  EXPECT_EQ(ranOn, &b);
}

TEST(Future, ErrorsSkipValueContinuationsAndReachResultContinuations) {
  Executor ex(2);
  std::atomic<int> valueSteps{0};
  auto f = makeErrorFuture<int>(Error::overloaded("queue full").onWorker("ps"), ex)
               .then([&](int v) {
                 valueSteps++;
                 return v + 1;
               })
               .then([&](int v) {
                 valueSteps++;
                 return std::to_string(v);
               })
               .then([](Result<std::string> r) -> int {
                 EXPECT_FALSE(r.ok());
                 EXPECT_EQ(r.error().kind, ErrorKind::kOverloaded);
                 EXPECT_EQ(r.error().worker, "ps");
                 return r.ok() ? 0 : -1;
               });
  EXPECT_EQ(f.get(), -1);
  EXPECT_EQ(valueSteps.load(), 0);
}

TEST(Future, ExceptionsInContinuationsBecomeErrors) {
  Executor ex(2);
  auto f = makeReadyFuture(1, ex).then([](int) -> int { throw std::out_of_range("index 9 of 3"); });
  Result<int> r = waitResult(f);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, ErrorKind::kFailed);
  EXPECT_EQ(r.error().message, "index 9 of 3");
  EXPECT_EQ(r.error().remoteType, "std::out_of_range");

  auto g = makeReadyFuture(1, ex).then([](int) -> int { throw RpcError(Error::unimplemented("no 'mul'")); });
  Result<int> rg = waitResult(g);
  ASSERT_FALSE(rg.ok());
  EXPECT_EQ(rg.error().kind, ErrorKind::kUnimplemented);
  EXPECT_EQ(rg.error().message, "no 'mul'");
}

TEST(Future, ResultAndVoidReturningContinuations) {
  Executor ex(2);
  auto f = makeReadyFuture(2, ex).then([](int v) -> Result<double> {
    if (v > 1) return Error::failed("too big");
    return 1.0;
  });
  Result<double> r = f.result();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().message, "too big");

  std::atomic<int> seen{0};
  Future<void> done = makeReadyFuture(9, ex).then([&](int v) { seen = v; });
  done.get();
  EXPECT_EQ(seen.load(), 9);
  auto next = makeReadyFuture(ex).then([] { return 5; });
  EXPECT_EQ(next.get(), 5);
}

TEST(Future, FutureReturningContinuationsAreFlattened) {
  Executor ex(2);
  Promise<std::string> inner(ex);
  Future<std::string> innerFuture = inner.getFuture();
  Event started;
  auto f = makeReadyFuture(3, ex).then([&](int v) {
    started.set();
    return std::move(innerFuture).then([v](std::string s) { return s + std::to_string(v); });
  });
  static_assert(std::is_same_v<decltype(f), Future<std::string>>);
  ASSERT_TRUE(started.waitFor());
  EXPECT_FALSE(f.wait(1ms));
  inner.setValue("x");
  EXPECT_EQ(f.get(), "x3");

  // An inner error propagates through the flattening.
  auto g = makeReadyFuture(1, ex).then([&](int) { return makeErrorFuture<int>(Error::disconnected("peer gone"), ex); });
  Result<int> rg = waitResult(g);
  ASSERT_FALSE(rg.ok());
  EXPECT_EQ(rg.error().kind, ErrorKind::kDisconnected);
}

TEST(Future, LongThenChainDoesNotOverflowOrStarve) {
  Executor ex(2);
  Promise<int> start(ex);
  Future<int> f = start.getFuture();
  for (int i = 0; i < 10000; ++i) f = f.then([](int v) { return v + 1; });
  start.setValue(0);
  Result<int> r = waitResult(f);
  EXPECT_EQ(r.value(), 10000);
}

// Recursion through flattening: each level's future completes when the next level's does, so completion
// forwards through 10,000 inline-safe forwarders (posted past the inline depth limit, not recursed).
struct CountDown {
  Executor& ex;
  Future<void> gateFuture;
  Event bottomed;

  Future<int> run(int n) {
    if (n == 0) {
      Future<int> last = std::move(gateFuture).then([] { return 0; });
      bottomed.set();
      return last;
    }
    return makeReadyFuture(n, ex).then(
        [this](int v) { return run(v - 1).then(kInlineSafe, [](int x) { return x + 1; }); });
  }
};

TEST(Future, DeepFlatteningDoesNotOverflow) {
  Executor ex(2);
  Promise<void> gate(ex);
  CountDown countDown{ex, gate.getFuture(), Event()};
  Future<int> f = countDown.run(10000);
  ASSERT_TRUE(countDown.bottomed.waitFor());
  gate.setValue();
  Result<int> r = waitResult(f);
  EXPECT_EQ(r.value(), 10000);
}

TEST(Future, WhenAllKeepsOrderAndMixedResults) {
  Executor ex(2);
  std::vector<Promise<int>> promises;
  std::vector<Future<int>> futures;
  for (int i = 0; i < 4; ++i) {
    promises.emplace_back(ex);
    futures.push_back(promises.back().getFuture());
  }
  auto all = whenAll(std::move(futures));
  std::thread t1([&] { promises[3].setValue(30); });
  std::thread t2([&] { promises[1].setError(Error::cancelled("caller cancelled")); });
  t1.join();
  t2.join();
  EXPECT_FALSE(all.wait(1ms));
  promises[0].setValue(0);
  promises[2].setValue(20);
  std::vector<Result<int>> results = all.get();
  ASSERT_EQ(results.size(), 4u);
  EXPECT_EQ(results[0].value(), 0);
  ASSERT_FALSE(results[1].ok());
  EXPECT_EQ(results[1].error().kind, ErrorKind::kCancelled);
  EXPECT_EQ(results[2].value(), 20);
  EXPECT_EQ(results[3].value(), 30);
}

TEST(Future, WhenAllEdgeCases) {
  Executor ex(2);
  auto empty = whenAll(std::vector<Future<int>>{}, &ex);
  EXPECT_TRUE(empty.get().empty());
  EXPECT_THROW(whenAll(std::vector<Future<int>>{}), ValueError);
  std::vector<Future<int>> withInvalid;
  withInvalid.emplace_back();
  EXPECT_THROW(whenAll(std::move(withInvalid)), ValueError);

  std::vector<Future<void>> voids;
  for (int i = 0; i < 1000; ++i) voids.push_back(makeReadyFuture(ex));
  auto all = whenAll(std::move(voids));
  auto results = all.get();
  EXPECT_EQ(results.size(), 1000u);
  for (auto& r : results) EXPECT_TRUE(r.ok());
}

// Note [Refused continuations]: a continuation the executor refuses still runs, inline on the completing
// thread, so its downstream future gets the real value and its side effects happen.
TEST(Future, ContinuationRefusedByShutdownExecutorRunsInline) {
  auto ex = std::make_unique<Executor>(1);
  Promise<int> p(*ex);
  std::thread::id ranOn;
  auto f = p.getFuture().then([&ranOn](int v) {
    ranOn = std::this_thread::get_id();
    return v + 1;
  });
  ex->shutdown();
  p.setValue(1);  // refused by the executor: runs here, inside setValue
  EXPECT_EQ(ranOn, std::this_thread::get_id());
  ASSERT_TRUE(f.isReady());
  EXPECT_EQ(f.get(), 2);
}

TEST(Future, ContinuationOnShutdownExecutorStillSignalsItsWaiter) {
  // A void continuation whose only effect is to wake someone outside the future system: dropping it would
  // hang that waiter forever. Also then() on a future that is already complete.
  auto ex = std::make_unique<Executor>(1);
  Promise<int> p(*ex);
  Future<int> ready = p.getFuture();
  ex->shutdown();
  std::thread completer([&] { p.setValue(41); });
  completer.join();
  Event signalled;
  int seen = 0;
  auto done = ready.then([&](int v) {
    seen = v;
    signalled.set();
  });
  ASSERT_TRUE(signalled.waitFor());
  EXPECT_EQ(seen, 41);
  EXPECT_TRUE(done.result().ok());
}

TEST(Future, InvalidFutureIsAnError) {
  Future<int> f;
  EXPECT_FALSE(f.valid());
  EXPECT_THROW(f.isReady(), ValueError);
  EXPECT_THROW(f.then([](int v) { return v; }), ValueError);
}

}  // namespace
}  // namespace distgrad::rpc
