// Agent tests at the limits: ten thousand calls in flight at once, nothing left pending after a graceful
// shutdown, and a handshake refused for a protocol-version mismatch. Over inproc and tcp (127.0.0.1, port 0).
#include <gtest/gtest.h>

#include <cstdint>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "agent_test_util.h"
#include "rpc/agent.h"
#include "tests/transport_params.h"

namespace distgrad::rpc {
namespace {

using namespace testing;  // the shared agent test setup (agent_test_util.h)

class AgentLimitsTest : public AgentFixture {
 protected:
  // Shuts every agent down gracefully at once (the shutdown barrier needs them all), then checks that no
  // agent has a call awaiting a response or a handler running, by its totals and by every peer's metrics.
  void shutdownAllAndExpectNothingPending() {
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(cluster_.agents.size());
    for (size_t i = 0; i < cluster_.agents.size(); ++i) {
      threads.emplace_back([&, i] {
        try {
          cluster_.agents[i]->shutdown();
        } catch (...) {
          errors[i] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (size_t i = 0; i < errors.size(); ++i) {
      if (!errors[i]) continue;
      try {
        std::rethrow_exception(errors[i]);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << i << ": graceful shutdown failed: " << e.what();
      }
    }
    for (auto& agent : cluster_.agents) {
      EXPECT_EQ(agent->pendingCalls(), 0u) << agent->name();
      EXPECT_EQ(agent->runningHandlers(), 0u) << agent->name();
      uint64_t pending = 0;
      for (const std::string& peer : agent->workerNames()) {
        if (peer != agent->name()) pending += agent->metrics(peer).pending;
      }
      EXPECT_EQ(pending, 0u) << agent->name();
    }
  }
};

TEST_P(AgentLimitsTest, TenThousandConcurrentCallsAllCompleteWithTheRightValues) {
  start();
  constexpr int64_t kCalls = 10'000;
  std::vector<Future<int64_t>> futures;
  futures.reserve(kCalls);
  // Every call is issued before any result is read: up to kCalls in flight at once.
  for (int64_t i = 0; i < kCalls; ++i) futures.push_back(agent(0).rpcAsync("worker1", kAddInt, i, 3 * i + 1));
  for (int64_t i = 0; i < kCalls; ++i) ASSERT_EQ(futures[i].get(), 4 * i + 1) << "call " << i;

  PeerMetrics sent = agent(0).metrics("worker1");
  EXPECT_EQ(sent.callsSent, static_cast<uint64_t>(kCalls));
  EXPECT_EQ(sent.errors, 0u);
  EXPECT_EQ(sent.pending, 0u);
  EXPECT_EQ(agent(1).metrics("worker0").callsReceived, static_cast<uint64_t>(kCalls));
  EXPECT_EQ(agent(1).metrics("worker0").pending, 0u);
  EXPECT_EQ(agent(0).pendingCalls(), 0u);
  // Only ucx chooses among several ways to carry a peer's bytes, and says which (Connection::lanes()).
  if (GetParam() == std::string("ucx")) {
    EXPECT_NE(sent.lanes.find("(am"), std::string::npos) << sent.lanes;
  } else {
    EXPECT_EQ(sent.lanes, "");
  }
  shutdownAllAndExpectNothingPending();
}

TEST_P(AgentLimitsTest, TenThousandCallsBothWaysStillInFlightAreDrainedByAGracefulShutdown) {
  start();
  constexpr int64_t kCalls = 5'000;  // per direction
  std::vector<Future<int64_t>> from0;
  std::vector<Future<int64_t>> from1;
  from0.reserve(kCalls);
  from1.reserve(kCalls);
  for (int64_t i = 0; i < kCalls; ++i) {
    from0.push_back(agent(0).rpcAsync("worker1", kAddInt, i, int64_t{1}));
    from1.push_back(agent(1).rpcAsync("worker0", kAddInt, i, int64_t{2}));
  }
  // No result is read before the shutdown: whatever is still in flight must be drained, not failed.
  shutdownAllAndExpectNothingPending();
  for (int64_t i = 0; i < kCalls; ++i) {
    ASSERT_EQ(from0[i].get(), i + 1) << "call " << i << " from worker0";
    ASSERT_EQ(from1[i].get(), i + 2) << "call " << i << " from worker1";
  }
}

TEST_P(AgentLimitsTest, ProtocolVersionMismatchIsRefusedWithALoggedReason) {
  registry_ = makeRegistry(world_);
  ClusterSpec spec;
  spec.transport = GetParam();
  spec.protocolVersions = {transport::kProtocolVersion, static_cast<uint16_t>(transport::kProtocolVersion + 1)};
  spec.rendezvousTimeout = 5s;
  const std::string real = std::to_string(transport::kProtocolVersion);
  const std::string other = std::to_string(transport::kProtocolVersion + 1);
  ::testing::internal::CaptureStderr();
  startCluster(cluster_, spec, world_, registry_);
  const std::string log = ::testing::internal::GetCapturedStderr();

  // The worker speaking the real version names the other's version; start() fails on both sides.
  const std::string expected = "protocol version " + other + ", this worker speaks " + real;
  EXPECT_NE(log.find("refused the connection with"), std::string::npos) << log;
  EXPECT_NE(log.find(expected), std::string::npos) << log;
  int failures = 0;
  for (size_t rank = 0; rank < cluster_.errors.size(); ++rank) {
    if (!cluster_.errors[rank]) continue;
    ++failures;
    try {
      std::rethrow_exception(cluster_.errors[rank]);
    } catch (const RpcError& error) {
      const std::string what = error.what();
      EXPECT_NE(what.find("handshake"), std::string::npos) << what;
      EXPECT_NE(what.find("protocol version"), std::string::npos) << what;
    }
  }
  EXPECT_EQ(failures, 2);
  ASSERT_TRUE(cluster_.errors[0]);
  try {
    std::rethrow_exception(cluster_.errors[0]);
  } catch (const RpcError& error) {
    EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, AgentLimitsTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::rpc
