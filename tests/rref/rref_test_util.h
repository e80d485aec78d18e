// Shared setup of the rref tests: a registered class (Counter), functions, and a cluster of agents over
// inproc or tcp whose registries include the rref functions (rref::RRefContext::install).
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../rpc/agent_test_util.h"
#include "rref/context.h"
#include "rref/rref.h"

namespace distgrad::rref::testing {

using namespace std::chrono_literals;
using rpc::testing::eventually;

// Every RRef table of every agent empty (the protocol settled, nothing leaked): bounded wait.
inline bool rrefsSettled(const std::vector<std::unique_ptr<rpc::Agent>>& agents) {
  return eventually([&] {
    for (const auto& a : agents) {
      auto c = RRefContext::of(*a);
      if (c->ownedCount() != 0 || c->userCount() != 0 || c->pendingChildCount() != 0 || c->pendingControlCount() != 0) {
        return false;
      }
    }
    return true;
  });
}
// The sizes of those tables, for failure messages.
inline std::string rrefTables(const std::vector<std::unique_ptr<rpc::Agent>>& agents) {
  std::string out;
  for (const auto& a : agents) {
    auto c = RRefContext::of(*a);
    out += a->name() + ": owned " + std::to_string(c->ownedCount()) + " users " + std::to_string(c->userCount()) +
           " children " + std::to_string(c->pendingChildCount()) + " control " +
           std::to_string(c->pendingControlCount()) + "; ";
  }
  return out;
}

// A registered class: constructed remotely, methods called through RRefs.
class Counter {
 public:
  explicit Counter(int64_t start) : value_(start) { ++alive; }
  ~Counter() { --alive; }
  int64_t add(int64_t n) { return value_ += n; }
  int64_t get() const { return value_; }
  Tensor scaled(Tensor x) const { return x * static_cast<double>(value_); }
  static inline std::atomic<int> alive{0};

 private:
  std::atomic<int64_t> value_;
};

inline const rpc::Class<Counter> kCounter = rpc::Class<Counter>("Counter")
                                                .method("add", &Counter::add)
                                                .method("get", &Counter::get)
                                                .method("scaled", &Counter::scaled);

}  // namespace distgrad::rref::testing

DG_RREF_CLASS(distgrad::rref::testing::Counter, distgrad::rref::testing::kCounter);

namespace distgrad::rref::testing {

inline const rpc::Function<int64_t(int64_t, int64_t)> kAddInt{"add_int"};
inline const rpc::Function<int64_t(int64_t)> kThrowing{"throwing"};
inline const rpc::Function<int64_t(int64_t)> kGated{"gated"};             // waits on World::gate (no thread held)
inline const rpc::Function<int64_t(RRef<int64_t>)> kReadRef{"read_ref"};  // toHere of an argument RRef
inline const rpc::Function<RRef<int64_t>(RRef<int64_t>)> kPassBack{"pass_back"};                // returns its argument
inline const rpc::Function<RRef<int64_t>(std::string, RRef<int64_t>)> kForward{"forward_ref"};  // to a third
inline const rpc::Function<int64_t(std::string)> kMissing{"missing"};

struct World {
  std::mutex mutex;
  std::map<std::string, rpc::Agent*> agents;
  std::shared_ptr<rpc::Promise<int64_t>> gate;
  rpc::testing::Event gateEntered;
  std::vector<RRef<int64_t>> kept;  // references a handler keeps (cleared by the test)

  rpc::Agent& agent(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex);
    return *agents.at(name);
  }
};

inline rpc::Registry makeRegistry(World& world) {
  rpc::Registry reg;
  RRefContext::install(reg);
  reg.bindClass(kCounter).ctor<int64_t>();
  reg.bind(kAddInt, [](int64_t a, int64_t b) { return a + b; });
  reg.bind(kThrowing, [](int64_t n) -> int64_t { throw std::invalid_argument("bad n " + std::to_string(n)); });
  reg.bind(kGated, [&world](int64_t n) -> rpc::Future<int64_t> {
    auto promise = std::make_shared<rpc::Promise<int64_t>>(*rpc::Executor::current());
    auto future = promise->getFuture().then([n](int64_t v) { return v + n; });
    {
      std::lock_guard<std::mutex> lock(world.mutex);
      world.gate = promise;
    }
    world.gateEntered.set();
    return future;
  });
  reg.bind(kReadRef, [](RRef<int64_t> r) -> rpc::Future<int64_t> { return r.toHereAsync(); });
  reg.bind(kPassBack, [&world](RRef<int64_t> r) {
    std::lock_guard<std::mutex> lock(world.mutex);
    world.kept.push_back(r);
    return r;
  });
  reg.bind(kForward, [&world](const rpc::CallContext& ctx, std::string third, RRef<int64_t> r) {
    // Sends the RRef on to a third worker and returns what that worker sends back.
    return world.agent(ctx.callee).rpcAsync(third, kPassBack, r);
  });
  return reg;
}

class RRefFixture : public ::testing::TestWithParam<std::string> {
 protected:
  void start(int size = 3) {
    rpc::testing::ClusterSpec spec;
    spec.transport = GetParam();
    spec.size = size;
    registry_ = makeRegistry(world_);
    bindExtra(registry_);
    // The cluster helper's World only needs the agent map; ours is kept separately.
    rpc::testing::startCluster(cluster_, spec, rpcWorld_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) ASSERT_FALSE(cluster_.errors[i]) << "rank " << i;
    std::lock_guard<std::mutex> lock(world_.mutex);
    for (auto& agent : cluster_.agents) world_.agents[agent->name()] = agent.get();
  }
  void TearDown() override {
    {
      std::lock_guard<std::mutex> lock(world_.mutex);
      world_.kept.clear();
      world_.gate.reset();
    }
  }
  // Suites add their own functions and classes here (before the agents start).
  virtual void bindExtra(rpc::Registry& registry) {}
  rpc::Agent& agent(int rank) { return *cluster_.agents.at(rank); }
  std::shared_ptr<RRefContext> rrefs(int rank) { return RRefContext::of(agent(rank)); }
  std::string name(int rank) { return agent(rank).name(); }
  // Every table of every worker empty (the protocol settled): bounded wait.
  bool allSettled() { return rrefsSettled(cluster_.agents); }
  std::string tables() { return rrefTables(cluster_.agents); }

  World world_;
  rpc::testing::World rpcWorld_;
  rpc::Registry registry_;
  rpc::testing::Cluster cluster_;
};

}  // namespace distgrad::rref::testing
