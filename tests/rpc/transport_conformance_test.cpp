// The transport conformance suite: every transport runs the same tests (TEST_P over the transport name).
#include <atomic>
#include <functional>
#include <future>
#include <thread>

#include "tests/rpc/transport_test_util.h"

namespace distgrad::rpc::transport {
namespace {

using namespace testing;  // NOLINT

class TransportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "ucx" && !ucxUnavailableReason().empty()) {
      GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
    }
  }
  // tcp and ucx: real connections between sockaddrs that receive into the allocator's buffers.
  bool isNetwork() const { return GetParam() != "inproc"; }

  // Contexts of one test reach each other (inproc: through one shared hub).
  std::unique_ptr<Context> makeContext(const ContextOptions& options = {}) {
    if (isNetwork()) {
      auto created = createContext(GetParam(), options);
      EXPECT_TRUE(created.ok()) << (created.ok() ? "" : created.error().describe());
      return std::move(created).value();
    }
    return inproc::createInprocContext(hub_, options);
  }
  std::string listenAddress() {
    return isNetwork() ? "127.0.0.1:0" : "server-" + std::to_string(++names_);
  }

  struct Pair {
    std::unique_ptr<Listener> listener;
    std::shared_ptr<Connection> server, client;
  };
  // Listens on `serverContext`, connects from `clientContext`, returns both ends (not started).
  Pair connectPair(Context& serverContext, Context& clientContext) {
    Pair pair;
    std::promise<std::shared_ptr<Connection>> accepted;
    auto listening = serverContext.listen(listenAddress(), [&accepted](std::shared_ptr<Connection> c) {
      accepted.set_value(std::move(c));
    });
    EXPECT_TRUE(listening.ok()) << (listening.ok() ? "" : listening.error().describe());
    pair.listener = std::move(listening).value();
    std::promise<Result<std::shared_ptr<Connection>>> connected;
    clientContext.connect(pair.listener->address(),
                          [&connected](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
    auto connectedFuture = connected.get_future();
    EXPECT_EQ(connectedFuture.wait_for(kWait), std::future_status::ready);
    auto client = connectedFuture.get();
    EXPECT_TRUE(client.ok()) << (client.ok() ? "" : client.error().describe());
    pair.client = std::move(client).value();
    auto acceptedFuture = accepted.get_future();
    EXPECT_EQ(acceptedFuture.wait_for(kWait), std::future_status::ready);
    pair.server = acceptedFuture.get();
    return pair;
  }

  // The opening of most tests: two contexts, a connection between them, a Collector started on each end.
  // Members in the order the tests used to declare them, so they are destroyed in the same order.
  struct Session {
    std::unique_ptr<Context> server, client;
    Pair pair;
    Collector atServer, atClient;
  };
  // `serverOptions` configure the server's context, `serverAllocate` is its end's PayloadAllocator.
  void open(Session& session, const ContextOptions& serverOptions = {}, PayloadAllocator serverAllocate = nullptr) {
    session.server = makeContext(serverOptions);
    session.client = makeContext();
    session.pair = connectPair(*session.server, *session.client);
    session.atServer.start(session.pair.server, std::move(serverAllocate));
    session.atClient.start(session.pair.client);
  }

  std::shared_ptr<inproc::InprocHub> hub_ = std::make_shared<inproc::InprocHub>();
  int names_ = 0;
};

void expectSameBytes(const PayloadBuffer& got, const Bytes& want, const std::string& what) {
  ASSERT_EQ(got.size, want.data->size()) << what;
  if (got.size > 0) {
    ASSERT_NE(got.data, nullptr) << what;
    EXPECT_EQ(std::memcmp(got.data, want.data->data(), got.size), 0) << what;
  }
}

TEST_P(TransportTest, ExchangesFramesWithZeroToManyPayloadsOfVariousSizes) {
  Session session;
  open(session);
  auto& [server, client, pair, atServer, atClient] = session;

  const std::vector<std::vector<size_t>> layouts = {
      {}, {0}, {1}, {63}, {64}, {65}, {0, 1, 2, 3}, {100003, 7, 4097, 0, 65536}, {1 << 20}};
  std::vector<std::vector<Bytes>> sent;
  SendTracker sends(layouts.size() * 2);
  for (size_t i = 0; i < layouts.size(); ++i) {
    OutgoingFrame frame;
    frame.flags = static_cast<uint16_t>(i + 1);
    frame.envelope = envelopeWithIndex(i, 8 + 13 * i);
    std::vector<Bytes> payloads;
    for (size_t j = 0; j < layouts[i].size(); ++j) {
      payloads.push_back(patternBytes(layouts[i][j], static_cast<uint32_t>(i * 100 + j)));
      frame.payloads.push_back(payloads.back().buffer());
    }
    sent.push_back(payloads);
    OutgoingFrame back = frame;
    pair.client->send(std::move(frame), sends.callback(i));
    pair.server->send(std::move(back), sends.callback(layouts.size() + i));
  }
  ASSERT_TRUE(atServer.waitFrames(layouts.size()));
  ASSERT_TRUE(atClient.waitFrames(layouts.size()));
  ASSERT_TRUE(sends.waitDone(layouts.size() * 2));
  EXPECT_EQ(sends.failed, 0u);
  for (Collector* side : {&atServer, &atClient}) {
    std::lock_guard lock(side->mutex);
    ASSERT_EQ(side->frames.size(), layouts.size());
    for (size_t i = 0; i < layouts.size(); ++i) {
      const auto& f = side->frames[i];
      EXPECT_EQ(f.flags, i + 1);
      EXPECT_EQ(f.envelope, envelopeWithIndex(i, 8 + 13 * i));
      ASSERT_EQ(f.payloads.size(), layouts[i].size());
      for (size_t j = 0; j < layouts[i].size(); ++j) {
        expectSameBytes(f.payloads[j], sent[i][j], "frame " + std::to_string(i) + " payload " + std::to_string(j));
      }
    }
  }
  for (int c : sends.calls) EXPECT_EQ(c, 1);
  pair.client->close();
  ASSERT_TRUE(atServer.waitClosed());
  ASSERT_TRUE(atClient.waitClosed());
  EXPECT_EQ(atServer.closed->kind, ErrorKind::kDisconnected);
}

TEST_P(TransportTest, SixtyFourMegabytePayloadArrivesIntactAndInprocSharesTheBuffer) {
  std::atomic<int> allocations{0};
  Session session;
  open(session, {}, [&](std::span<const uint8_t>, std::span<const uint64_t> sizes) -> Result<std::vector<PayloadBuffer>> {
    ++allocations;
    std::vector<PayloadBuffer> out;
    for (uint64_t s : sizes) {
      auto storage = std::make_shared<std::vector<uint8_t>>(s);
      out.push_back({storage->data(), s, std::shared_ptr<void>(storage, storage->data())});
    }
    return out;
  });
  auto& [server, client, pair, atServer, atClient] = session;
  Bytes big = patternBytes(64u << 20, 9);
  Bytes small = patternBytes(3, 1);
  OutgoingFrame frame;
  frame.envelope = envelopeWithIndex(1);
  frame.payloads = {small.buffer(), big.buffer()};
  SendTracker sends(1);
  pair.client->send(std::move(frame), sends.callback(0));
  ASSERT_TRUE(atServer.waitFrames(1));
  ASSERT_TRUE(sends.waitDone(1));
  EXPECT_EQ(sends.ok, 1u);
  std::lock_guard lock(atServer.mutex);
  expectSameBytes(atServer.frames[0].payloads[0], small, "small");
  expectSameBytes(atServer.frames[0].payloads[1], big, "64 MB");
  if (isNetwork()) {
    EXPECT_EQ(allocations.load(), 1);
  } else {
    // Zero copy: the receiver holds the sender's bytes and the allocator is not consulted.
    EXPECT_EQ(allocations.load(), 0);
    EXPECT_EQ(atServer.frames[0].payloads[1].data, big.data->data());
    EXPECT_GE(big.data.use_count(), 2);
  }
}

TEST_P(TransportTest, TenThousandFramesArriveInOrderWithOneCallbackEach) {
  Session session;
  open(session);
  auto& [server, client, pair, atServer, atClient] = session;
  constexpr size_t kFrames = 10000;
  SendTracker sends(kFrames);
  Bytes payload = patternBytes(100, 3);
  for (size_t i = 0; i < kFrames; ++i) {
    OutgoingFrame frame;
    frame.envelope = envelopeWithIndex(i);
    if (i % 3 == 0) frame.payloads.push_back(payload.buffer());
    pair.client->send(std::move(frame), sends.callback(i));
  }
  ASSERT_TRUE(atServer.waitFrames(kFrames));
  ASSERT_TRUE(sends.waitDone(kFrames));
  EXPECT_EQ(sends.ok, kFrames);
  std::lock_guard lock(atServer.mutex);
  for (size_t i = 0; i < kFrames; ++i) {
    ASSERT_EQ(indexOf(atServer.frames[i]), i);
    ASSERT_EQ(atServer.frames[i].payloads.size(), i % 3 == 0 ? 1u : 0u);
  }
  for (int c : sends.calls) ASSERT_EQ(c, 1);
}

// kThreads threads on each end send kPerThread frames each, every `largeEvery`-th with `large` as its
// payload and the others with `small`, marked fromSender where `fromSender(t, i)` says, pausing 200 us
// after every `pauseEvery`-th (0: never; lets the queues drain so senders find the connection idle). Each
// thread's frames must arrive in order and intact at the other end, and every send complete once.
struct Exchange {
  size_t threads = 3, perThread = 300, largeEvery = 10, pauseEvery = 0;
  std::function<bool(size_t t, size_t i)> fromSender = [](size_t, size_t) { return false; };
};

void exchangeFromThreads(Connection& client, Connection& server, Collector& atServer, Collector& atClient,
                         const Exchange& x, const Bytes& large, const Bytes& small) {
  SendTracker sends(2 * x.threads * x.perThread);
  std::vector<std::thread> threads;
  for (int side = 0; side < 2; ++side) {
    for (size_t t = 0; t < x.threads; ++t) {
      threads.emplace_back([&, side, t] {
        Connection& connection = side == 0 ? client : server;
        for (size_t i = 0; i < x.perThread; ++i) {
          OutgoingFrame frame;
          frame.envelope = envelopeWithIndex(t * 1000000 + i);
          frame.payloads.push_back(i % x.largeEvery == 0 ? large.buffer() : small.buffer());
          frame.fromSender = x.fromSender(t, i);
          size_t id = (side * x.threads + t) * x.perThread + i;
          connection.send(std::move(frame), sends.callback(id));
          if (x.pauseEvery != 0 && i % x.pauseEvery == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(atServer.waitFrames(x.threads * x.perThread));
  ASSERT_TRUE(atClient.waitFrames(x.threads * x.perThread));
  ASSERT_TRUE(sends.waitDone(2 * x.threads * x.perThread));
  EXPECT_EQ(sends.failed, 0u);
  for (int c : sends.calls) ASSERT_EQ(c, 1);
  for (Collector* side : {&atServer, &atClient}) {
    std::lock_guard lock(side->mutex);
    std::vector<size_t> next(x.threads, 0);
    for (const auto& f : side->frames) {
      uint64_t index = indexOf(f);
      size_t t = index / 1000000, i = index % 1000000;
      ASSERT_LT(t, x.threads);
      ASSERT_EQ(i, next[t]) << "frames from one thread must arrive in the order they were sent";
      ++next[t];
      expectSameBytes(f.payloads.at(0), i % x.largeEvery == 0 ? large : small, "payload");
    }
  }
}

TEST_P(TransportTest, ManyFramesInFlightBothWaysFromSeveralThreadsLargeInterleavedWithSmall) {
  Session session;
  open(session);
  exchangeFromThreads(*session.pair.client, *session.pair.server, session.atServer, session.atClient, Exchange{},
                      patternBytes((1 << 20) + 5, 11), patternBytes(17, 12));
}

// Frames marked fromSender (written by the sending thread when nothing is queued: tcp's Note [Sender
// writes]) mixed with unmarked ones from several threads both ways: each thread's frames still arrive in
// order and intact, each completes once.
TEST_P(TransportTest, FramesWrittenBySendersKeepEachThreadsOrderAmongQueuedFrames) {
  Session session;
  open(session);
  Exchange x;
  x.perThread = 400;
  x.largeEvery = 40;
  x.pauseEvery = 4;  // often idle: many frames are written by their senders
  x.fromSender = [](size_t t, size_t i) { return (i + t) % 3 != 0; };
  exchangeFromThreads(*session.pair.client, *session.pair.server, session.atServer, session.atClient, x,
                      patternBytes((2 << 20) + 3, 21), patternBytes(33, 22));
}

TEST_P(TransportTest, PeerCloseReportsDisconnectedOnceAndLaterSendsFail) {
  Session session;
  open(session);
  auto& [server, client, pair, atServer, atClient] = session;
  SendTracker before(5);
  for (size_t i = 0; i < 5; ++i) {
    OutgoingFrame frame;
    frame.envelope = envelopeWithIndex(i);
    pair.client->send(std::move(frame), before.callback(i));
  }
  pair.client->close();
  pair.client->close();  // idempotent
  ASSERT_TRUE(atServer.waitClosed());
  ASSERT_TRUE(atClient.waitClosed());
  ASSERT_TRUE(before.waitDone(5));
  {
    // Frames sent before close() are delivered before onClosed.
    std::lock_guard lock(atServer.mutex);
    EXPECT_EQ(atServer.frames.size(), before.ok);
    EXPECT_EQ(atServer.closed->kind, ErrorKind::kDisconnected);
  }
  SendTracker after(2);
  OutgoingFrame frame;
  frame.envelope = envelopeWithIndex(99);
  OutgoingFrame frame2 = frame;
  pair.server->send(std::move(frame), after.callback(0));
  pair.client->send(std::move(frame2), after.callback(1));
  ASSERT_TRUE(after.waitDone(2));
  EXPECT_EQ(after.failed, 2u);
  EXPECT_EQ(after.lastError->kind, ErrorKind::kDisconnected);
  pair.server->close();
  pair.server->close();
  server->close();
  client->close();
  EXPECT_EQ(atServer.closeCount, 1);
  EXPECT_EQ(atClient.closeCount, 1);
  for (int c : after.calls) EXPECT_EQ(c, 1);
}

// A frame marked fromSender that the socket takes only part of (64 MB: more than a loopback send buffer
// holds) is finished by the loop before the frames sent after it, marked or not: all arrive in order and
// intact.
TEST_P(TransportTest, ASendersPartialWriteIsFinishedBeforeTheFramesBehindIt) {
  Session session;
  open(session);
  auto& [server, client, pair, atServer, atClient] = session;
  constexpr size_t kFrames = 12;
  Bytes big = patternBytes(64 << 20, 31);
  Bytes small = patternBytes(100, 32);
  SendTracker sends(kFrames);
  for (size_t i = 0; i < kFrames; ++i) {
    OutgoingFrame frame;
    frame.envelope = envelopeWithIndex(i);
    frame.payloads.push_back(i % 4 == 0 ? big.buffer() : small.buffer());
    frame.fromSender = i % 2 == 0;
    pair.client->send(std::move(frame), sends.callback(i));
  }
  ASSERT_TRUE(atServer.waitFrames(kFrames));
  ASSERT_TRUE(sends.waitDone(kFrames));
  EXPECT_EQ(sends.failed, 0u);
  for (int c : sends.calls) ASSERT_EQ(c, 1);
  std::lock_guard lock(atServer.mutex);
  for (size_t i = 0; i < kFrames; ++i) {
    ASSERT_EQ(indexOf(atServer.frames[i]), i);
    expectSameBytes(atServer.frames[i].payloads.at(0), i % 4 == 0 ? big : small, "payload");
  }
}

// Frames queued for a peer that does not read fail once each when the connection closes, also when they
// are marked fromSender: the first one's write is then partial (tcp's Note [Sender writes]) and its rest
// waits for the loop behind nothing, the others queue behind it.
TEST_P(TransportTest, PendingSendsFailWhenTheConnectionCloses) {
  for (bool fromSender : {false, true}) {
    SCOPED_TRACE(fromSender ? "frames marked fromSender" : "queued frames");
    auto server = makeContext();
    auto client = makeContext();
    auto pair = connectPair(*server, *client);
    Collector atClient;
    atClient.start(pair.client);  // the server end is never started: nothing is read there
    constexpr size_t kFrames = 64;
    Bytes big = patternBytes(4 << 20, 5);  // 256 MB in total: more than the socket buffers hold
    SendTracker sends(kFrames);
    for (size_t i = 0; i < kFrames; ++i) {
      OutgoingFrame frame;
      frame.envelope = envelopeWithIndex(i);
      frame.payloads.push_back(big.buffer());
      frame.fromSender = fromSender;
      pair.client->send(std::move(frame), sends.callback(i));
    }
    pair.client->close();
    ASSERT_TRUE(sends.waitDone(kFrames));
    ASSERT_TRUE(atClient.waitClosed());
    for (int c : sends.calls) EXPECT_EQ(c, 1);
    if (isNetwork()) {
      EXPECT_GT(sends.failed, 0u) << "a closed connection cannot have written 256 MB to an idle peer";
    }
    EXPECT_EQ(sends.failed == 0 ? ErrorKind::kDisconnected : sends.lastError->kind, ErrorKind::kDisconnected);
  }
}

TEST_P(TransportTest, ConnectToAnUnusedAddressIsAnError) {
  auto context = makeContext();
  std::string address;
  {
    auto listener = context->listen(listenAddress(), [](std::shared_ptr<Connection>) {});
    ASSERT_TRUE(listener.ok());
    address = listener.value()->address();
    listener.value()->close();
  }
  std::promise<Result<std::shared_ptr<Connection>>> connected;
  auto future = connected.get_future();
  context->connect(address, [&](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
  ASSERT_EQ(future.wait_for(kWait), std::future_status::ready);
  auto result = future.get();
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.error().kind, ErrorKind::kDisconnected);
  EXPECT_NE(result.error().message.find(address), std::string::npos) << result.error().message;
}

TEST_P(TransportTest, ListeningTwiceOnOneAddressIsAnError) {
  auto context = makeContext();
  auto first = context->listen(listenAddress(), [](std::shared_ptr<Connection>) {});
  ASSERT_TRUE(first.ok());
  auto second = context->listen(first.value()->address(), [](std::shared_ptr<Connection>) {});
  ASSERT_FALSE(second.ok());
  EXPECT_FALSE(second.error().message.empty());
}

TEST_P(TransportTest, EnvelopeOverTheReceiversLimitClosesTheConnectionWithAnError) {
  ContextOptions tight;
  tight.limits.maxEnvelopeBytes = 1024;
  Session session;
  open(session, tight);
  auto& [server, client, pair, atServer, atClient] = session;
  SendTracker sends(2);
  OutgoingFrame ok;
  ok.envelope = envelopeWithIndex(0, 1024);
  pair.client->send(std::move(ok), sends.callback(0));
  OutgoingFrame tooBig;
  tooBig.envelope = envelopeWithIndex(1, 1025);
  pair.client->send(std::move(tooBig), sends.callback(1));
  ASSERT_TRUE(atServer.waitClosed());
  EXPECT_EQ(atServer.closed->kind, ErrorKind::kFailed);
  EXPECT_NE(atServer.closed->message.find("envelope of 1025 bytes"), std::string::npos) << atServer.closed->message;
  EXPECT_EQ(atServer.frames.size(), 1u);
  ASSERT_TRUE(atClient.waitClosed());
  ASSERT_TRUE(sends.waitDone(2));
}

TEST_P(TransportTest, PayloadBytesOverTheReceiversLimitCloseTheConnectionWithAnError) {
  ContextOptions tight;
  tight.limits.maxPayloadBytes = 4096;
  Session session;
  open(session, tight);
  auto& [server, client, pair, atServer, atClient] = session;
  Bytes a = patternBytes(3000, 1), b = patternBytes(1200, 2);
  OutgoingFrame frame;
  frame.envelope = envelopeWithIndex(0);
  frame.payloads = {a.buffer(), b.buffer()};
  SendTracker sends(1);
  pair.client->send(std::move(frame), sends.callback(0));
  ASSERT_TRUE(atServer.waitClosed());
  EXPECT_EQ(atServer.closed->kind, ErrorKind::kFailed);
  EXPECT_NE(atServer.closed->message.find("4200 payload bytes"), std::string::npos) << atServer.closed->message;
  EXPECT_TRUE(atServer.frames.empty());
  ASSERT_TRUE(atClient.waitClosed());
  ASSERT_TRUE(sends.waitDone(1));
}

TEST_P(TransportTest, AllocatorErrorClosesTheConnection) {
  std::atomic<int> calls{0};
  Session session;
  open(session, {}, [&](std::span<const uint8_t> envelope, std::span<const uint64_t> sizes)
                        -> Result<std::vector<PayloadBuffer>> {
    ++calls;
    EXPECT_EQ(sizes.size(), 1u);
    EXPECT_EQ(envelope.size(), 16u);
    return Error::failed("tensor descriptor does not match payload 0");
  });
  auto& [server, client, pair, atServer, atClient] = session;
  Bytes payload = patternBytes(100, 1);
  OutgoingFrame frame;
  frame.envelope = envelopeWithIndex(0);
  frame.payloads = {payload.buffer()};
  SendTracker sends(1);
  pair.client->send(std::move(frame), sends.callback(0));
  if (!isNetwork()) {
    // inproc hands over the sender's buffers: there is nothing to allocate, so the allocator is not called
    // (see inproc/context.h) and the frame arrives.
    ASSERT_TRUE(atServer.waitFrames(1));
    EXPECT_EQ(calls.load(), 0);
    EXPECT_EQ(atServer.frames[0].payloads[0].data, payload.data->data());
    return;
  }
  ASSERT_TRUE(atServer.waitClosed());
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(atServer.closed->message, "tensor descriptor does not match payload 0");
  EXPECT_TRUE(atServer.frames.empty());
  ASSERT_TRUE(atClient.waitClosed());
  EXPECT_EQ(atClient.closed->kind, ErrorKind::kDisconnected);
}

TEST_P(TransportTest, ContextCloseWithLiveConnectionsReturnsAndReportsClosed) {
  Session session;
  open(session);
  auto& [server, client, pair, atServer, atClient] = session;
  Bytes big = patternBytes(8 << 20, 4);
  SendTracker sends(20);
  for (size_t i = 0; i < 20; ++i) {
    OutgoingFrame frame;
    frame.envelope = envelopeWithIndex(i);
    frame.payloads = {big.buffer()};
    pair.client->send(std::move(frame), sends.callback(i));
  }
  client->close();
  client->close();  // idempotent
  ASSERT_TRUE(atClient.waitClosed());
  ASSERT_TRUE(sends.waitDone(20));
  ASSERT_TRUE(atServer.waitClosed());
  server.reset();  // the destructor closes too
  client.reset();
  for (int c : sends.calls) EXPECT_EQ(c, 1);
  // The connection handles outlive their contexts safely.
  SendTracker late(1);
  pair.client->send(OutgoingFrame{}, late.callback(0));
  ASSERT_TRUE(late.waitDone(1));
  EXPECT_EQ(late.failed, 1u);
  pair.client->close();
}

TEST_P(TransportTest, DeferRunsOnTheLoopThreadLater) {
  auto context = makeContext();
  std::promise<bool> ran;
  context->defer([&] { ran.set_value(context->inLoop()); });
  auto future = ran.get_future();
  ASSERT_EQ(future.wait_for(kWait), std::future_status::ready);
  EXPECT_TRUE(future.get());
  EXPECT_FALSE(context->inLoop());
}

INSTANTIATE_TEST_SUITE_P(Transports, TransportTest, ::testing::Values("inproc", "tcp", "ucx"),
                         [](const auto& info) { return info.param; });

TEST(CreateContext, UnknownTransportNamesTheKnownOnes) {
  auto created = createContext("carrier-pigeon");
  ASSERT_FALSE(created.ok());
  EXPECT_NE(created.error().message.find("inproc, tcp"), std::string::npos);
  EXPECT_NE(created.error().message.find("carrier-pigeon"), std::string::npos);
}

TEST(CreateContext, InprocContextsFromCreateContextHavePrivateHubs) {
  auto a = createContext("inproc").value();
  auto b = createContext("inproc").value();
  auto listener = a->listen("only-in-a", [](std::shared_ptr<Connection>) {});
  ASSERT_TRUE(listener.ok());
  std::promise<Result<std::shared_ptr<Connection>>> fromB, fromA;
  b->connect("only-in-a", [&](Result<std::shared_ptr<Connection>> r) { fromB.set_value(std::move(r)); });
  a->connect("only-in-a", [&](Result<std::shared_ptr<Connection>> r) { fromA.set_value(std::move(r)); });
  auto rb = fromB.get_future().get();
  EXPECT_FALSE(rb.ok());
  auto ra = fromA.get_future().get();
  EXPECT_TRUE(ra.ok());
  if (ra.ok()) ra.value()->close();
}

}  // namespace
}  // namespace distgrad::rpc::transport
