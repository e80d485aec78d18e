// Agent tests across processes (fork, tcp on 127.0.0.1): a peer that hangs (SIGSTOP: its sockets stay open
// but nothing arrives) is declared dead by the heartbeat timeout; a peer killed with SIGKILL mid-call fails
// the call as disconnected. Children get PR_SET_PDEATHSIG so a failing test leaves no process behind.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "tests/rpc/agent_test_util.h"

namespace distgrad::rpc {
namespace {

using namespace std::chrono_literals;
using SteadyTime = std::chrono::steady_clock;

using testing::kAddInt;
inline const Function<int64_t(int64_t)> kNever{"never"};  // answers only when cancelled

Options optionsFor(int rank, int storePort) { return testing::processOptions(rank, 2, storePort, "proc-secret"); }

// Forks a worker (rank 1) that serves until killed. Must run while this process has no other threads.
pid_t forkWorker(int readFd) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  int storePort = 0;
  if (read(readFd, &storePort, sizeof(storePort)) != sizeof(storePort)) _exit(2);
  Registry reg;
  reg.bind(kAddInt, [](int64_t a, int64_t b) { return a + b; });
  reg.bind(kNever, [](const CallContext& ctx, int64_t) -> Future<int64_t> {
    auto promise = std::make_shared<Promise<int64_t>>(*Executor::current());
    auto future = promise->getFuture();
    // Kept alive by the callback itself until the call is cancelled (never, in these tests).
    auto registration = std::make_shared<CancellationRegistration>();
    *registration = ctx.token.onCancel([promise](const Error&) { promise->trySetValue(-1); });
    static std::vector<std::shared_ptr<CancellationRegistration>> keep;
    keep.push_back(registration);
    return future;
  });
  try {
    auto agent = Agent::start(optionsFor(1, storePort), reg);
    while (true) pause();
  } catch (...) {
    _exit(3);
  }
}

class AgentProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    child_ = forkWorker(fds[0]);
    ASSERT_GT(child_, 0);
    store_ = StoreServer::start("127.0.0.1:0");
    int port = store_->port();
    ASSERT_EQ(write(fds[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
    close(fds[0]);
    close(fds[1]);
    Registry reg;
    agent_ = Agent::start(optionsFor(0, port), reg);
    ASSERT_EQ(agent_->rpcSync("worker1", kAddInt, 2, 3), 5);
  }
  void TearDown() override {
    if (child_ > 0) {
      kill(child_, SIGKILL);
      int status = 0;
      waitpid(child_, &status, 0);
    }
    if (agent_) agent_->shutdown(false);
    agent_.reset();
    store_.reset();
  }

  pid_t child_ = -1;
  std::unique_ptr<StoreServer> store_;
  std::unique_ptr<Agent> agent_;
};

TEST_F(AgentProcessTest, HungPeerIsDeclaredDeadByHeartbeats) {
  Future<int64_t> f = agent_->rpcAsync("worker1", kNever, 1);
  // Make sure the call reached the child before it freezes.
  EXPECT_EQ(agent_->rpcSync("worker1", kAddInt, 1, 1), 2);
  ASSERT_EQ(kill(child_, SIGSTOP), 0);
  auto begin = SteadyTime::now();
  Result<int64_t> r = f.result();
  auto elapsed = SteadyTime::now() - begin;
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, ErrorKind::kDisconnected) << r.error().describe();
  EXPECT_EQ(r.error().worker, "worker1");
  EXPECT_NE(r.error().message.find("heartbeat"), std::string::npos) << r.error().message;
  EXPECT_GE(elapsed, 800ms);            // not before the timeout...
  EXPECT_LT(elapsed, 1000ms + 1500ms);  // ...and soon after it (one interval plus scheduling slack)
  Error later = Error::failed("none");
  try {
    agent_->rpcSync("worker1", kAddInt, 1, 1);
  } catch (const RpcError& e) {
    later = e.error();
  }
  EXPECT_EQ(later.kind, ErrorKind::kDisconnected);
}

TEST_F(AgentProcessTest, KilledPeerFailsPendingCallsFast) {
  Future<int64_t> f = agent_->rpcAsync("worker1", kNever, 1);
  EXPECT_EQ(agent_->rpcSync("worker1", kAddInt, 1, 1), 2);
  ASSERT_EQ(kill(child_, SIGKILL), 0);
  auto begin = SteadyTime::now();
  Result<int64_t> r = f.result();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, ErrorKind::kDisconnected) << r.error().describe();
  EXPECT_EQ(r.error().worker, "worker1");
  EXPECT_LT(SteadyTime::now() - begin, 2s);  // the socket closes: no need to wait for heartbeats
  // Shutting down with the dead peer is bounded and names it.
  std::string message;
  try {
    agent_->shutdown();
  } catch (const RpcError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("worker1"), std::string::npos) << message;
}

}  // namespace
}  // namespace distgrad::rpc
