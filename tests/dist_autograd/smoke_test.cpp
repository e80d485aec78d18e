// The core paths of distributed autograd on small graphs (the lead's checks while building it): a stage on
// another worker, a cycle A->B->A, a self call, both modes, the unused-branch case and release everywhere.
#include <gtest/gtest.h>

#include "../rpc/agent_test_util.h"
#include "autograd/distributed/dist_autograd.h"
#include "autograd/distributed/state.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "rref/rref.h"
#include "tensor/random.h"
#include "tests/transport_params.h"

namespace distgrad::autograd::distributed {
namespace {
// Reports the distributed autograd context active where its method runs (called through an RRef).
class ContextProbe {
 public:
  uint64_t activeContext() { return rpc::activeAutogradContext(); }
};
const rpc::Class<ContextProbe>& probeClass() {
  static const rpc::Class<ContextProbe> cls =
      rpc::Class<ContextProbe>("smoke.ContextProbe").method("activeContext", &ContextProbe::activeContext);
  return cls;
}
}  // namespace
}  // namespace distgrad::autograd::distributed
DG_RREF_CLASS(distgrad::autograd::distributed::ContextProbe, distgrad::autograd::distributed::probeClass());

namespace distgrad::autograd::distributed {
namespace {

using rpc::testing::eventually;

// Worker-local parameters (one set per process, keyed by worker name) and the functions that use them.
struct Params {
  std::mutex mutex;
  std::map<std::string, Tensor> weights;
  Tensor of(const std::string& worker) {
    std::lock_guard<std::mutex> lock(mutex);
    return weights.at(worker);
  }
};

const rpc::Function<Tensor(Tensor)> kStage{"stage"};               // tanh(x @ W_callee)
const rpc::Function<Tensor(Tensor)> kBounce{"bounce"};             // stage on the caller, called back
const rpc::Function<Tensor(Tensor)> kTwoOutputsOneUsed{"unused"};  // returns x * W but also sends x away
const rpc::Function<uint64_t()> kActiveContext{"active_context"};  // the context the handler runs in

class DistAutogradSmoke : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    tensor::Generator gen(7);
    for (std::string w : {"worker0", "worker1", "worker2"}) {
      params_.weights[w] = tensor::uniform({4, 4}, -1.0, 1.0, gen, DType::kFloat64).setRequiresGrad();
    }
    install(registry_);
    rref::RRefContext::install(registry_);
    registry_.bindClass(probeClass()).ctor<>();
    registry_.bind(kActiveContext, [] { return rpc::activeAutogradContext(); });
    registry_.bind(kStage,
                   [this](const rpc::CallContext& ctx, Tensor x) { return tanh(matmul(x, params_.of(ctx.callee))); });
    registry_.bind(kBounce, [this](const rpc::CallContext& ctx, Tensor x) {
      Tensor h = tanh(matmul(x, params_.of(ctx.callee)));
      return world_.agent(ctx.callee).rpcSync(ctx.caller, kStage, h);
    });
    registry_.bind(kTwoOutputsOneUsed, [this](const rpc::CallContext& ctx, Tensor x) {
      // Sends x on to worker2, whose result nobody uses: that send never receives a gradient.
      (void)world_.agent(ctx.callee).rpcSync("worker2", kStage, x);
      return tanh(matmul(x, params_.of(ctx.callee)));
    });
    rpc::testing::ClusterSpec spec;
    spec.transport = GetParam();
    spec.size = 3;
    rpc::testing::startCluster(cluster_, spec, world_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) ASSERT_FALSE(cluster_.errors[i]) << "rank " << i;
  }
  rpc::Agent& agent(int rank) { return *cluster_.agents.at(rank); }
  bool allReleased() {
    return eventually([&] {
      for (auto& a : cluster_.agents) {
        if (liveContexts(*a) != 0) return false;
      }
      return true;
    });
  }
  void cycleAndSelfCall();
  // `callsBack`: calls worker1 makes to worker0 during the EXACT backward (1 with plans: the gradients; 2
  // through discovery: also its discover call), which shows which mechanism ran.
  void unusedSend(uint64_t callsBack);
  Tensor input() {
    tensor::Generator gen(3);
    return tensor::uniform({2, 4}, -1.0, 1.0, gen, DType::kFloat64).setRequiresGrad();
  }

  Params params_;
  rpc::testing::World world_;
  rpc::Registry registry_;
  rpc::testing::Cluster cluster_;
};

void expectClose(const Tensor& a, const Tensor& b) {
  ASSERT_TRUE(a.defined());
  ASSERT_TRUE(b.defined());
  ASSERT_EQ(a.shape(), b.shape());
  auto x = a.toVector<double>();
  auto y = b.toVector<double>();
  for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], y[i], 1e-12) << "element " << i;
}

TEST_P(DistAutogradSmoke, StageOnAnotherWorkerMatchesLocal) {
  for (auto mode : {BackwardMode::kExact, BackwardMode::kFast}) {
    Tensor x = input();
    Tensor w0 = params_.of("worker0"), w1 = params_.of("worker1");
    Gradients root, remote;
    {
      DistContext ctx(agent(0));
      Tensor h = agent(0).rpcSync("worker1", kStage, tanh(matmul(x, w0)));
      Tensor loss = sum(h * h);
      BackwardOptions options;
      options.mode = mode;
      ctx.backward(loss, options);
      root = ctx.gradients();
      remote = gradientsOf(agent(1), ctx.id());
    }
    EXPECT_FALSE(w0.grad().defined());
    Tensor loss = sum(tanh(matmul(tanh(matmul(x, w0)), w1)) * tanh(matmul(tanh(matmul(x, w0)), w1)));
    auto local = grad({loss}, {x, w0, w1});
    expectClose(root.get(x), local[0]);
    expectClose(root.get(w0), local[1]);
    expectClose(remote.get(w1), local[2]);
    EXPECT_TRUE(allReleased());
  }
}

TEST_P(DistAutogradSmoke, CycleAndSelfCall) { ASSERT_NO_FATAL_FAILURE(cycleAndSelfCall()); }

// The same with every closure unknown: EXACT falls back to discovery (Note [Exact discovery]).
TEST_P(DistAutogradSmoke, CycleAndSelfCallThroughDiscovery) {
  for (auto& a : cluster_.agents) DistAutogradState::of(*a)->setClosureLimitForTesting(0);
  ASSERT_NO_FATAL_FAILURE(cycleAndSelfCall());
}

void DistAutogradSmoke::cycleAndSelfCall() {
  Tensor x = input();
  Tensor w0 = params_.of("worker0"), w1 = params_.of("worker1");
  DistContext ctx(agent(0));
  // worker0 -> worker1 (bounce: W1) -> worker0 (stage: W0) -> back; then a self call on worker0.
  Tensor h = agent(0).rpcSync("worker1", kBounce, x);
  Tensor y = agent(0).rpcSync("worker0", kStage, h);
  ctx.backward(sum(y));
  auto g = ctx.gradients();
  Tensor local = sum(tanh(matmul(tanh(matmul(tanh(matmul(x, w1)), w0)), w0)));
  auto expected = grad({local}, {x, w0, w1});
  expectClose(g.get(x), expected[0]);
  expectClose(g.get(w0), expected[1]);
  expectClose(gradientsOf(agent(1), ctx.id()).get(w1), expected[2]);
}

TEST_P(DistAutogradSmoke, UnusedSendExactCompletesFastTimesOut) { ASSERT_NO_FATAL_FAILURE(unusedSend(1)); }

TEST_P(DistAutogradSmoke, UnusedSendThroughDiscovery) {
  for (auto& a : cluster_.agents) DistAutogradState::of(*a)->setClosureLimitForTesting(0);
  ASSERT_NO_FATAL_FAILURE(unusedSend(2));
}

void DistAutogradSmoke::unusedSend(uint64_t callsBack) {
  Tensor x = input();
  {
    DistContext ctx(agent(0));
    Tensor y = agent(0).rpcSync("worker1", kTwoOutputsOneUsed, x);
    const uint64_t before = agent(0).metrics("worker1").callsReceived;
    ctx.backward(sum(y));
    EXPECT_EQ(agent(0).metrics("worker1").callsReceived - before, callsBack);
    Tensor expected = grad({sum(tanh(matmul(x, params_.of("worker1"))))}, {x})[0];
    expectClose(ctx.gradients().get(x), expected);
  }
  {
    DistContext ctx(agent(0));
    Tensor y = agent(0).rpcSync("worker1", kTwoOutputsOneUsed, x);
    BackwardOptions options;
    options.mode = BackwardMode::kFast;
    options.timeout = std::chrono::milliseconds(300);
    try {
      ctx.backward(sum(y), options);
      ADD_FAILURE() << "FAST must time out waiting for the unused send";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.error().kind, rpc::ErrorKind::kTimeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("FAST"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(allReleased());
  // Nothing is wedged: a new context works.
  DistContext ctx(agent(0));
  ctx.backward(sum(agent(0).rpcSync("worker1", kStage, x)));
  EXPECT_TRUE(ctx.gradients().get(x).defined());
}

// The protocol messages are wire input: a peer sending nonsense gets an error naming what is wrong, and the
// context it touched keeps working.
TEST_P(DistAutogradSmoke, MalformedProtocolMessagesAreClearErrors) {
  auto expectError = [&](const auto& fn, const auto& request, const std::string& text) {
    try {
      agent(0).rpcSync("worker1", fn, request);
      ADD_FAILURE() << "accepted a malformed request; expected: " << text;
    } catch (const rpc::RpcError& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  Tensor x = input();
  DistContext ctx(agent(0));
  Tensor y = agent(0).rpcSync("worker1", kStage, x);  // worker1 joins ctx and records the reply's send
  {
    rpc::AutogradContextScope outside(0);  // protocol messages travel outside any context
    PropagateRequest unknownContext;
    unknownContext.contextId = ctx.id() + 1000;
    expectError(kPropagate, unknownContext, "does not know distributed autograd context");
    PropagateRequest badMode;
    badMode.contextId = ctx.id();
    badMode.mode = 7;
    expectError(kPropagate, badMode, "unknown backward mode 7");
    // EXACT gradients of a pass whose plan never comes wait for it (until the caller gives up).
    PropagateRequest noPlan;
    noPlan.contextId = ctx.id();
    noPlan.passId = 42;
    rpc::CallOptions shortWait;
    shortWait.timeout = std::chrono::milliseconds(100);
    auto waited = agent(0).rpcAsyncWith(shortWait, "worker1", kPropagate, noPlan).result();
    ASSERT_FALSE(waited.ok());
    EXPECT_EQ(waited.error().kind, rpc::ErrorKind::kTimeout) << waited.error().describe();
    DiscoverRequest badPlan;
    badPlan.contextId = ctx.id();
    badPlan.passId = 42;
    badPlan.messageIds = {999};
    expectError(kPlan, badPlan, "never sent in context");
    PropagateRequest unknownMessage;
    unknownMessage.contextId = ctx.id();
    unknownMessage.passId = 43;
    unknownMessage.mode = static_cast<uint8_t>(BackwardMode::kFast);
    unknownMessage.messageId = 12345;
    expectError(kPropagate, unknownMessage, "does not expect");
    DiscoverRequest unknownSend;
    unknownSend.contextId = ctx.id();
    unknownSend.passId = 44;
    unknownSend.messageIds = {999};
    expectError(kDiscover, unknownSend, "never sent in context");
    ControlRequest badKind;
    badKind.kind = 9;
    badKind.contextId = ctx.id();
    expectError(kControl, badKind, "unknown control kind 9");
  }
  // The context still works end to end.
  ctx.backward(sum(y));
  Tensor expected = grad({sum(tanh(matmul(x, params_.of("worker1"))))}, {x})[0];
  expectClose(ctx.gradients().get(x), expected);
}

TEST_P(DistAutogradSmoke, HandlersAndRRefMethodsRunInsideTheCallersContext) {
  // A method called through an RRef waits at the owner until the object exists (Note [Promise pipelining])
  // and then runs from an executor task: it must still run inside the caller's context, or calls it makes
  // (fetching an RRef argument, a nested stage) would leave the pass and lose their gradients.
  auto probe = rref::RRefContext::of(agent(0))->remote<ContextProbe>("worker1");
  DistContext ctx(agent(0));
  EXPECT_EQ(agent(0).rpcSync("worker1", kActiveContext), ctx.id()) << "a function's handler";
  EXPECT_EQ(probe.rpcSync(&ContextProbe::activeContext), ctx.id()) << "a method through an RRef (value)";
  EXPECT_EQ(probe.remote(&ContextProbe::activeContext).toHere(), ctx.id()) << "a method through an RRef (remote)";
  ctx.end();
  EXPECT_EQ(probe.rpcSync(&ContextProbe::activeContext), 0u) << "no context after it ended";
  EXPECT_TRUE(allReleased());
}

INSTANTIATE_TEST_SUITE_P(Transports, DistAutogradSmoke, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));

}  // namespace
}  // namespace distgrad::autograd::distributed
