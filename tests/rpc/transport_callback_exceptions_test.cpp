// Exceptions thrown by transport callbacks (frame handlers, send completions, accept callbacks, deferred
// tasks) never reach the loop (libuv is C code; an exception unwinding into it is undefined behaviour):
// the callback's connection is closed with a logged Error naming the exception, and the loop and the other
// connections keep working. Run for both transports.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <stdexcept>

#include "tests/rpc/async_test_util.h"
#include "tests/rpc/transport_test_util.h"

namespace distgrad::rpc::transport {
namespace {

using namespace testing;  // NOLINT

class CallbackExceptionTest : public ::testing::TestWithParam<std::string> {
 protected:
  bool isTcp() const { return GetParam() == "tcp"; }

  std::unique_ptr<Context> makeContext() {
    if (isTcp()) return createContext("tcp").value();
    return inproc::createInprocContext(hub_, {});
  }
  std::string listenAddress() { return isTcp() ? "127.0.0.1:0" : "server-" + std::to_string(++names_); }

  // Connects a new client connection from `client` to `listener`'s address.
  std::shared_ptr<Connection> connectTo(Context& client, const Listener& listener) {
    std::promise<Result<std::shared_ptr<Connection>>> connected;
    client.connect(listener.address(),
                   [&connected](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
    auto future = connected.get_future();
    EXPECT_EQ(future.wait_for(kWait), std::future_status::ready);
    auto result = future.get();
    EXPECT_TRUE(result.ok()) << (result.ok() ? "" : result.error().describe());
    return result.ok() ? result.value() : nullptr;
  }

  static OutgoingFrame frameWithIndex(uint64_t index) {
    OutgoingFrame frame;
    frame.envelope = envelopeWithIndex(index);
    return frame;
  }

  std::shared_ptr<inproc::InprocHub> hub_ = std::make_shared<inproc::InprocHub>();
  int names_ = 0;
};

// Accepts connections into a list of server ends (not started).
struct Acceptor {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<std::shared_ptr<Connection>> accepted;
  AcceptCallback callback() {
    return [this](std::shared_ptr<Connection> c) {
      std::lock_guard lock(mutex);
      accepted.push_back(std::move(c));
      changed.notify_all();
    };
  }
  std::shared_ptr<Connection> waitFor(size_t n) {
    std::unique_lock lock(mutex);
    if (!changed.wait_for(lock, kWait, [&] { return accepted.size() >= n; })) return nullptr;
    return accepted[n - 1];
  }
};

TEST_P(CallbackExceptionTest, ThrowingFrameHandlerClosesOnlyItsConnection) {
  auto server = makeContext();
  auto client = makeContext();
  Acceptor acceptor;
  auto listener = server->listen(listenAddress(), acceptor.callback()).value();
  auto clientA = connectTo(*client, *listener);
  auto clientB = connectTo(*client, *listener);
  ASSERT_TRUE(clientA && clientB);
  auto serverA = acceptor.waitFor(1);
  auto serverB = acceptor.waitFor(2);
  ASSERT_TRUE(serverA && serverB);

  // Server end A: a frame handler that throws on its first frame.
  std::mutex mutex;
  std::condition_variable changed;
  std::optional<Error> closedA;
  int framesA = 0;
  serverA->start(
      nullptr,
      [&](IncomingFrame&&) {
        {
          std::lock_guard lock(mutex);
          ++framesA;
        }
        throw std::runtime_error("handler exploded on purpose");
      },
      [&](const Error& error) {
        std::lock_guard lock(mutex);
        closedA = error;
        changed.notify_all();
      });
  Collector atServerB, atClientA, atClientB;
  atServerB.start(serverB);
  atClientA.start(clientA);
  atClientB.start(clientB);

  clientA->send(frameWithIndex(1), nullptr);
  {
    std::unique_lock lock(mutex);
    ASSERT_TRUE(changed.wait_for(lock, kWait, [&] { return closedA.has_value(); }));
    EXPECT_EQ(framesA, 1);
    EXPECT_EQ(closedA->kind, ErrorKind::kFailed);
    EXPECT_NE(closedA->message.find("handler exploded on purpose"), std::string::npos) << closedA->message;
    EXPECT_NE(closedA->message.find("frame handler"), std::string::npos) << closedA->message;
  }
  // The other end of A learns that its peer went away.
  ASSERT_TRUE(atClientA.waitClosed());
  EXPECT_EQ(atClientA.closed->kind, ErrorKind::kDisconnected);

  // The loop and connection B are unaffected: frames flow both ways.
  clientB->send(frameWithIndex(7), nullptr);
  ASSERT_TRUE(atServerB.waitFrames(1));
  EXPECT_EQ(indexOf(atServerB.frames[0]), 7u);
  serverB->send(frameWithIndex(8), nullptr);
  ASSERT_TRUE(atClientB.waitFrames(1));
  EXPECT_EQ(indexOf(atClientB.frames[0]), 8u);
  EXPECT_FALSE(atServerB.closed.has_value());

  // A new connection through the same listener is served too.
  auto clientC = connectTo(*client, *listener);
  ASSERT_TRUE(clientC);
  auto serverC = acceptor.waitFor(3);
  ASSERT_TRUE(serverC);
  Collector atServerC;
  atServerC.start(serverC);
  clientC->send(frameWithIndex(9), nullptr);
  ASSERT_TRUE(atServerC.waitFrames(1));
  EXPECT_EQ(indexOf(atServerC.frames[0]), 9u);
}

TEST_P(CallbackExceptionTest, ThrowingSendCallbackAndDeferredTaskKeepTheLoopAlive) {
  auto server = makeContext();
  auto client = makeContext();
  Acceptor acceptor;
  auto listener = server->listen(listenAddress(), acceptor.callback()).value();
  auto clientA = connectTo(*client, *listener);
  ASSERT_TRUE(clientA);
  auto serverA = acceptor.waitFor(1);
  ASSERT_TRUE(serverA);
  Collector atServer, atClient;
  atServer.start(serverA);
  atClient.start(clientA);

  std::atomic<int> throwingCallbacks{0};
  clientA->send(frameWithIndex(1), [&](const Result<void>&) {
    ++throwingCallbacks;
    throw std::runtime_error("send callback exploded on purpose");
  });
  ASSERT_TRUE(atServer.waitFrames(1));
  // A deferred task that throws: the loop logs it and runs the next task.
  client->defer([] { throw std::logic_error("deferred task exploded on purpose"); });
  std::promise<bool> ran;
  client->defer([&] { ran.set_value(client->inLoop()); });
  auto ranFuture = ran.get_future();
  ASSERT_EQ(ranFuture.wait_for(kWait), std::future_status::ready);
  EXPECT_TRUE(ranFuture.get());
  // The send's completion runs on a later loop iteration than the write (it may follow the deferred tasks).
  EXPECT_TRUE(::distgrad::rpc::testing::eventually([&] { return throwingCallbacks.load() == 1; })) << throwingCallbacks.load();

  // The client's loop still serves a fresh connection end to end.
  auto clientB = connectTo(*client, *listener);
  ASSERT_TRUE(clientB);
  auto serverB = acceptor.waitFor(2);
  ASSERT_TRUE(serverB);
  Collector atServerB, atClientB;
  atServerB.start(serverB);
  atClientB.start(clientB);
  SendTracker sends(1);
  clientB->send(frameWithIndex(5), sends.callback(0));
  ASSERT_TRUE(atServerB.waitFrames(1));
  EXPECT_EQ(indexOf(atServerB.frames[0]), 5u);
  ASSERT_TRUE(sends.waitDone(1));
  EXPECT_EQ(sends.ok, 1u);
  serverB->send(frameWithIndex(6), nullptr);
  ASSERT_TRUE(atClientB.waitFrames(1));
  if (isTcp()) {
    // tcp completes a send callback from its write callback (libuv): one that throws closes its connection.
    ASSERT_TRUE(atClient.waitClosed());
    EXPECT_NE(atClient.closed->message.find("send callback exploded on purpose"), std::string::npos)
        << atClient.closed->message;
  }
}

TEST_P(CallbackExceptionTest, ThrowingAcceptCallbackClosesThatConnectionAndTheListenerLivesOn) {
  auto server = makeContext();
  auto client = makeContext();
  std::atomic<int> accepts{0};
  Acceptor acceptor;
  auto keep = acceptor.callback();
  auto listener = server
                      ->listen(listenAddress(),
                               [&](std::shared_ptr<Connection> c) {
                                 if (accepts.fetch_add(1) == 0) throw std::runtime_error("accept exploded on purpose");
                                 keep(std::move(c));
                               })
                      .value();
  auto first = connectTo(*client, *listener);
  ASSERT_TRUE(first);
  Collector atFirst;
  atFirst.start(first);
  ASSERT_TRUE(atFirst.waitClosed());
  EXPECT_EQ(atFirst.closed->kind, ErrorKind::kDisconnected);

  auto second = connectTo(*client, *listener);
  ASSERT_TRUE(second);
  auto atServerEnd = acceptor.waitFor(1);
  ASSERT_TRUE(atServerEnd);
  Collector atServer;
  atServer.start(atServerEnd);
  second->send(frameWithIndex(3), nullptr);
  ASSERT_TRUE(atServer.waitFrames(1));
  EXPECT_EQ(indexOf(atServer.frames[0]), 3u);
  EXPECT_EQ(accepts.load(), 2);
}

INSTANTIATE_TEST_SUITE_P(Transports, CallbackExceptionTest, ::testing::Values("inproc", "tcp"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::rpc::transport
