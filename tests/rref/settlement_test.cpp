// Note [Batched settlements] and Note [Deferred fork requests]: deletions, child accepts and fork requests
// wait in a per-worker outbox and leave together; a user->user fork released before its fork request left
// is settled by a child accept alone (the owner never hears of it); a fork kept longer is registered as
// before. Every table ends empty.
#include <gtest/gtest.h>

#include "rref_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::rref::testing {
namespace {

const rpc::Function<int64_t(RRef<int64_t>)> kIgnoreRef{"settlement.ignore_ref"};  // drops its argument

class RRefSettlement : public RRefFixture {
 protected:
  void bindExtra(rpc::Registry& registry) override {
    registry.bind(kIgnoreRef, [](RRef<int64_t>) { return int64_t{7}; });
  }
  // Worker `rank` has nothing queued or in flight.
  bool quiet(int rank) {
    return eventually([&] { return rrefs(rank)->pendingControlCount() == 0 && rrefs(rank)->userCount() == 0; });
  }
};

TEST_P(RRefSettlement, ReleasedUserForkNeverReachesTheOwner) {
  start();
  RRef<int64_t> r = rrefs(0)->remote(name(1), kAddInt, int64_t{40}, int64_t{2});
  EXPECT_EQ(r.toHere(), 42);
  // Worker 2 receives a fork from worker 0 (a user) and drops it at once, well within the settle window:
  // its fork request is withdrawn, so it sends the owner nothing; a child accept lets worker 0 go. (A
  // thread descheduled for the whole window would let the request leave: tried a few times.)
  bool withdrawn = false;
  for (int attempt = 0; attempt < 5 && !withdrawn; ++attempt) {
    ASSERT_TRUE(quiet(2)) << tables();
    const uint64_t before = agent(2).metrics(name(1)).callsSent;
    EXPECT_EQ(agent(0).rpcSync(name(2), kIgnoreRef, r), 7);
    ASSERT_TRUE(eventually([&] { return rrefs(0)->pendingChildCount() == 0; })) << tables();
    ASSERT_TRUE(quiet(2)) << tables();
    withdrawn = agent(2).metrics(name(1)).callsSent == before;
  }
  EXPECT_TRUE(withdrawn) << "the fork request was sent every time";
  // Worker 2 fetching through its fork: the fetch alone reaches the owner in the usual case.
  for (int i = 0; i < 20; ++i) EXPECT_EQ(agent(0).rpcSync(name(2), kReadRef, r), 42);
  EXPECT_TRUE(eventually([&] { return rrefs(0)->pendingChildCount() == 0; })) << tables();
  EXPECT_TRUE(quiet(2)) << tables();
  EXPECT_EQ(rrefs(1)->ownedCount(), 1u);  // only r's entry, held by worker 0
  r = {};
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RRefSettlement, LongLivedUserForkIsRegistered) {
  start();
  {
    RRef<int64_t> r = rrefs(0)->remote(name(1), kAddInt, int64_t{1}, int64_t{2});
    // pass_back keeps worker 2's fork: its fork request leaves with the next batch and confirms it; the
    // parent (worker 0) lets go of its pending child after the accept.
    RRef<int64_t> back = agent(0).rpcSync(name(2), kPassBack, r);
    std::vector<RRef<int64_t>> kept;
    {
      std::lock_guard<std::mutex> lock(world_.mutex);
      kept = world_.kept;
    }
    ASSERT_EQ(kept.size(), 1u);
    EXPECT_TRUE(eventually([&] { return kept[0].confirmedByOwner(); }));
    EXPECT_TRUE(eventually([&] { return rrefs(0)->pendingChildCount() == 0; })) << tables();
    // The owner keeps the value while only worker 2 holds it.
    r = {};
    back = {};
    EXPECT_TRUE(eventually([&] { return rrefs(0)->userCount() == 0 && rrefs(0)->pendingControlCount() == 0; }));
    EXPECT_EQ(rrefs(1)->ownedCount(), 1u) << tables();
    EXPECT_EQ(kept[0].toHere(), 3);
    kept.clear();
    std::lock_guard<std::mutex> lock(world_.mutex);
    world_.kept.clear();
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RRefSettlement, DeletionsOfManyReferencesAreBatched) {
  start();
  const uint64_t before = agent(0).metrics(name(1)).callsSent;
  {
    std::vector<RRef<int64_t>> refs;
    for (int i = 0; i < 200; ++i) refs.push_back(rrefs(0)->remote(name(1), kAddInt, int64_t{i}, int64_t{1}));
    for (int i = 0; i < 200; ++i) EXPECT_EQ(refs[static_cast<size_t>(i)].toHere(), i + 1);
  }  // 200 deletions queued at once
  EXPECT_TRUE(allSettled()) << tables();
  const uint64_t sent = agent(0).metrics(name(1)).callsSent - before;
  EXPECT_GE(sent, 201u);
  EXPECT_LE(sent, 205u) << "200 deletions must leave in a few batches, not one call each";
}

INSTANTIATE_TEST_SUITE_P(Transports, RRefSettlement, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));

}  // namespace
}  // namespace distgrad::rref::testing
