// Future<T> as a coroutine return type and co_await on futures.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "rpc/async_test_util.h"
#include "rpc/future.h"

namespace distgrad::rpc {
namespace {

using namespace std::chrono_literals;
using testing::Event;
using testing::kTestTimeout;

template <typename T>
Result<T> waitResult(Future<T>& f) {
  EXPECT_TRUE(f.wait(kTestTimeout));
  return f.result();
}

Future<int> addOneLater(Executor& ex, Future<int> input) {
  int x = co_await std::move(input);
  co_return x + 1;
}

TEST(Coroutine, AwaitsAndReturns) {
  Executor ex(2);
  Promise<int> p(ex);
  Future<int> f = addOneLater(ex, p.getFuture());
  EXPECT_FALSE(f.isReady());
  p.setValue(41);
  EXPECT_EQ(f.get(), 42);
}

TEST(Coroutine, ResumesOnItsExecutorAfterWaiting) {
  Executor ex(2, "coro");
  Executor other(1, "other");
  Promise<int> p(other);  // completed by a foreign thread, bound to another executor
  const auto caller = std::this_thread::get_id();
  std::thread::id before, after;
  Executor* resumedOn = nullptr;
  auto body = [&](Executor& e, Future<int> input) -> Future<int> {
    before = std::this_thread::get_id();
    int x = co_await std::move(input);
    after = std::this_thread::get_id();
    resumedOn = Executor::current();
    co_return x;
  };
  Future<int> f = body(ex, p.getFuture());
  std::thread completer([&] { p.setValue(5); });
  EXPECT_EQ(f.get(), 5);
  completer.join();
  EXPECT_EQ(before, caller);  // eager start
  EXPECT_NE(after, caller);
  EXPECT_EQ(resumedOn, &ex);
  EXPECT_EQ(f.valid(), false);
}

TEST(Coroutine, ReadyFutureContinuesWithoutSuspending) {
  Executor ex(2);
  const auto caller = std::this_thread::get_id();
  std::thread::id after;
  auto body = [&](Executor& e) -> Future<int> {
    int x = co_await makeReadyFuture(3, e);
    after = std::this_thread::get_id();
    co_return x;
  };
  Future<int> f = body(ex);
  EXPECT_TRUE(f.isReady());
  EXPECT_EQ(after, caller);
  EXPECT_EQ(f.get(), 3);
}

TEST(Coroutine, WithoutExecutorOutsideAPoolIsRejected) {
  auto body = []() -> Future<int> { co_return 1; };
  EXPECT_THROW(body(), ValueError);
  // Inside a worker the current executor is used.
  Executor ex(2);
  Promise<int> out(ex);
  Future<int> outFuture = out.getFuture();
  ASSERT_TRUE(ex.post([&] {
    Future<int> f = body();
    EXPECT_EQ(f.executor(), &ex);
    out.setResult(f.result());
  }));
  EXPECT_EQ(outFuture.get(), 1);
}

TEST(Coroutine, ExceptionsBecomeErrorsAndRpcErrorsKeepTheirKind) {
  Executor ex(2);
  auto throwsStd = [](Executor& e) -> Future<int> {
    co_await makeReadyFuture(e);
    throw std::invalid_argument("bad shape [2, 3]");
  };
  Future<int> failing = throwsStd(ex);
  Result<int> r = waitResult(failing);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, ErrorKind::kFailed);
  EXPECT_EQ(r.error().message, "bad shape [2, 3]");
  EXPECT_EQ(r.error().remoteType, "std::invalid_argument");

  auto throwsRpc = [](Executor& e) -> Future<void> {
    co_await makeReadyFuture(e);
    throw RpcError(Error::timeout("nested call timed out").onWorker("w2"));
  };
  Future<void> f = throwsRpc(ex);
  Result<void> rv = waitResult(f);
  ASSERT_FALSE(rv.ok());
  EXPECT_EQ(rv.error().kind, ErrorKind::kTimeout);
  EXPECT_EQ(rv.error().worker, "w2");
}

TEST(Coroutine, AwaitedErrorsThrowAndCanBeCaughtOrInspected) {
  Executor ex(2);
  auto body = [](Executor& e) -> Future<std::string> {
    std::string trace;
    try {
      co_await makeErrorFuture<int>(Error::disconnected("peer died"), e);
      trace += "not reached;";
    } catch (const RpcError& err) {
      trace += std::string("caught ") + errorKindName(err.kind()) + ";";
    }
    Result<int> r = co_await makeErrorFuture<int>(Error::overloaded("busy"), e).asResult();
    trace += r.ok() ? "ok" : std::string("result ") + errorKindName(r.error().kind);
    co_return trace;
  };
  Future<std::string> f = body(ex);
  EXPECT_EQ(f.get(), "caught disconnected;result overloaded");
}

TEST(Coroutine, AwaitingAnUnawaitedErrorPropagates) {
  Executor ex(2);
  auto inner = [](Executor& e) -> Future<int> {
    co_await makeReadyFuture(e);
    co_return co_await makeErrorFuture<int>(Error::cancelled("cancel message"), e);
  };
  auto outer = [&](Executor& e) -> Future<int> {
    int x = co_await inner(e);
    co_return x + 1;
  };
  Future<int> f = outer(ex);
  Result<int> r = waitResult(f);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, ErrorKind::kCancelled);
}

TEST(Coroutine, VoidAndLvalueAwaits) {
  Executor ex(2);
  std::atomic<int> steps{0};
  auto body = [&](Executor& e) -> Future<void> {
    Future<void> a = makeReadyFuture(e);
    co_await a;  // lvalue: consumes `a`
    EXPECT_FALSE(a.valid());
    steps++;
    co_await makeReadyFuture(e).then([&] { steps++; });
  };
  Future<void> f = body(ex);
  f.get();
  EXPECT_EQ(steps.load(), 2);
}

// 10,000 levels of a coroutine awaiting itself: eager starts stop at the stack budget and continue on the
// executor (Note [Eager coroutine start]); completions are posted, so nothing recurses.
Future<int> depth(Executor& ex, int n) {
  if (n == 0) co_return 0;
  int below = co_await depth(ex, n - 1);
  co_return below + 1;
}

TEST(Coroutine, TenThousandNestedAwaitsOnTwoThreads) {
  Executor ex(2);
  Future<int> f = depth(ex, 10000);
  Result<int> r = waitResult(f);
  EXPECT_EQ(r.value(), 10000);
}

// Nested "requests": each handler awaits two sub-handlers that wait on a leaf completed from outside.
// 1,000 concurrent top-level handlers on a 2-thread pool: nothing blocks a worker, so nothing starves.
struct NestedCalls {
  Executor& ex;
  std::vector<Promise<int>> leaves;
  std::vector<Future<int>> leafFutures;

  Future<int> leaf(int i) { co_return co_await std::move(leafFutures[i]); }
  Future<int> middle(int i) {
    Future<int> a = leaf(2 * i);
    Future<int> b = leaf(2 * i + 1);
    int x = co_await std::move(a);
    int y = co_await std::move(b);
    co_return x + y;
  }
  Future<int> top(Executor&, int i) { co_return co_await middle(i) * 2; }
};

TEST(Coroutine, ThousandsOfConcurrentNestedWaitsDoNotStarveASmallPool) {
  constexpr int kRequests = 1000;
  Executor ex(2);
  NestedCalls calls{ex, {}, {}};
  for (int i = 0; i < 2 * kRequests; ++i) {
    calls.leaves.emplace_back(ex);
    calls.leafFutures.push_back(calls.leaves.back().getFuture());
  }
  std::vector<Future<int>> tops;
  // Start the handlers on the pool itself, as the agent would.
  Event started;
  ASSERT_TRUE(ex.post([&] {
    for (int i = 0; i < kRequests; ++i) tops.push_back(calls.top(ex, i));
    started.set();
  }));
  ASSERT_TRUE(started.waitFor());
  std::thread producer([&] {
    for (int i = 2 * kRequests - 1; i >= 0; --i) calls.leaves[i].setValue(i);
  });
  auto all = whenAll(std::move(tops));
  std::vector<Result<int>> results = all.get();
  producer.join();
  ASSERT_EQ(results.size(), static_cast<size_t>(kRequests));
  for (int i = 0; i < kRequests; ++i) EXPECT_EQ(results[i].value(), 2 * ((2 * i) + (2 * i + 1))) << i;
}

TEST(Coroutine, RefusedResumptionRunsInline) {
  // Note [Refused continuations]: the executor refuses the resumption, so the coroutine resumes on the
  // completing thread instead of being destroyed mid-flight.
  auto ex = std::make_unique<Executor>(1);
  Promise<int> p(*ex);
  Future<int> f = addOneLater(*ex, p.getFuture());
  ex->shutdown();
  p.setValue(1);
  ASSERT_TRUE(f.isReady());
  EXPECT_EQ(f.get(), 2);
}

}  // namespace
}  // namespace distgrad::rpc
