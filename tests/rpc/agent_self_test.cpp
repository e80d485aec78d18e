// Calls of an agent to itself (Note [Self calls] in rpc/agent.cpp): the same semantics as calls to a peer
// (values encoded and decoded, the handler on the executor, deadlines, cancellation, errors, shutdown),
// over inproc and tcp, in a job of two workers and in a job of one.
#include <gtest/gtest.h>

#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "agent_test_util.h"
#include "async_test_util.h"
#include "autograd/ops.h"
#include "rpc/agent.h"
#include "tests/transport_params.h"

namespace distgrad::rpc {
namespace {

using namespace testing;  // the shared agent test setup (agent_test_util.h)

// Writes into its argument and reports on which thread and executor it ran.
inline const Function<Tensor(Tensor)> kScribble{"scribble"};
inline const Function<bool()> kOnExecutor{"on_executor"};

struct SelfWorld {
  std::mutex mutex;
  std::thread::id handlerThread;
};

class AgentSelfTest : public AgentFixture {
 protected:
  void startSelf(ClusterSpec spec = {}) {
    spec.transport = GetParam();
    registry_ = makeRegistry(world_);
    registry_.bind(kScribble, [](Tensor t) {
      t.data<float>()[0] = 99.0f;
      return t;
    });
    registry_.bind(kOnExecutor, [this](const CallContext& ctx) {
      {
        std::lock_guard<std::mutex> lock(self_.mutex);
        self_.handlerThread = std::this_thread::get_id();
      }
      return Executor::current() == &world_.agent(ctx.callee).executor();
    });
    startCluster(cluster_, spec, world_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) {
      ASSERT_FALSE(cluster_.errors[i]) << "rank " << i << " failed to start";
    }
  }

  SelfWorld self_;
};

TEST_P(AgentSelfTest, SyncAndAsyncCallsToSelfHaveValueSemantics) {
  startSelf();
  Agent& a = agent(0);
  EXPECT_EQ(a.rpcSync("worker0", kAddInt, 40, 2), 42);
  EXPECT_EQ(a.rpcSync("worker0", kEcho, std::string("hi")), "hi from worker0 to worker0");
  a.rpcSync("worker0", kNoop, 1);
  Future<std::vector<double>> scaled = a.rpcAsync("worker0", kScale, std::vector<double>{1.0, -2.0}, 3.0);
  EXPECT_EQ(scaled.get(), (std::vector<double>{3.0, -6.0}));

  // The handler runs on the agent's executor, never inline on the calling thread.
  EXPECT_TRUE(a.rpcSync("worker0", kOnExecutor));
  {
    std::lock_guard<std::mutex> lock(self_.mutex);
    EXPECT_NE(self_.handlerThread, std::this_thread::get_id());
  }

  // Arguments and results are copies: the handler writing into its argument leaves the caller's tensor alone.
  Tensor x = Tensor::fromVector({1, 2, 3, 4}, {2, 2});
  Tensor y = a.rpcSync("worker0", kScribble, x);
  EXPECT_FLOAT_EQ(x.data<float>()[0], 1.0f);
  EXPECT_FLOAT_EQ(y.data<float>()[0], 99.0f);
  EXPECT_FLOAT_EQ(y.data<float>()[3], 4.0f);
  EXPECT_NE(y.data<float>(), x.data<float>());
  Tensor z = a.rpcAsync("worker0", kAdd, x, x).get();
  EXPECT_FLOAT_EQ(z.data<float>()[3], 8.0f);

  // Counted under the agent's own name, apart from its peer.
  PeerMetrics self = a.metrics("worker0");
  EXPECT_EQ(self.callsSent, 7u);
  EXPECT_EQ(self.callsReceived, 7u);
  EXPECT_EQ(self.errors, 0u);
  EXPECT_EQ(self.pending, 0u);
  EXPECT_TRUE(self.connected);
  EXPECT_GT(self.bytesSent, 2u * 16u);
  EXPECT_GT(self.bytesReceived, 2u * 16u);
  EXPECT_EQ(a.metrics("worker1").callsSent, 0u);
  EXPECT_EQ(a.pendingCalls(), 0u);
  // Peers are unaffected.
  EXPECT_EQ(a.rpcSync("worker1", kAddInt, 1, 1), 2);
}

TEST_P(AgentSelfTest, NestedSelfCallsDoNotDeadlockATwoThreadPool) {
  ClusterSpec spec;
  spec.executorThreads = 2;
  startSelf(spec);
  // kNested calls its caller back: worker0 -> worker0 -> worker0, far more in flight than threads.
  std::vector<Future<int64_t>> futures;
  for (int64_t i = 0; i < 32; ++i) futures.push_back(agent(0).rpcAsync("worker0", kNested, i));
  for (int64_t i = 0; i < 32; ++i) EXPECT_EQ(futures[i].get(), (i + 1) * 10);
  // worker1 -> worker0 -> worker1 (through a peer), and worker1 -> worker1 -> worker1.
  EXPECT_EQ(agent(1).rpcSync("worker0", kNested, 4), 50);
  EXPECT_EQ(agent(1).rpcSync("worker1", kNested, 5), 60);
  EXPECT_EQ(agent(0).metrics("worker0").pending, 0u);
}

TEST_P(AgentSelfTest, ErrorsOfSelfCallsAreTheRemoteOnes) {
  startSelf();
  Error missing = errorOf([&] { agent(0).rpcSync("worker0", kMissing); });
  EXPECT_EQ(missing.kind, ErrorKind::kUnimplemented);
  EXPECT_EQ(missing.worker, "worker0");
  EXPECT_NE(missing.message.find("no function 'missing' on worker0"), std::string::npos) << missing.message;

  Error mismatch = errorOf([&] { agent(0).rpcSync("worker0", kWrongSignature, std::string("x")); });
  EXPECT_EQ(mismatch.kind, ErrorKind::kUnimplemented);
  EXPECT_NE(mismatch.message.find("caller's signature: str(str)"), std::string::npos) << mismatch.message;

  Error thrown = errorOf([&] { agent(0).rpcSync("worker0", kThrow, 7); });
  EXPECT_EQ(thrown.kind, ErrorKind::kRemote);
  EXPECT_EQ(thrown.worker, "worker0");
  EXPECT_NE(thrown.message.find("index 7 is too big"), std::string::npos) << thrown.message;
  EXPECT_EQ(agent(0).metrics("worker0").errors, 3u);
}

TEST_P(AgentSelfTest, SelfCallDeadlineTimesOutAndCancelsTheHandler) {
  startSelf();
  CallOptions options;
  options.timeout = 100ms;
  auto begin = SteadyTime::now();
  Error error = errorOf([&] { agent(0).rpcSyncWith(options, "worker0", kWaitCancel, 1); });
  EXPECT_EQ(error.kind, ErrorKind::kTimeout);
  EXPECT_EQ(error.worker, "worker0");
  EXPECT_LT(SteadyTime::now() - begin, 5s);
  ASSERT_TRUE(world_.cancelObserved.waitFor());
  {
    std::lock_guard<std::mutex> lock(world_.mutex);
    EXPECT_EQ(world_.cancelKind, ErrorKind::kTimeout);
  }
  // The handler's late reply is dropped; the handler finishes and the agent still works.
  EXPECT_TRUE(eventually([&] { return agent(0).runningHandlers() == 0; }));
  EXPECT_EQ(agent(0).pendingCalls(), 0u);
  EXPECT_EQ(agent(0).rpcSync("worker0", kAddInt, 2, 2), 4);
}

TEST_P(AgentSelfTest, ExplicitCancelOfASelfCallReachesTheHandler) {
  startSelf();
  expectExplicitCancelReachesTheHandler(agent(0), "worker0", world_);
}

TEST_P(AgentSelfTest, GracefulShutdownDrainsSelfCallsInFlight) {
  startSelf();
  std::vector<Future<int64_t>> futures;
  for (int i = 0; i < 40; ++i) {
    int from = i % 2;
    futures.push_back(agent(from).rpcAsync("worker" + std::to_string(from), kNested, int64_t{i}));
  }
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        agent(r).shutdown();
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(errors[r]) << "rank " << r << " shutdown failed";
  for (int i = 0; i < 40; ++i) EXPECT_EQ(futures[i].get(), (i + 1) * 10);
  EXPECT_EQ(agent(0).pendingCalls(), 0u);
  EXPECT_EQ(agent(0).runningHandlers(), 0u);
  Error after = errorOf([&] { agent(0).rpcSync("worker0", kAddInt, 1, 1); });
  EXPECT_EQ(after.kind, ErrorKind::kFailed);
  EXPECT_NE(after.message.find("shut down"), std::string::npos) << after.message;
  EXPECT_FALSE(agent(0).metrics("worker0").connected);
}

TEST_P(AgentSelfTest, ImmediateShutdownFailsHangingSelfCalls) {
  startSelf();
  Future<int64_t> hanging = agent(0).rpcAsync("worker0", kHang, 1);
  ASSERT_TRUE(world_.hangStarted.waitFor());
  EXPECT_EQ(agent(0).pendingCalls(), 1u);
  EXPECT_EQ(agent(0).runningHandlers(), 1u);
  agent(0).shutdown(false);
  Result<int64_t> r = hanging.result();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, ErrorKind::kFailed);
  EXPECT_NE(r.error().message.find("worker0 shut down"), std::string::npos) << r.error().message;
  EXPECT_EQ(agent(0).pendingCalls(), 0u);
}

TEST_P(AgentSelfTest, AJobOfOneWorkerCallsItself) {
  ClusterSpec spec;
  spec.size = 1;
  startSelf(spec);
  EXPECT_EQ(agent(0).workerNames(), (std::vector<std::string>{"worker0"}));
  EXPECT_EQ(agent(0).rpcSync("worker0", kNested, 1), 20);
  Error unknown = errorOf([&] { agent(0).rpcSync("worker1", kAddInt, 1, 1); });
  EXPECT_EQ(unknown.kind, ErrorKind::kFailed);
  EXPECT_NE(unknown.message.find("unknown worker 'worker1'"), std::string::npos) << unknown.message;
  agent(0).shutdown();
}

INSTANTIATE_TEST_SUITE_P(Transports, AgentSelfTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace distgrad::rpc
