// Randomized stress of the reference-counting protocol: three workers each create RRefs on random owners
// (themselves included), send them to random workers and back (owner->user, user->owner, user->user forks,
// relays through a third worker), read them, keep some for a while and drop them in random order, all
// concurrently. Afterwards every owner, user, child and control table of every worker must be empty and
// every value read must have been right.
#include <random>
#include <thread>

#include "tests/rref/rref_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::rref::testing {
namespace {

inline const rpc::Function<RRef<int64_t>(RRef<int64_t>)> kEcho{"stress_echo"};  // returns its argument
inline const rpc::Function<RRef<int64_t>(std::string, RRef<int64_t>)> kRelay{"stress_relay"};  // via a third

class RRefStress : public RRefFixture {
 protected:
  void bindExtra(rpc::Registry& registry) override {
    registry.bind(kEcho, [](RRef<int64_t> r) { return r; });
    registry.bind(kRelay, [this](const rpc::CallContext& ctx, std::string third, RRef<int64_t> r) {
      return world_.agent(ctx.callee).rpcAsync(third, kEcho, r);
    });
  }
};

TEST_P(RRefStress, ConcurrentCreateForkDropLeavesEveryTableEmpty) {
  constexpr int kWorkers = 3;
  constexpr int kRounds = 1000;
  start(kWorkers);
  std::atomic<int> wrongValues{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> drivers;
  for (int me = 0; me < kWorkers; ++me) {
    drivers.emplace_back([&, me] {
      std::mt19937 rng(1234 + me);
      auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint32_t>(n)); };
      std::vector<std::pair<RRef<int64_t>, int64_t>> held;
      try {
        for (int i = 0; i < kRounds; ++i) {
          const int owner = pick(kWorkers);
          const int64_t value = me * 100'000 + i;
          RRef<int64_t> r = rrefs(me)->remote(name(owner), kAddInt, value, int64_t{1});
          RRef<int64_t> got = r;
          switch (pick(4)) {
            case 0:  // read it
              break;
            case 1:  // to a random worker and back
              got = agent(me).rpcSync(name(pick(kWorkers)), kEcho, r);
              break;
            case 2: {  // through a random worker to a third one and back
              const int via = pick(kWorkers);
              got = agent(me).rpcSync(name(via), kRelay, name(pick(kWorkers)), r);
              break;
            }
            default:  // keep both for a while
              held.emplace_back(r, value + 1);
              break;
          }
          if (got.toHere() != value + 1) ++wrongValues;
          if (!held.empty() && pick(3) == 0) {
            // Drop a random held reference (any order).
            auto victim = held.begin() + pick(static_cast<int>(held.size()));
            if (victim->first.toHere() != victim->second) ++wrongValues;
            held.erase(victim);
          }
        }
      } catch (const std::exception& e) {
        ++failures;
        ADD_FAILURE() << "worker " << me << ": " << e.what();
      }
    });
  }
  for (auto& t : drivers) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(wrongValues.load(), 0);
  EXPECT_TRUE(allSettled()) << tables();
}

INSTANTIATE_TEST_SUITE_P(Transports, RRefStress, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));

}  // namespace
}  // namespace distgrad::rref::testing
