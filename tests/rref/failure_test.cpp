// Worker death: every waiter on an RRef whose owner died fails with OwnerLost naming the owner; when a
// user dies its owner drops the references it held.
#include <gtest/gtest.h>

#include "rref_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::rref::testing {
namespace {

using RRefFailure = RRefFixture;

TEST_P(RRefFailure, OwnerDeathFailsWaitersWithOwnerLost) {
  start();
  RRef<int64_t> seed = rrefs(0)->remote(name(1), kGated, int64_t{1});
  ASSERT_TRUE(world_.gateEntered.waitFor());
  RRef<Counter> c = rrefs(0)->remote<Counter>(name(1), int64_t{1});
  EXPECT_EQ(c.rpcSync(&Counter::get), 1);
  auto fetch = seed.toHereAsync();  // queued at the owner: the value is not resolved
  EXPECT_FALSE(fetch.isReady());
  agent(1).shutdown(/*graceful=*/false);  // the owner dies with calls queued on its values
  for (rpc::Error error : {rpc::testing::errorOf([&] { (void)fetch.get(); }),
                           rpc::testing::errorOf([&] { (void)seed.toHere(); }),
                           rpc::testing::errorOf([&] { (void)c.rpcSync(&Counter::add, int64_t{1}); })}) {
    EXPECT_TRUE(isOwnerLost(error)) << error.describe();
    EXPECT_EQ(error.worker, name(1));
    EXPECT_NE(error.message.find("OwnerLost"), std::string::npos) << error.describe();
  }
  // References to a dead owner are dropped without a message.
  seed = {};
  c = {};
  EXPECT_TRUE(eventually([&] { return rrefs(0)->userCount() == 0 && rrefs(0)->pendingControlCount() == 0; }))
      << tables();
}

TEST_P(RRefFailure, UserDeathDropsItsReferences) {
  start();
  const int aliveBefore = Counter::alive.load();
  {
    RRef<int64_t> r = rrefs(0)->remote(name(1), kAddInt, int64_t{1}, int64_t{1});
    RRef<Counter> c = rrefs(2)->remote<Counter>(name(1), int64_t{3});
    EXPECT_EQ(c.rpcSync(&Counter::get), 3);
    // Worker 2 keeps a fork of r (pass_back stores it) and owns nothing else; then it dies.
    RRef<int64_t> back = agent(0).rpcSync(name(2), kPassBack, r);
    EXPECT_TRUE(eventually([&] { return rrefs(2)->userCount() == 2; })) << tables();
    // r's creating call was never awaited: it may still be on its way to the owner.
    EXPECT_TRUE(eventually([&] { return rrefs(1)->ownedCount() == 2; })) << tables();
    agent(2).shutdown(/*graceful=*/false);
    // The object only worker 2 referenced is freed; r stays for worker 0.
    EXPECT_TRUE(eventually([&] { return rrefs(1)->ownedCount() == 1; })) << tables();
    EXPECT_TRUE(eventually([&] { return Counter::alive.load() == aliveBefore; }));
    EXPECT_EQ(back.toHere(), 2);
    EXPECT_EQ(r.toHere(), 2);
  }
  EXPECT_TRUE(eventually([&] { return rrefs(1)->ownedCount() == 0 && rrefs(0)->userCount() == 0; })) << tables();
}

INSTANTIATE_TEST_SUITE_P(Transports, RRefFailure, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));

}  // namespace
}  // namespace distgrad::rref::testing
