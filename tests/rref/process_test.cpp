// RRefs across processes (fork, tcp on 127.0.0.1): when the owner is killed (SIGKILL: its connection
// closes) or hangs (SIGSTOP: only the heartbeat timeout notices), every waiter on its RRefs fails with
// OwnerLost naming it within the bound, later calls fail fast, and the user's tables empty once the handles
// are dropped. Children get PR_SET_PDEATHSIG so a failing test leaves no process behind.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "rpc/store.h"
#include "tests/rref/rref_test_util.h"

namespace distgrad::rref::testing {
namespace {

using SteadyTime = std::chrono::steady_clock;

inline const rpc::Function<int64_t(int64_t)> kNever{"never"};  // its value never resolves

rpc::Options processOptions(int rank, int storePort) {
  return rpc::testing::processOptions(rank, 2, storePort, "rref-proc");
}

rpc::Registry processRegistry() {
  rpc::Registry reg;
  RRefContext::install(reg);
  reg.bindClass(kCounter).ctor<int64_t>();
  reg.bind(kNever, [](int64_t) -> rpc::Future<int64_t> {
    // Kept forever: the value stays unresolved until the process dies.
    static std::vector<std::shared_ptr<rpc::Promise<int64_t>>> kept;
    kept.push_back(std::make_shared<rpc::Promise<int64_t>>(*rpc::Executor::current()));
    return kept.back()->getFuture();
  });
  return reg;
}

class RRefProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    // Forked before this process starts any agent thread.
    child_ = fork();
    if (child_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      int storePort = 0;
      if (read(fds[0], &storePort, sizeof(storePort)) != sizeof(storePort)) _exit(2);
      try {
        auto agent = rpc::Agent::start(processOptions(1, storePort), processRegistry());
        while (true) pause();
      } catch (...) {
        _exit(3);
      }
    }
    ASSERT_GT(child_, 0);
    store_ = rpc::StoreServer::start("127.0.0.1:0");
    int port = store_->port();
    ASSERT_EQ(write(fds[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
    close(fds[0]);
    close(fds[1]);
    agent_ = rpc::Agent::start(processOptions(0, port), processRegistry());
    rrefs_ = RRefContext::of(*agent_);
  }
  void TearDown() override {
    if (child_ > 0) {
      kill(child_, SIGKILL);
      int status = 0;
      waitpid(child_, &status, 0);
    }
    rrefs_.reset();
    if (agent_) agent_->shutdown(false);
    agent_.reset();
    store_.reset();
  }

  // The owner dies (by `signal`) with a fetch waiting on an unresolved value and a method call queued:
  // both fail with OwnerLost naming it within `bound`, and so does a later call.
  void ownerDiesUnder(int signal, std::chrono::milliseconds bound) {
    RRef<Counter> c = rrefs_->remote<Counter>("worker1", int64_t{3});
    EXPECT_EQ(c.rpcSync(&Counter::get), 3);
    RRef<int64_t> never = rrefs_->remote("worker1", kNever, int64_t{1});
    rpc::Future<int64_t> fetch = never.toHereAsync();
    ASSERT_EQ(kill(child_, signal), 0);
    const auto begin = SteadyTime::now();
    rpc::Result<int64_t> r = fetch.result();
    const auto elapsed = SteadyTime::now() - begin;
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(isOwnerLost(r.error())) << r.error().describe();
    EXPECT_EQ(r.error().worker, "worker1");
    EXPECT_LT(elapsed, bound);
    rpc::Error later = rpc::testing::errorOf([&] { (void)c.rpcSync(&Counter::add, int64_t{1}); });
    EXPECT_TRUE(isOwnerLost(later)) << later.describe();
    EXPECT_EQ(later.worker, "worker1");
    c = {};
    never = {};
    EXPECT_TRUE(eventually([&] { return rrefs_->userCount() == 0 && rrefs_->pendingControlCount() == 0; }));
  }

  pid_t child_ = -1;
  std::unique_ptr<rpc::StoreServer> store_;
  std::unique_ptr<rpc::Agent> agent_;
  std::shared_ptr<RRefContext> rrefs_;
};

TEST_F(RRefProcessTest, KilledOwnerFailsWaitersWithOwnerLost) { ownerDiesUnder(SIGKILL, 2000ms); }

TEST_F(RRefProcessTest, HungOwnerFailsWaitersAfterTheHeartbeatBound) {
  // Only the heartbeat timeout (1 s here) can notice a stopped process: one interval plus slack.
  ownerDiesUnder(SIGSTOP, 1000ms + 1500ms);
}

}  // namespace
}  // namespace distgrad::rref::testing
