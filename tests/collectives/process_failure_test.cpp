// Collectives across processes (fork, tcp on 127.0.0.1): a member killed with SIGKILL while the others are
// inside an all-reduce with it fails their handles with `disconnected` naming it, and the group stays broken
// for later collectives; a group without it keeps working. The child gets PR_SET_PDEATHSIG so a failing
// test leaves no process behind.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "collectives_test_util.h"

namespace distgrad::rpc::collectives::testing {
namespace {

constexpr int kWorld = 3;
const char* const kSecret = "collectives-proc";

Registry processRegistry() {
  Registry reg;
  install(reg);
  return reg;
}

// Rank 2: joins the job and the world group, then serves until killed (it never calls a collective).
pid_t forkMember(int readFd) {
  pid_t pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  int storePort = 0;
  if (read(readFd, &storePort, sizeof(storePort)) != sizeof(storePort)) _exit(2);
  try {
    auto agent = Agent::start(rpc::testing::processOptions(2, kWorld, storePort, kSecret), processRegistry());
    ProcessGroup world = ProcessGroup::world(*agent);
    while (true) pause();
  } catch (...) {
    _exit(3);
  }
}

TEST(CollectivesProcess, KilledMemberFailsTheAllReduceOnEveryOtherMember) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = forkMember(fds[0]);
  ASSERT_GT(child, 0);
  ::close(fds[0]);
  auto store = StoreServer::start("127.0.0.1:0");
  const int storePort = store->port();
  ASSERT_EQ(write(fds[1], &storePort, sizeof(storePort)), static_cast<ssize_t>(sizeof(storePort)));
  ::close(fds[1]);
  std::unique_ptr<Agent> a0, a1;
  const Registry reg = processRegistry();
  rpc::testing::startProcessAgentPair(0, a0, 1, a1, kWorld, storePort, kSecret, reg);
  ASSERT_TRUE(a0 && a1);
  {
    ProcessGroup g0 = ProcessGroup::world(*a0);
    ProcessGroup g1 = ProcessGroup::world(*a1);
    // 4 MB: the ring, with segments in flight towards worker2 when it dies.
    Tensor t0 = Tensor::ones({1 << 20});
    Tensor t1 = Tensor::ones({1 << 20});
    Future<void> f0 = g0.allReduce(t0);
    Future<void> f1 = g1.allReduce(t1);
    ASSERT_EQ(kill(child, SIGKILL), 0);
    for (Future<void>* f : {&f0, &f1}) {
      Error error = failureOf(*f);
      EXPECT_EQ(error.kind, ErrorKind::kDisconnected) << error.describe();
      EXPECT_EQ(error.worker, "worker2") << error.describe();
    }
    Future<void> again = g0.broadcast(Tensor::ones({3}), 0);
    Error error = failureOf(again);
    EXPECT_EQ(error.worker, "worker2") << error.describe();
    // The survivors' own group still works.
    ProcessGroup p0(*a0, {"worker0", "worker1"});
    ProcessGroup p1(*a1, {"worker0", "worker1"});
    Tensor x0 = Tensor::full({5}, 1.0);
    Tensor x1 = Tensor::full({5}, 3.0);
    Future<void> h0 = p0.allReduce(x0, {ReduceOp::kMean});
    Future<void> h1 = p1.allReduce(x1, {ReduceOp::kMean});
    h0.get();
    h1.get();
    EXPECT_EQ(x0.toVector<float>(), std::vector<float>(5, 2.0f));
  }
  int status = 0;
  waitpid(child, &status, 0);
  a0->shutdown(false);
  a1->shutdown(false);
}

}  // namespace
}  // namespace distgrad::rpc::collectives::testing
