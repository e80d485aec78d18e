// Shared setup of the in-process Agent tests (agent_test.cpp, agent_limits_test.cpp): a registry of test
// functions, a cluster of agents over inproc or tcp started concurrently, and a fixture parameterised by the
// transport name. Not thread-safe beyond what World's mutex guards.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "async_test_util.h"
#include "autograd/ops.h"
#include "rpc/agent.h"
#include "rpc/store.h"
#include "rpc/transport/inproc/context.h"

namespace distgrad::rpc::testing {

using namespace std::chrono_literals;

// Options of rank `rank` in a tcp job of forked processes on 127.0.0.1 whose store listens on `storePort`:
// fast heartbeats (100 ms, dead after 1 s) so death tests stay short.
inline Options processOptions(int rank, int worldSize, int storePort, const std::string& secret) {
  Options options;
  options.rank = rank;
  options.worldSize = worldSize;
  options.transport = "tcp";
  options.storeAddr = "127.0.0.1:" + std::to_string(storePort);
  options.executorThreads = 2;
  options.secret = secret;
  options.heartbeatInterval = 100ms;
  options.heartbeatTimeout = 1000ms;
  options.rendezvousTimeout = 20s;
  options.defaultTimeout = 30s;
  return options;
}

// Starts this process's two agents of a processOptions job together (rendezvous needs every rank, so each
// starts on its own thread). Either failing fails the test, naming the rank.
inline void startProcessAgentPair(int rankA, std::unique_ptr<Agent>& a, int rankB, std::unique_ptr<Agent>& b,
                                  int worldSize, int storePort, const std::string& secret, const Registry& registry) {
  std::exception_ptr errorB;
  std::thread second([&] {
    try {
      b = Agent::start(processOptions(rankB, worldSize, storePort, secret), registry);
    } catch (...) {
      errorB = std::current_exception();
    }
  });
  std::exception_ptr errorA;
  try {
    a = Agent::start(processOptions(rankA, worldSize, storePort, secret), registry);
  } catch (...) {
    errorA = std::current_exception();
  }
  second.join();
  ASSERT_FALSE(errorA) << "rank " << rankA << " failed to start";
  ASSERT_FALSE(errorB) << "rank " << rankB << " failed to start";
}
using SteadyTime = std::chrono::steady_clock;

inline const Function<Tensor(Tensor, Tensor)> kAdd{"add"};
inline const Function<Tensor(Tensor)> kIdentity{"identity"};
inline const Function<int64_t(int64_t, int64_t)> kAddInt{"add_int"};
inline const Function<std::string(std::string)> kEcho{"echo"};
inline const Function<std::vector<double>(std::vector<double>, double)> kScale{"scale"};
inline const Function<void(int64_t)> kNoop{"noop"};
inline const Function<int64_t(int64_t)> kThrow{"throw"};
inline const Function<int64_t(int64_t)> kNested{"nested"};
inline const Function<bool(int64_t)> kWaitCancel{"wait_cancel"};
inline const Function<int64_t(int64_t)> kHang{"hang"};
inline const Function<int64_t(int64_t)> kForwardHang{"forward_hang"};        // awaits kHang on its caller
inline const Function<std::string(std::string)> kWrongSignature{"add_int"};  // same name, other types
inline const Function<int64_t()> kMissing{"missing"};
// Bound with Dispatch::kInline (Note [Inline handlers] in rpc/agent.cpp).
inline const Function<bool(int64_t)> kInlineOnExecutor{"inline_on_executor"};
inline const Function<int64_t(int64_t)> kInlineNested{"inline_nested"};
inline const Function<int64_t(int64_t)> kInlineBlocking{"inline_blocking"};

// What handlers share with the test body.
struct World {
  std::mutex mutex;
  std::map<std::string, Agent*> agents;  // filled after start, read by handlers making nested calls
  std::vector<CancellationRegistration> registrations;
  std::vector<std::shared_ptr<Promise<int64_t>>> hanging;
  Event cancelObserved;
  std::optional<ErrorKind> cancelKind;
  Event hangStarted;
  Event waitCancelStarted;

  Agent& agent(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex);
    return *agents.at(name);
  }
  // Answers the index-th kHang call (outside the lock: its continuations may run here).
  void completeHanging(size_t index, int64_t value) {
    std::shared_ptr<Promise<int64_t>> promise;
    {
      std::lock_guard<std::mutex> lock(mutex);
      promise = hanging.at(index);
    }
    promise->setValue(value);
  }
};

inline Registry makeRegistry(World& world) {
  Registry reg;
  reg.bind(kAdd, [](Tensor a, Tensor b) { return a + b; });
  reg.bind(kIdentity, [](Tensor a) { return a; });
  reg.bind(kAddInt, [](int64_t a, int64_t b) { return a + b; });
  reg.bind(kEcho, [](const CallContext& ctx, std::string s) { return s + " from " + ctx.callee + " to " + ctx.caller; });
  reg.bind(kScale, [](std::vector<double> v, double k) {
    for (double& x : v) x *= k;
    return v;
  });
  reg.bind(kNoop, [](int64_t) {});
  reg.bind(kThrow, [](int64_t n) -> int64_t { throw std::out_of_range("index " + std::to_string(n) + " is too big"); });
  // Calls back into the caller and returns a Future: no executor thread waits meanwhile.
  reg.bind(kNested, [&world](const CallContext& ctx, int64_t n) -> Future<int64_t> {
    return world.agent(ctx.callee).rpcAsync(ctx.caller, kAddInt, n, int64_t{1}).then([](int64_t v) { return v * 10; });
  });
  reg.bind(kForwardHang, [&world](const CallContext& ctx, int64_t n) -> Future<int64_t> {
    return world.agent(ctx.callee).rpcAsync(ctx.caller, kHang, n);
  });
  reg.bind(kInlineOnExecutor, [](int64_t) { return Executor::current() != nullptr; }, Dispatch::kInline);
  reg.bind(
      kInlineNested,
      [&world](const CallContext& ctx, int64_t n) -> Future<int64_t> {
        return world.agent(ctx.callee).rpcAsync(ctx.caller, kAddInt, n, int64_t{1}).then([](int64_t v) {
          return v * 10;
        });
      },
      Dispatch::kInline);
  reg.bind(
      kInlineBlocking,
      [&world](const CallContext& ctx, int64_t n) {
        return world.agent(ctx.callee).rpcSync(ctx.caller, kAddInt, n, int64_t{1});
      },
      Dispatch::kInline);
  reg.bind(kWaitCancel, [&world](const CallContext& ctx, int64_t) -> Future<bool> {
    auto promise = std::make_shared<Promise<bool>>(*Executor::current());
    Future<bool> future = promise->getFuture();
    auto registration = ctx.token.onCancel([&world, promise](const Error& reason) {
      {
        std::lock_guard<std::mutex> lock(world.mutex);
        world.cancelKind = reason.kind;
      }
      world.cancelObserved.set();
      promise->trySetValue(true);
    });
    {
      std::lock_guard<std::mutex> lock(world.mutex);
      world.registrations.push_back(std::move(registration));
    }
    world.waitCancelStarted.set();
    return future;
  });
  reg.bind(kHang, [&world](int64_t) -> Future<int64_t> {
    auto promise = std::make_shared<Promise<int64_t>>(*Executor::current());
    Future<int64_t> future = promise->getFuture();
    {
      std::lock_guard<std::mutex> lock(world.mutex);
      world.hanging.push_back(promise);
    }
    world.hangStarted.set();
    return future;
  });
  return reg;
}

// A kWaitCancel call from `caller` to `callee`, cancelled through CallOptions::cancel once its handler
// runs: the caller sees `cancelled`, and so does the handler's token.
inline void expectExplicitCancelReachesTheHandler(Agent& caller, const std::string& callee, World& world) {
  CancellationSource source;
  CallOptions options;
  options.cancel = source.token();
  Future<bool> f = caller.rpcAsyncWith(options, callee, kWaitCancel, 1);
  // Cancel once the handler runs (its registration is in place).
  ASSERT_TRUE(world.waitCancelStarted.waitFor());
  source.cancel();
  Result<bool> r = f.result();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, ErrorKind::kCancelled);
  ASSERT_TRUE(world.cancelObserved.waitFor());
  std::lock_guard<std::mutex> lock(world.mutex);
  EXPECT_EQ(world.cancelKind, ErrorKind::kCancelled);
}

struct ClusterSpec {
  std::string transport = "inproc";
  int size = 2;
  int executorThreads = 4;
  std::vector<std::string> secrets;  // per rank; empty: the same secret for all
  std::vector<uint16_t> protocolVersions;  // per rank (AgentConfig::protocolVersionForTesting); empty: the real one
  std::chrono::milliseconds heartbeatInterval{100};
  std::chrono::milliseconds heartbeatTimeout{3000};
  std::chrono::milliseconds rendezvousTimeout{10'000};
  std::chrono::milliseconds shutdownTimeout{10'000};
  std::string traceDir;                            // Options::traceDir of every rank (empty: no tracing)
  std::vector<std::chrono::nanoseconds> clockSkews;  // per rank (AgentConfig::clockSkewForTesting); empty: none
  std::function<void(int rank, Options&)> customize;  // last word on each rank's options (device maps, ...)
};

struct Cluster {
  std::unique_ptr<StoreServer> store;
  std::vector<std::unique_ptr<Agent>> agents;
  std::vector<std::exception_ptr> errors;
  World* world = nullptr;

  ~Cluster() {
    if (world != nullptr) {
      // Hanging promises are bound to their agent's executor: drop them before the agents.
      for (auto& agent : agents) {
        if (agent) agent->shutdown(false);
      }
      std::lock_guard<std::mutex> lock(world->mutex);
      world->hanging.clear();
      world->registrations.clear();
    }
    agents.clear();
  }
};

// Starts spec.size agents concurrently (start() returns once every peer is connected).
inline void startCluster(Cluster& cluster, const ClusterSpec& spec, World& world, const Registry& reg) {
  cluster.world = &world;
  cluster.store = StoreServer::start("127.0.0.1:0");
  auto hub = std::make_shared<transport::inproc::InprocHub>();
  cluster.agents.resize(spec.size);
  cluster.errors.resize(spec.size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < spec.size; ++rank) {
    threads.emplace_back([&, rank] {
      Options options;
      options.rank = rank;
      options.worldSize = spec.size;
      options.storeAddr = cluster.store->address();
      options.transport = spec.transport;
      options.executorThreads = spec.executorThreads;
      options.secret = spec.secrets.empty() ? "s3cret" : spec.secrets[rank];
      options.heartbeatInterval = spec.heartbeatInterval;
      options.heartbeatTimeout = spec.heartbeatTimeout;
      options.rendezvousTimeout = spec.rendezvousTimeout;
      options.defaultTimeout = 20s;
      options.traceDir = spec.traceDir;
      if (spec.customize) spec.customize(rank, options);
      AgentConfig config;
      config.inprocHub = hub;
      config.shutdownTimeout = spec.shutdownTimeout;
      if (!spec.protocolVersions.empty()) config.protocolVersionForTesting = spec.protocolVersions[rank];
      if (!spec.clockSkews.empty()) config.clockSkewForTesting = spec.clockSkews[rank];
      try {
        cluster.agents[rank] = Agent::start(options, reg, config);
      } catch (...) {
        cluster.errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  std::lock_guard<std::mutex> lock(world.mutex);
  for (auto& agent : cluster.agents) {
    if (agent) world.agents[agent->name()] = agent.get();
  }
}

inline Error errorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const RpcError& e) {
    return e.error();
  }
  ADD_FAILURE() << "expected an RpcError";
  return Error::failed("no error");
}

class AgentFixture : public ::testing::TestWithParam<std::string> {
 protected:
  // `extra` adds functions to the shared test registry before the agents start.
  void start(ClusterSpec spec = {}, const std::function<void(Registry&)>& extra = {}) {
    spec.transport = GetParam();
    registry_ = makeRegistry(world_);
    if (extra) extra(registry_);
    startCluster(cluster_, spec, world_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) {
      if (cluster_.errors[i]) {
        try {
          std::rethrow_exception(cluster_.errors[i]);
        } catch (const std::exception& e) {
          FAIL() << "rank " << i << " failed to start: " << e.what();
        }
      }
    }
  }
  Agent& agent(int rank) { return *cluster_.agents.at(rank); }

  World world_;
  Registry registry_;
  Cluster cluster_;
};

}  // namespace distgrad::rpc::testing
