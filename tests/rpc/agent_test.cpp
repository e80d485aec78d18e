// Agent tests: several agents in one process over inproc and tcp (127.0.0.1, port-0 store).
#include "rpc/agent.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "agent_test_util.h"
#include "async_test_util.h"
#include "autograd/ops.h"
#include "rpc/store.h"
#include "rpc/transport/inproc/context.h"
#include "tests/transport_params.h"

namespace distgrad::rpc {
namespace {

using namespace testing;  // the shared agent test setup (agent_test_util.h)

class AgentTest : public AgentFixture {
 protected:
  // Three workers with one executor thread each, whose workers read for a call or an answer for up to 30 s
  // (Note [Serving reader], Note [Reading for the answer]).
  void startThreeReadingFor30s() {
    ClusterSpec spec;
    spec.size = 3;
    spec.executorThreads = 1;
    start(spec);
    for (int rank = 0; rank < 3; ++rank) agent(rank).setServeReadWindow(std::chrono::seconds(30));
  }
};

TEST_P(AgentTest, ValuesRoundTrip) {
  start();
  Agent& a = agent(0);
  EXPECT_EQ(a.name(), "worker0");
  EXPECT_EQ(a.workerNames(), (std::vector<std::string>{"worker0", "worker1"}));
  EXPECT_EQ(a.rpcSync("worker1", kAddInt, 40, 2), 42);
  EXPECT_EQ(a.rpcSync("worker1", kEcho, std::string("hi")), "hi from worker1 to worker0");
  EXPECT_EQ(agent(1).rpcSync("worker0", kEcho, std::string("yo")), "yo from worker0 to worker1");
  EXPECT_EQ(a.rpcSync("worker1", kScale, std::vector<double>{1.0, -2.5, 4.0}, 2.0),
            (std::vector<double>{2.0, -5.0, 8.0}));
  a.rpcSync("worker1", kNoop, 7);

  Tensor x = Tensor::fromVector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor y = Tensor::fromVector({10, 20, 30, 40, 50, 60}, {2, 3});
  Tensor z = a.rpcSync("worker1", kAdd, x, y);
  ASSERT_EQ(z.shape(), (Shape{2, 3}));
  for (int i = 0; i < 6; ++i) EXPECT_FLOAT_EQ(z.data<float>()[i], 11.0f * (i + 1));

  Future<Tensor> f = a.rpcAsync("worker1", kAdd, x, x);
  Tensor w = f.get();
  EXPECT_FLOAT_EQ(w.data<float>()[5], 12.0f);

  // 16 MB tensor there and back.
  const int64_t n = 4 << 20;
  Tensor big = Tensor::arange(n, DType::kFloat32);
  Tensor back = a.rpcSync("worker1", kIdentity, big);
  ASSERT_EQ(back.numel(), n);
  EXPECT_EQ(std::memcmp(back.data<float>(), big.data<float>(), n * sizeof(float)), 0);

  PeerMetrics m = a.metrics("worker1");
  EXPECT_EQ(m.callsSent, 7u);  // add_int, echo, scale, noop, add, add (async), identity
  EXPECT_EQ(m.errors, 0u);
  EXPECT_EQ(m.pending, 0u);
  EXPECT_TRUE(m.connected);
  EXPECT_GT(m.bytesSent, static_cast<uint64_t>(n) * 4);
  EXPECT_GT(m.bytesReceived, static_cast<uint64_t>(n) * 4);
  EXPECT_EQ(agent(1).metrics("worker0").callsReceived, 7u);
}

// Note [Inline handlers]: a function bound with Dispatch::kInline runs where its call is decoded (the
// transport's loop thread; a self call, which is not decoded there, runs on the executor), may return a
// Future, and a blocking wait inside it is a clear error for the caller instead of a stalled loop.
TEST_P(AgentTest, InlineHandlersRunOnTheLoopAndMustNotBlockIt) {
  start();
  Agent& a = agent(0);
  EXPECT_FALSE(a.rpcSync("worker1", kInlineOnExecutor, 1));
  EXPECT_TRUE(a.rpcSync("worker0", kInlineOnExecutor, 1));
  EXPECT_EQ(a.rpcSync("worker1", kInlineNested, 4), 50);
  Result<int64_t> blocked = a.rpcAsync("worker1", kInlineBlocking, 5).result();
  ASSERT_FALSE(blocked.ok());
  EXPECT_EQ(blocked.error().kind, ErrorKind::kFailed);
  EXPECT_NE(blocked.error().message.find("blocking wait for a future inside an inline handler"), std::string::npos)
      << blocked.error().message;
  EXPECT_EQ(blocked.error().worker, "worker1");
  EXPECT_EQ(a.rpcSync("worker0", kInlineBlocking, 5), 6);  // on the executor, it may block
  EXPECT_EQ(a.rpcSync("worker1", kAddInt, 40, 2), 42);     // the loop still serves
  EXPECT_EQ(agent(1).rpcSync("worker0", kInlineNested, 1), 20);
}

TEST_P(AgentTest, NestedCallsWithTwoThreadsDoNotDeadlock) {
  ClusterSpec spec;
  spec.executorThreads = 2;
  start(spec);
  // Each call A->B makes B call A back; far more in flight than threads in either pool.
  std::vector<Future<int64_t>> futures;
  for (int64_t i = 0; i < 32; ++i) futures.push_back(agent(0).rpcAsync("worker1", kNested, i));
  for (int64_t i = 0; i < 32; ++i) EXPECT_EQ(futures[i].get(), (i + 1) * 10);
  EXPECT_EQ(agent(1).rpcSync("worker0", kNested, 4), 50);
}

TEST_P(AgentTest, ThousandsOfConcurrentCalls) {
  ClusterSpec spec;
  spec.size = 3;
  start(spec);
  constexpr int kCalls = 1500;
  std::vector<Future<int64_t>> futures;
  futures.reserve(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    futures.push_back(agent(0).rpcAsync(i % 2 ? "worker1" : "worker2", kAddInt, int64_t{i}, int64_t{i}));
  }
  for (int i = 0; i < kCalls; ++i) ASSERT_EQ(futures[i].get(), 2 * i);
  EXPECT_EQ(agent(0).pendingCalls(), 0u);
}

// Note [Waiting reader] (tcp): a thread blocked in rpcSync reads its connection itself, and so hands on
// whatever else arrives there: other threads' replies, calls coming the other way, replies to asynchronous
// calls. Every call gets its own answer, whoever reads it; a handler slower than the window is awaited as
// usual; with the window at 0 the loop reads as before.
TEST_P(AgentTest, SyncCallersReadingTheirRepliesServeAllOtherTrafficToo) {
  const Function<int64_t(int64_t)> slow{"slow"};
  ClusterSpec spec;
  spec.executorThreads = 4;
  start(spec, [&](Registry& reg) {
    reg.bind(slow, [](int64_t ms) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      return ms;
    });
  });
  constexpr int kThreads = 4;
  constexpr int kCallsPerThread = 300;
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Half the threads call from worker1 to worker0, so calls also arrive where replies are awaited.
      Agent& from = agent(t % 2);
      const std::string to = t % 2 ? "worker0" : "worker1";
      for (int64_t i = 0; i < kCallsPerThread; ++i) {
        if (from.rpcSync(to, kAddInt, i, int64_t{t}) != i + t) wrong.fetch_add(1);
      }
    });
  }
  std::vector<Future<int64_t>> futures;
  for (int64_t i = 0; i < 1000; ++i) futures.push_back(agent(0).rpcAsync("worker1", kAddInt, i, i));
  for (auto& thread : threads) thread.join();
  for (int64_t i = 0; i < 1000; ++i) EXPECT_EQ(futures[i].get(), 2 * i);
  EXPECT_EQ(wrong.load(), 0);
  agent(0).setSyncReadWindow(std::chrono::milliseconds(1));
  EXPECT_EQ(agent(0).rpcSync("worker1", slow, 30), 30);  // answered after the window: the loop reads it
  agent(0).setSyncReadWindow(std::chrono::microseconds(0));
  EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, 40, 2), 42);
  EXPECT_EQ(agent(0).pendingCalls(), 0u);
  EXPECT_EQ(agent(1).pendingCalls(), 0u);
}

// Note [Serving reader] (tcp): the worker that answered the only call being served reads that connection for
// the next call. With the window at 30 s, everything else must still end its wait at once: a call from
// another worker (the callee's only worker waits outside the queue, so the loop's hand-off interrupts it),
// a handler calling back its caller (the worker lets go of the connection before it runs a call), replies
// of the callee's own calls, and shutdown.
TEST_P(AgentTest, AWorkerReadingForTheNextCallLetsEveryOtherWorkThrough) {
  startThreeReadingFor30s();
  const auto begin = SteadyTime::now();
  for (int64_t i = 0; i < 50; ++i) {
    EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, i, int64_t{1}), i + 1);
    // worker1's worker now reads worker0's connection: worker2's call comes through worker1's loop.
    EXPECT_EQ(agent(2).rpcSync("worker1", kAddInt, i, int64_t{2}), i + 2);
    EXPECT_EQ(agent(0).rpcSync("worker1", kNested, i), (i + 1) * 10);  // worker1 calls worker0 back
    EXPECT_EQ(agent(1).rpcAsync("worker2", kAddInt, i, int64_t{3}).get(), i + 3);
  }
  EXPECT_LT(SteadyTime::now() - begin, 20s) << "a call waited for a serving reader's window";
  const auto shutdownBegin = SteadyTime::now();
  for (int rank = 0; rank < 3; ++rank) agent(rank).shutdown(false);
  EXPECT_LT(SteadyTime::now() - shutdownBegin, 10s) << "shutdown waited for a serving reader's window";
}

// Note [Reading for the answer]: worker1's only worker, whose handler awaits the answer of a call it sent
// to worker0 (one that hangs), reads that connection meanwhile (tcp; a 30 s window): calls arriving there
// and on other connections, and a reply to worker1's own caller on that connection, all go through; the
// answer, once given, completes the forwarded call.
TEST_P(AgentTest, AWorkerReadingForItsHandlersAnswerLetsEveryOtherWorkThrough) {
  startThreeReadingFor30s();
  Future<int64_t> forwarded = agent(0).rpcAsync("worker1", kForwardHang, 5);
  ASSERT_TRUE(world_.hangStarted.waitFor());
  const auto begin = SteadyTime::now();
  for (int64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, i, int64_t{1}), i + 1);
    EXPECT_EQ(agent(2).rpcSync("worker1", kAddInt, i, int64_t{2}), i + 2);
    EXPECT_EQ(agent(1).rpcSync("worker0", kAddInt, i, int64_t{3}), i + 3);
    EXPECT_EQ(agent(1).rpcAsync("worker2", kAddInt, i, int64_t{4}).get(), i + 4);
  }
  EXPECT_LT(SteadyTime::now() - begin, 10s) << "a call waited for a worker reading for its handler's answer";
  EXPECT_FALSE(forwarded.isReady()) << "answered before the hanging call was";
  world_.completeHanging(0, 7);
  EXPECT_EQ(forwarded.get(), 7);
}

// Note [Lone calls]: rpcAsync calls made one at a time are written by the calling thread (tcp; ucx while its
// loop thread sleeps), like an rpcSync's, instead of by the loop thread, whose wake-up would cost a context
// switch; the calls of a burst are left to the loop, which writes them together.
TEST_P(AgentTest, CallsMadeOneAtATimeAreWrittenByTheirSenderAndBurstsByTheLoop) {
  start();
  auto written = [&] { return agent(0).metrics("worker1").framesWrittenBySender; };
  for (int64_t i = 0; i < 10; ++i) EXPECT_EQ(agent(0).rpcAsync("worker1", kAddInt, i, int64_t{1}).get(), i + 1);
  const uint64_t before = written();
  constexpr int64_t kCalls = 200;
  for (int64_t i = 0; i < kCalls; ++i) EXPECT_EQ(agent(0).rpcAsync("worker1", kAddInt, i, int64_t{1}).get(), i + 1);
  const uint64_t lone = written() - before;
  if (GetParam() == "inproc") {
    EXPECT_EQ(written(), 0u) << "inproc has no sending thread's write";
    return;
  }
  if (GetParam() == "ucx") {
    // Note [Driving threads]: ucx issues a frame from its sender only while the loop thread sleeps, and
    // after the loop thread completed the previous call it is often still awake (arming the worker) when
    // the next call is sent: how many go that way is timing (UcxWorker tests check that they do).
    (void)lone;
  } else {
    // A frame is left to the loop when the connection has something queued (a heartbeat being written).
    EXPECT_GE(lone, static_cast<uint64_t>(kCalls * 9 / 10));
  }
  // A burst issued while a call is pending (a hanging one, so that no reply can empty the count between
  // two calls of the burst however the threads are scheduled): none of its calls is lone.
  Future<int64_t> hanging = agent(0).rpcAsync("worker1", kHang, 1);
  ASSERT_TRUE(world_.hangStarted.waitFor());
  const uint64_t beforeBurst = written();
  std::vector<Future<int64_t>> burst;
  for (int64_t i = 0; i < 256; ++i) burst.push_back(agent(0).rpcAsync("worker1", kAddInt, i, int64_t{2}));
  for (int64_t i = 0; i < 256; ++i) EXPECT_EQ(burst[static_cast<size_t>(i)].get(), i + 2);
  EXPECT_EQ(written(), beforeBurst) << "calls of a burst were written by their sender";
  world_.completeHanging(0, 7);
  EXPECT_EQ(hanging.get(), 7);
}

TEST_P(AgentTest, UnknownFunctionAndSignatureMismatchAreUnimplemented) {
  start();
  Error missing = errorOf([&] { agent(0).rpcSync("worker1", kMissing); });
  EXPECT_EQ(missing.kind, ErrorKind::kUnimplemented);
  EXPECT_NE(missing.message.find("no function 'missing' on worker1"), std::string::npos) << missing.message;
  EXPECT_EQ(missing.worker, "worker1");

  Error mismatch = errorOf([&] { agent(0).rpcSync("worker1", kWrongSignature, std::string("x")); });
  EXPECT_EQ(mismatch.kind, ErrorKind::kUnimplemented);
  EXPECT_NE(mismatch.message.find("i64(i64,i64)"), std::string::npos) << mismatch.message;
  EXPECT_NE(mismatch.message.find("str(str)"), std::string::npos) << mismatch.message;

  Error unknown = errorOf([&] { agent(0).rpcSync("nobody", kAddInt, 1, 2); });
  EXPECT_EQ(unknown.kind, ErrorKind::kFailed);
  EXPECT_NE(unknown.message.find("unknown worker 'nobody'"), std::string::npos) << unknown.message;
  // The connection is still fine afterwards.
  EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, 1, 2), 3);
}

TEST_P(AgentTest, HandlerExceptionIsRemoteError) {
  start();
  Error error = errorOf([&] { agent(0).rpcSync("worker1", kThrow, 99); });
  EXPECT_EQ(error.kind, ErrorKind::kRemote);
  EXPECT_EQ(error.worker, "worker1");
  EXPECT_NE(error.remoteType.find("out_of_range"), std::string::npos) << error.remoteType;
  EXPECT_NE(error.message.find("index 99 is too big"), std::string::npos) << error.message;
  EXPECT_EQ(agent(0).metrics("worker1").errors, 1u);
}

TEST_P(AgentTest, DeadlineTimesOutAndCancelsTheCallee) {
  start();
  CallOptions options;
  options.timeout = 100ms;
  auto begin = SteadyTime::now();
  Error error = errorOf([&] { agent(0).rpcSyncWith(options, "worker1", kWaitCancel, 1); });
  EXPECT_EQ(error.kind, ErrorKind::kTimeout);
  EXPECT_EQ(error.worker, "worker1");
  EXPECT_LT(SteadyTime::now() - begin, 5s);
  ASSERT_TRUE(world_.cancelObserved.waitFor());
  {
    std::lock_guard<std::mutex> lock(world_.mutex);
    EXPECT_EQ(world_.cancelKind, ErrorKind::kTimeout);
  }
  // The agent still works, and the callee's handler finished.
  EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, 2, 2), 4);
}

TEST_P(AgentTest, ExplicitCancelReachesTheCallee) {
  start();
  expectExplicitCancelReachesTheHandler(agent(0), "worker1", world_);
}

TEST_P(AgentTest, WrongSecretIsRefused) {
  registry_ = makeRegistry(world_);
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.secrets = {"right", "wrong"};
  spec.rendezvousTimeout = 5s;
  startCluster(cluster_, spec, world_, registry_);
  int failures = 0;
  bool namedHmac = false;
  for (auto& e : cluster_.errors) {
    if (!e) continue;
    ++failures;
    try {
      std::rethrow_exception(e);
    } catch (const RpcError& error) {
      EXPECT_NE(std::string(error.what()).find("handshake"), std::string::npos) << error.what();
      namedHmac = namedHmac || std::string(error.what()).find("HMAC") != std::string::npos;
    }
  }
  EXPECT_EQ(failures, 2);
  EXPECT_TRUE(namedHmac);
}

TEST_P(AgentTest, PeerClosedMidCallFailsPendingCallsAsDisconnected) {
  ClusterSpec spec;
  spec.heartbeatInterval = 50ms;
  spec.heartbeatTimeout = 500ms;
  start(spec);
  Future<int64_t> f = agent(0).rpcAsync("worker1", kHang, 1);
  ASSERT_TRUE(world_.hangStarted.waitFor());
  auto begin = SteadyTime::now();
  agent(1).shutdown(false);
  Result<int64_t> r = f.result();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, ErrorKind::kDisconnected) << r.error().describe();
  EXPECT_EQ(r.error().worker, "worker1");
  EXPECT_LT(SteadyTime::now() - begin, spec.heartbeatTimeout + 1s);
  // Later calls fail fast.
  Error later = errorOf([&] { agent(0).rpcSync("worker1", kAddInt, 1, 1); });
  EXPECT_EQ(later.kind, ErrorKind::kDisconnected);
  EXPECT_EQ(later.worker, "worker1");
  EXPECT_FALSE(agent(0).metrics("worker1").connected);
}

TEST_P(AgentTest, GracefulShutdownDrainsInFlightCalls) {
  ClusterSpec spec;
  spec.size = 3;
  start(spec);
  std::vector<Future<int64_t>> futures;
  for (int i = 0; i < 50; ++i)
    futures.push_back(agent(i % 3).rpcAsync("worker" + std::to_string((i + 1) % 3), kNested, int64_t{i}));
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(3);
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      try {
        agent(r).shutdown();
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << r << " shutdown failed: " << e.what();
    }
  }
  for (int i = 0; i < 50; ++i) EXPECT_EQ(futures[i].get(), (i + 1) * 10);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(agent(r).pendingCalls(), 0u);
  Error after = errorOf([&] { agent(0).rpcSync("worker1", kAddInt, 1, 1); });
  EXPECT_EQ(after.kind, ErrorKind::kFailed);
}

TEST_P(AgentTest, ShutdownWithADeadPeerIsBoundedAndNamesIt) {
  ClusterSpec spec;
  spec.size = 3;
  spec.heartbeatInterval = 50ms;
  spec.heartbeatTimeout = 500ms;
  spec.shutdownTimeout = 3s;
  start(spec);
  agent(2).shutdown(false);
  auto begin = SteadyTime::now();
  std::vector<std::thread> threads;
  std::vector<std::string> messages(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        agent(r).shutdown();
      } catch (const RpcError& e) {
        messages[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LT(SteadyTime::now() - begin, spec.shutdownTimeout + 2s);
  for (int r = 0; r < 2; ++r)
    EXPECT_NE(messages[r].find("worker2"), std::string::npos) << "rank " << r << ": " << messages[r];
}

TEST_P(AgentTest, ShutdownWaitsForWorkersThatAreStillWorking) {
  // The serving pattern: worker1 is done at once and shuts down; worker0 keeps calling it for longer than
  // the shutdown bound. The first barrier waits while worker0 is alive (its heartbeats keep coming).
  ClusterSpec spec;
  spec.size = 2;
  spec.heartbeatInterval = 50ms;
  spec.heartbeatTimeout = 2s;
  spec.shutdownTimeout = 300ms;
  start(spec);
  std::string served;
  std::thread server([&] {
    try {
      agent(1).shutdown();
      served = "ok";
    } catch (const RpcError& e) {
      served = e.what();
    }
  });
  const auto busyUntil = SteadyTime::now() + 3 * spec.shutdownTimeout;
  int calls = 0;
  while (SteadyTime::now() < busyUntil) {
    EXPECT_EQ(agent(0).rpcSync("worker1", kAddInt, calls, 1), calls + 1);
    ++calls;
    std::this_thread::sleep_for(10ms);
  }
  agent(0).shutdown();
  server.join();
  EXPECT_EQ(served, "ok");
  EXPECT_GT(calls, 10);
}

// A stray process that connects to an agent's port and sends garbage (or a frame before any handshake) is
// cut off; the agent lives on and keeps serving its peers.
TEST(AgentStray, GarbageOnTheAgentsPortClosesOnlyThatConnection) {
  World world;
  Registry reg = makeRegistry(world);
  Cluster cluster;
  ClusterSpec spec;
  spec.transport = "tcp";
  startCluster(cluster, spec, world, reg);
  ASSERT_TRUE(cluster.agents[0] && cluster.agents[1]);
  auto client = StoreClient::connect(cluster.store->address(), 5s);
  std::string entry = client->getString("dg/worker/1", 5s);
  auto [host, port] = parseHostPort(entry.substr(entry.find('\n') + 1), "address");
  for (int attempt = 0; attempt < 2; ++attempt) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    timeval tv{10, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    std::vector<uint8_t> junk(64, 0xAB);
    if (attempt == 1) {
      // A well-formed frame prefix announcing a huge envelope.
      transport::FramePrefix prefix;
      prefix.envelopeBytes = 0xFFFFFFF0u;
      std::memcpy(junk.data(), &prefix, sizeof(prefix));
    }
    ASSERT_EQ(::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL), static_cast<ssize_t>(junk.size()));
    // The agent closes the connection (it sends nothing to a connection that has not said hello): read
    // until EOF.
    char buf[4096];
    ssize_t n = 0;
    while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) {
    }
    EXPECT_EQ(n, 0) << "the agent did not close the stray connection";
    ::close(fd);
  }
  EXPECT_EQ(cluster.agents[0]->rpcSync("worker1", kAddInt, 20, 22), 42);
  EXPECT_TRUE(cluster.agents[0]->metrics("worker1").connected);
}

INSTANTIATE_TEST_SUITE_P(Transports, AgentTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

TEST(AgentSingle, RankZeroHostsTheStoreOnAnyPort) {
  Options options;
  options.transport = "tcp";
  options.masterPort = 0;
  Registry reg;
  auto agent = Agent::start(options, reg);
  EXPECT_NE(agent->storeAddress().find("127.0.0.1:"), std::string::npos);
  EXPECT_EQ(agent->workerNames(), std::vector<std::string>{"worker0"});
  agent->shutdown();
}

TEST(AgentSingle, InprocWithoutAHubIsAClearError) {
  Options options;
  options.transport = "inproc";
  Registry reg;
  EXPECT_THROW(Agent::start(options, reg), ValueError);
}

}  // namespace
}  // namespace distgrad::rpc
