// Note [Value in creation reply]: the owner answers the creating call of a small plain value with the value,
// so toHere on the user that made the RRef sends nothing (after the answer) or waits for that answer
// (before it); values that cannot be carried (tensors, large values, errors) are fetched as before; the
// reference count settles the same in every case.
#include <gtest/gtest.h>

#include <numeric>

#include "rref_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::rref::testing {
namespace {

const rpc::Function<Tensor(int64_t)> kFilled{"creation_reply.filled"};                 // a tensor: not carried
const rpc::Function<std::vector<int64_t>(int64_t)> kRange{"creation_reply.range"};  // 0..n-1
const rpc::Function<std::string(int64_t)> kText{"creation_reply.text"};

class CreationReply : public RRefFixture {
 protected:
  void bindExtra(rpc::Registry& registry) override {
    registry.bind(kFilled, [](int64_t n) { return Tensor::full({n}, 3.0); });
    registry.bind(kRange, [](int64_t n) {
      std::vector<int64_t> out(static_cast<size_t>(n));
      std::iota(out.begin(), out.end(), int64_t{0});
      return out;
    });
    registry.bind(kText, [](int64_t n) { return std::string(static_cast<size_t>(n), 'x'); });
  }
  uint64_t callsTo(int from, int to) { return agent(from).metrics(name(to)).callsSent; }
};

TEST_P(CreationReply, ToHereAfterTheReplyIsLocal) {
  start();
  {
    RRef<int64_t> r = rrefs(0)->remote(name(1), kAddInt, int64_t{2}, int64_t{40});
    RRef<std::string> s = rrefs(0)->remote(name(1), kText, int64_t{100});
    ASSERT_TRUE(eventually([&] { return r.confirmedByOwner() && s.confirmedByOwner(); }));
    const uint64_t before = callsTo(0, 1);
    EXPECT_EQ(r.toHere(), 42);
    EXPECT_EQ(r.toHere(), 42);  // again: the carried value is decoded anew
    EXPECT_EQ(r.toHereAsync().get(), 42);
    EXPECT_EQ(s.toHere(), std::string(100, 'x'));
    EXPECT_EQ(callsTo(0, 1), before) << "a carried value must not be fetched";
    // The owner still holds the value for the user (other forks, method calls): the count is unchanged.
    EXPECT_EQ(rrefs(1)->ownedCount(), 2u);
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(CreationReply, ToHereBeforeTheReplyWaitsForIt) {
  start();
  const uint64_t before = callsTo(0, 1);
  {
    // The value waits at the owner (gated): the creation answer is not sent yet.
    RRef<int64_t> r = rrefs(0)->remote(name(1), kGated, int64_t{1});
    ASSERT_TRUE(world_.gateEntered.waitFor());
    auto pending = r.toHereAsync();
    auto second = r.toHereAsync();
    EXPECT_FALSE(pending.isReady());
    EXPECT_FALSE(r.confirmedByOwner());  // the answer confirms the fork; it comes with the value
    {
      std::lock_guard<std::mutex> lock(world_.mutex);
      world_.gate->setValue(int64_t{41});
    }
    EXPECT_EQ(pending.get(), 42);
    EXPECT_EQ(second.get(), 42);
    EXPECT_TRUE(r.confirmedByOwner());
    EXPECT_EQ(callsTo(0, 1) - before, 1u) << "only the creating call: both toHere took its answer";
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(CreationReply, DroppedBeforeTheReplyIsDeletedAfterIt) {
  start();
  {
    RRef<int64_t> r = rrefs(0)->remote(name(1), kGated, int64_t{1});
    ASSERT_TRUE(world_.gateEntered.waitFor());
    r = {};  // unconfirmed: the deletion waits for the answer (Note [User deletion])
    EXPECT_EQ(rrefs(0)->userCount(), 1u);
    EXPECT_EQ(rrefs(1)->ownedCount(), 1u);
    std::lock_guard<std::mutex> lock(world_.mutex);
    world_.gate->setValue(int64_t{41});
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(CreationReply, ValuesThatAreNotCarriedAreFetched) {
  start();
  {
    RRef<Tensor> t = rrefs(0)->remote(name(1), kFilled, int64_t{4});
    RRef<std::vector<int64_t>> big = rrefs(0)->remote(name(1), kRange, int64_t{10000});  // > 4 KiB
    RRef<int64_t> failed = rrefs(0)->remote(name(1), kThrowing, int64_t{7});
    ASSERT_TRUE(eventually([&] { return t.confirmedByOwner() && big.confirmedByOwner() && failed.confirmedByOwner(); }));
    const uint64_t before = callsTo(0, 1);
    EXPECT_EQ(t.toHere().toVector<float>(), (std::vector<float>{3.0f, 3.0f, 3.0f, 3.0f}));
    std::vector<int64_t> values = big.toHere();
    ASSERT_EQ(values.size(), 10000u);
    EXPECT_EQ(values[9999], 9999);
    rpc::Error error = rpc::testing::errorOf([&] { (void)failed.toHere(); });
    EXPECT_NE(error.message.find("bad n 7"), std::string::npos) << error.describe();
    EXPECT_EQ(callsTo(0, 1) - before, 3u) << "one fetch each";
    // Two toHere of a tensor are two fetches: each copy has its own buffer.
    Tensor a = t.toHere();
    Tensor b = t.toHere();
    EXPECT_NE(a.data<float>(), b.data<float>());
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(CreationReply, ExplicitTimeoutFetchesUnlessTheValueIsHere) {
  start();
  {
    RRef<int64_t> r = rrefs(0)->remote(name(1), kGated, int64_t{1});
    ASSERT_TRUE(world_.gateEntered.waitFor());
    const uint64_t before = callsTo(0, 1);
    // Bounded by its own timeout: a fetch, which times out while the value waits.
    rpc::Error error = rpc::testing::errorOf([&] { (void)r.toHere(std::chrono::milliseconds(50)); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kTimeout) << error.describe();
    EXPECT_EQ(callsTo(0, 1) - before, 1u);
    {
      std::lock_guard<std::mutex> lock(world_.mutex);
      world_.gate->setValue(int64_t{41});
    }
    ASSERT_TRUE(eventually([&] { return r.confirmedByOwner(); }));
    const uint64_t after = callsTo(0, 1);
    EXPECT_EQ(r.toHere(std::chrono::milliseconds(5000)), 42);  // carried: no call
    EXPECT_EQ(callsTo(0, 1), after);
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(CreationReply, OwnerKilledAfterTheReply) {
  start();
  RRef<int64_t> carried = rrefs(0)->remote(name(1), kAddInt, int64_t{1}, int64_t{2});
  RRef<int64_t> pending = rrefs(0)->remote(name(1), kGated, int64_t{1});
  ASSERT_TRUE(world_.gateEntered.waitFor());
  auto waiting = pending.toHereAsync();  // waits for the creation answer, which never comes
  ASSERT_TRUE(eventually([&] { return carried.confirmedByOwner(); }));
  agent(1).shutdown(/*graceful=*/false);
  // The value is here already: toHere still answers after the owner died.
  EXPECT_EQ(carried.toHere(), 3);
  // The waiting one fails with OwnerLost (and so does a later one), not with a timeout.
  for (rpc::Error error : {rpc::testing::errorOf([&] { (void)waiting.get(); }),
                           rpc::testing::errorOf([&] { (void)pending.toHere(); })}) {
    EXPECT_TRUE(isOwnerLost(error)) << error.describe();
    EXPECT_EQ(error.worker, name(1));
  }
  carried = {};
  pending = {};
  EXPECT_TRUE(eventually([&] { return rrefs(0)->userCount() == 0 && rrefs(0)->pendingControlCount() == 0; }))
      << tables();
}

TEST_P(CreationReply, MethodStoreValuesAreCarried) {
  start();
  {
    RRef<Counter> c = rrefs(0)->remote<Counter>(name(1), int64_t{10});
    RRef<int64_t> x = c.remote(&Counter::add, int64_t{5});
    EXPECT_EQ(x.toHere(), 15);  // waited for the creation answer, which carried the method's result
    ASSERT_TRUE(x.confirmedByOwner());
    const uint64_t before = callsTo(0, 1);
    EXPECT_EQ(x.toHere(), 15);
    EXPECT_EQ(callsTo(0, 1), before);
  }
  EXPECT_TRUE(allSettled()) << tables();
}

INSTANTIATE_TEST_SUITE_P(Transports, CreationReply, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));

}  // namespace
}  // namespace distgrad::rref::testing
