// Distributed gradients equal single-process gradients (float64, 1e-10), over inproc and tcp, in both
// backward modes: an MLP split across 2 workers, across 3 workers (a nested A→B→C chain and sequential
// hops), a branch that bounces A→B→A (the caller's handler uses the caller's own parameters), a small CNN
// whose conv stage is a RemoteModule, an MLP RemoteModule (forward and forwardRemote + toHere in one loss),
// remote() + toHere() of a registered function, an RRef handed to a third worker that fetches it,
// parameters fetched from their owner and tensors echoed back, and a non-scalar root with an explicit
// gradient. Every worker's per-context gradients are checked (the root through DistContext::gradients(),
// the others through gradientsOf), .grad stays untouched, and every worker releases the context once it
// ends (RRef tables settle too where RRefs were used). A backward rooted at a worker that did not create
// the context (backwardAsync(agent, contextId, ...)), also one that joins the context only then.
#include <gtest/gtest.h>

#include "dist_autograd_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::autograd::distributed::e2e {
namespace {

class GradientsTest : public DistAutogradFixture {};

TEST_P(GradientsTest, MlpAcrossTwoWorkers) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  // Single process: worker1's l1, then worker0's l2 and head.
  const auto& [x, y, lossR, expected] = layerChain(101, {{"worker1", "l1"}, {"worker0", "l2"}});

  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    Tensor h = agent(0).rpcSync(name(1), kLayer, std::string("l1"), x);
    EXPECT_TRUE(h.requiresGrad());
    Tensor loss = headLoss(applyLayer(h, layer("worker0", "l2")), layer("worker0", "head"), y);
    EXPECT_TRUE(allClose(loss, lossR, 1e-12)) << "forward loss";
    backward(ctx, loss, mode);
    expectGradients(ctx, 0, expected);
    // Read by a handler at the parameter owner, as a user's optimizer handler would.
    Tensor viaHandler = agent(0).rpcSync(name(1), kWeightGradient, ctx.id(), std::string("l1"));
    EXPECT_TRUE(allClose(viaHandler, expected[1].gradient)) << "worker1 l1.weight read in a handler";
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
}

TEST_P(GradientsTest, MlpAcrossThreeWorkersChain) {
  ASSERT_NO_FATAL_FAILURE(start(3));
  const auto& [x, y, lossR, expected] = layerChain(201, {{"worker1", "l1"}, {"worker2", "l2"}});

  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    // worker0 -> worker1 (l1) -> worker2 (l2), nested: worker2 never talks to worker0.
    Tensor h = agent(0).rpcSync(name(1), kChain, std::string("l1"), name(2), std::string("l2"),
                                static_cast<int64_t>(Behavior::kPlain), std::string(), x);
    Tensor loss = headLoss(h, layer("worker0", "head"), y);
    EXPECT_TRUE(allClose(loss, lossR, 1e-12)) << "forward loss";
    backward(ctx, loss, mode);
    expectGradients(ctx, 0, expected);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
}

TEST_P(GradientsTest, MlpAcrossThreeWorkersSequentialHops) {
  // The same three stages called one after the other by the root (worker0 -> worker1, worker0 -> worker2).
  ASSERT_NO_FATAL_FAILURE(start(3));
  const auto& [x, y, lossR, expected] = layerChain(251, {{"worker1", "l1"}, {"worker2", "l2"}});

  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    Tensor h1 = agent(0).rpcSync(name(1), kLayer, std::string("l1"), x);
    Tensor h2 = agent(0).rpcSync(name(2), kLayer, std::string("l2"), h1);
    Tensor loss = headLoss(h2, layer("worker0", "head"), y);
    backward(ctx, loss, mode);
    expectGradients(ctx, 0, expected);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
}

TEST_P(GradientsTest, BranchThatBouncesBackToTheCaller) {
  // worker0 -> worker1 (l1) -> worker0 (l2, in worker0's handler, on worker0's parameters) -> back on
  // worker1 (l3, in the handler's continuation) -> worker0 (head and loss).
  ASSERT_NO_FATAL_FAILURE(start(2));
  const auto& [x, y, lossR, expected] = layerChain(301, {{"worker1", "l1"}, {"worker0", "l2"}, {"worker1", "l3"}});

  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    Tensor h = agent(0).rpcSync(name(1), kChain, std::string("l1"), name(0), std::string("l2"),
                                static_cast<int64_t>(Behavior::kPlain), std::string("l3"), x);
    Tensor loss = headLoss(h, layer("worker0", "head"), y);
    EXPECT_TRUE(allClose(loss, lossR, 1e-12)) << "forward loss";
    backward(ctx, loss, mode);
    expectGradients(ctx, 0, expected);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
}

TEST_P(GradientsTest, CnnWithItsConvStageARemoteModule) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  constexpr uint64_t kSeed = 21;
  const Tensor x = input({4, 2, 6, 6}, 401);
  const Tensor y = labels(4, 3, 402);

  ConvStage local(kSeed);
  Reference ref;
  const Layer& rh = ref.layer("worker0", "cnn_head");
  const Tensor xr = twin(x);
  const Tensor lossR = headLoss(local.forward(xr), rh, y);
  const std::vector<Tensor> localParams = local.parameters();
  ASSERT_EQ(localParams.size(), 2u);  // conv.weight, conv.bias
  const auto g = Reference::gradients(lossR, {xr, localParams[0], localParams[1], rh.weight, rh.bias});

  auto conv = rref::RemoteModule<ConvStage>::create(agent(0), name(1), kSeed);
  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    Tensor features = conv.forward(x);
    EXPECT_EQ(features.shape(), (Shape{4, 12}));
    Tensor loss = headLoss(features, layer("worker0", "cnn_head"), y);
    EXPECT_TRUE(allClose(loss, lossR, 1e-12)) << "forward loss";
    backward(ctx, loss, mode);

    // The module exists at its owner once forward returned.
    const std::vector<Tensor> remoteParams = world_.module(kSeed)->parameters();
    ASSERT_EQ(remoteParams.size(), 2u);
    std::vector<Expected> expected = {Expected{"worker0", "x", x, g[0]},
                                      Expected{"worker1", "conv.weight", remoteParams[0], g[1]},
                                      Expected{"worker1", "conv.bias", remoteParams[1], g[2]}};
    appendAll(expected, layerExpected("worker0", "cnn_head", {g[3], g[4]}));
    expectGradients(ctx, 0, expected);
  }
  conv = {};
  EXPECT_TRUE(allReleased()) << liveCounts();
  EXPECT_TRUE(rrefsSettled()) << rrefTables();
}

TEST_P(GradientsTest, MlpRemoteModuleForwardAndForwardRemote) {
  // One loss over two uses of one RemoteModule: forward (result by value) and forwardRemote + toHere
  // (result kept at the owner, fetched inside the context). The owner's gradients add up both paths.
  ASSERT_NO_FATAL_FAILURE(start(2));
  constexpr uint64_t kSeed = 31;
  const Tensor x = input({8, 5}, 501);
  const Tensor y1 = labels(8, 3, 502);
  const Tensor y2 = labels(8, 3, 503);

  MlpStage local(kSeed);
  Reference ref;
  const Layer& rh = ref.layer("worker0", "head");
  const Tensor xr = twin(x);
  const Tensor lossR = add(headLoss(local.forward(xr), rh, y1), headLoss(local.forward(xr), rh, y2));
  std::vector<Tensor> leaves = {xr, rh.weight, rh.bias};
  const std::vector<Tensor> localParams = local.parameters();
  ASSERT_EQ(localParams.size(), 4u);
  for (const Tensor& p : localParams) leaves.push_back(p);
  const auto g = Reference::gradients(lossR, leaves);

  auto mlp = rref::RemoteModule<MlpStage>::create(agent(0), name(1), kSeed);
  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    Tensor h1 = mlp.forward(x);
    Tensor h2 = mlp.forwardRemote(x).toHere();
    EXPECT_TRUE(h2.requiresGrad());
    Tensor loss = add(headLoss(h1, layer("worker0", "head"), y1), headLoss(h2, layer("worker0", "head"), y2));
    EXPECT_TRUE(allClose(loss, lossR, 1e-12)) << "forward loss";
    backward(ctx, loss, mode);

    const std::vector<Tensor> remoteParams = world_.module(kSeed)->parameters();
    ASSERT_EQ(remoteParams.size(), 4u);
    std::vector<Expected> expected = {Expected{"worker0", "x", x, g[0]}};
    appendAll(expected, layerExpected("worker0", "head", {g[1], g[2]}));
    for (size_t i = 0; i < remoteParams.size(); ++i) {
      expected.push_back(Expected{"worker1", "mlp parameter " + std::to_string(i), remoteParams[i], g[3 + i]});
    }
    expectGradients(ctx, 0, expected);
  }
  mlp = {};
  EXPECT_TRUE(allReleased()) << liveCounts();
  EXPECT_TRUE(rrefsSettled()) << rrefTables();
}

TEST_P(GradientsTest, ThroughRemoteAndToHereOfAFunction) {
  // remote() a stage with a grad-requiring argument (the value stays at worker1), toHere() inside the same
  // context, loss here: the gradient reaches worker1's parameters and the caller's input leaf.
  ASSERT_NO_FATAL_FAILURE(start(2));
  const auto& [x, y, lossR, expected] = layerChain(601, {{"worker1", "l1"}, {"worker0", "l2"}});

  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    rref::RRef<Tensor> h = rrefs(0)->remote(name(1), kLayer, std::string("l1"), x);
    EXPECT_EQ(h.owner(), name(1));
    Tensor fetched = h.toHere();
    EXPECT_TRUE(fetched.requiresGrad());
    Tensor loss = headLoss(applyLayer(fetched, layer("worker0", "l2")), layer("worker0", "head"), y);
    EXPECT_TRUE(allClose(loss, lossR, 1e-12)) << "forward loss";
    backward(ctx, loss, mode);
    expectGradients(ctx, 0, expected);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
  EXPECT_TRUE(rrefsSettled()) << rrefTables();
}

TEST_P(GradientsTest, ParametersFetchedFromTheirOwnerAndTensorsEchoedBack) {
  // Parameter-server style: worker0 fetches worker1's l1 weight and bias (the leaves themselves are sent),
  // and uses them locally; worker1 also echoes x back unchanged and multiplies x by itself (one tensor
  // sent twice in one call).
  ASSERT_NO_FATAL_FAILURE(start(2));
  const Tensor x = input({8, 5}, 651);
  const Tensor y = labels(8, 3, 652);

  Reference ref;
  const Layer& r1 = ref.layer("worker1", "l1");
  const Layer& r2 = ref.layer("worker0", "l2");
  const Layer& rh = ref.layer("worker0", "head");
  const Tensor xr = twin(x);
  auto lossOf = [&](const Tensor& in, const Layer& first, const Layer& second, const Layer& head, const Tensor& echoed,
                    const Tensor& squared) {
    return add(headLoss(applyLayer(applyLayer(in, first), second), head, y), mul(sum(mul(echoed, squared)), 0.25));
  };
  const Tensor lossR = lossOf(xr, r1, r2, rh, xr, mul(xr, xr));
  const auto g = Reference::gradients(lossR, {xr, r1.weight, r1.bias, r2.weight, r2.bias, rh.weight, rh.bias});

  std::vector<Expected> expected = {Expected{"worker0", "x", x, g[0]}};
  appendAll(expected, layerExpected("worker1", "l1", {g[1], g[2]}));
  appendAll(expected, layerExpected("worker0", "l2", {g[3], g[4]}));
  appendAll(expected, layerExpected("worker0", "head", {g[5], g[6]}));

  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    Layer fetched{agent(0).rpcSync(name(1), kParameter, std::string("l1"), false),
                  agent(0).rpcSync(name(1), kParameter, std::string("l1"), true)};
    EXPECT_TRUE(fetched.weight.requiresGrad());
    Tensor echoed = agent(0).rpcSync(name(1), kIdentity, x);
    Tensor squared = agent(0).rpcSync(name(1), kProduct, x, x);
    Tensor loss = lossOf(x, fetched, layer("worker0", "l2"), layer("worker0", "head"), echoed, squared);
    EXPECT_TRUE(allClose(loss, lossR, 1e-12)) << "forward loss";
    backward(ctx, loss, mode);
    expectGradients(ctx, 0, expected);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
}

TEST_P(GradientsTest, ThroughAnRRefFetchedByAThirdWorker) {
  // worker0 remote()s l1 on worker1 (the value stays there), hands the RRef to worker2, whose handler
  // fetches it (toHereAsync inside the context) and applies its l2; the loss is on worker0.
  ASSERT_NO_FATAL_FAILURE(start(3));
  const auto& [x, y, lossR, expected] = layerChain(661, {{"worker1", "l1"}, {"worker2", "l2"}});

  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    rref::RRef<Tensor> r = rrefs(0)->remote(name(1), kLayer, std::string("l1"), x);
    Tensor h = agent(0).rpcSync(name(2), kConsumeRef, std::string("l2"), r);
    Tensor loss = headLoss(h, layer("worker0", "head"), y);
    EXPECT_TRUE(allClose(loss, lossR, 1e-12)) << "forward loss";
    backward(ctx, loss, mode);
    expectGradients(ctx, 0, expected);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
  EXPECT_TRUE(rrefsSettled()) << rrefTables();
}

TEST_P(GradientsTest, NonScalarRootWithAnExplicitGradient) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  const Tensor x = input({8, 5}, 701);
  const Tensor seed = input({8, 6}, 702, /*requiresGrad=*/false);

  Reference ref;
  const Layer& r1 = ref.layer("worker1", "l1");
  const Layer& r2 = ref.layer("worker0", "l2");
  const Tensor xr = twin(x);
  const Tensor outR = applyLayer(applyLayer(xr, r1), r2);
  const auto g = autograd::grad({outR}, {xr, r1.weight, r1.bias, r2.weight, r2.bias}, {seed});

  std::vector<Expected> expected = {Expected{"worker0", "x", x, g[0]}};
  appendAll(expected, layerExpected("worker1", "l1", {g[1], g[2]}));
  appendAll(expected, layerExpected("worker0", "l2", {g[3], g[4]}));

  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    Tensor h = agent(0).rpcSync(name(1), kLayer, std::string("l1"), x);
    Tensor out = applyLayer(h, layer("worker0", "l2"));
    BackwardOptions options;
    options.mode = mode;
    ctx.backward({out}, options, {seed});
    expectGradients(ctx, 0, expected);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
}

// A loss computed in a handler on the worker it runs on, its backward rooted there
// (backwardAsync(agent, contextId, ...)) in the caller's context: what a pipeline's last stage does
// (Note [Loss on the last stage] in models/pipeline/rpc_pipeline.cpp). Answers the loss once the backward has
// finished on every worker.
inline const rpc::Function<double(std::string, std::string, int64_t, Tensor, Tensor)> kLossHere{"e2e.loss_here"};

class RootElsewhereTest : public DistAutogradFixture {
 protected:
  void bindExtra(rpc::Registry& reg) override {
    reg.bind(kLossHere, [this](const rpc::CallContext& ctx, std::string key, std::string headKey, int64_t mode,
                               Tensor h, Tensor y) -> rpc::Future<double> {
      Tensor loss = headLoss(applyLayer(h, world_.layer(ctx.callee, key)), world_.layer(ctx.callee, headKey), y);
      BackwardOptions options;
      options.mode = static_cast<BackwardMode>(mode);
      return backwardAsync(*ctx.agent, ctx.autogradContext, {loss}, options).then([value = loss.item()] {
        return value;
      });
    });
  }
};

TEST_P(RootElsewhereTest, BackwardRootedAtAWorkerThatDidNotCreateTheContext) {
  ASSERT_NO_FATAL_FAILURE(start(3));
  // x (worker0) -> worker1's l1 -> worker2's l2 and head, the loss on worker2; worker0 created the context.
  const Tensor x = input({8, 5}, 601);
  const Tensor y = labels(8, 3, 602);
  Reference ref;
  const Tensor xr = twin(x);
  const Layer& r1 = ref.layer("worker1", "l1");
  const Layer& r2 = ref.layer("worker2", "l2");
  const Layer& rh = ref.layer("worker2", "head");
  const Tensor lossR = headLoss(applyLayer(applyLayer(xr, r1), r2), rh, y);
  const double lossValue = lossR.item();
  const auto g = Reference::gradients(lossR, {xr, r1.weight, r1.bias, r2.weight, r2.bias, rh.weight, rh.bias});
  std::vector<Expected> expected{Expected{"worker0", "x", x, g[0]}};
  appendAll(expected, layerExpected("worker1", "l1", {g[1], g[2]}));
  appendAll(expected, layerExpected("worker2", "l2", {g[3], g[4]}));
  appendAll(expected, layerExpected("worker2", "head", {g[5], g[6]}));
  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    Tensor h = agent(0).rpcSync(name(1), kLayer, std::string("l1"), x);
    const double loss =
        agent(0).rpcSync(name(2), kLossHere, std::string("l2"), std::string("head"), static_cast<int64_t>(mode), h, y);
    EXPECT_NEAR(loss, lossValue, 1e-12);
    expectGradients(ctx, 0, expected);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();

  // worker2's call carries no tensor that requires grad, so only the backward makes it join the context:
  // its own parameters get their gradients there, and the creator's end releases it there too.
  const Tensor plain = input({8, 5}, 603, /*requiresGrad=*/false);
  const Layer& p1 = ref.layer("worker2", "l1");
  const Layer& ph = ref.layer("worker2", "head7");
  const Tensor plainLoss = headLoss(applyLayer(plain, p1), ph, y);
  const auto pg = Reference::gradients(plainLoss, {p1.weight, p1.bias, ph.weight, ph.bias});
  std::vector<Expected> own = layerExpected("worker2", "l1", {pg[0], pg[1]});
  appendAll(own, layerExpected("worker2", "head7", {pg[2], pg[3]}));
  uint64_t ended = 0;
  {
    DistContext ctx(agent(0));
    ended = ctx.id();
    const double loss = agent(0).rpcSync(name(2), kLossHere, std::string("l1"), std::string("head7"),
                                         static_cast<int64_t>(BackwardMode::kExact), plain, y);
    EXPECT_NEAR(loss, plainLoss.item(), 1e-12);
    expectGradients(ctx, 0, own);
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
  // A released context cannot be backwarded again, and nothing is joined by trying.
  EXPECT_THROW((void)backwardAsync(agent(2), ended, {sum(layer("worker2", "l1").weight)}), ValueError);
  EXPECT_EQ(liveContexts(agent(2)), 0u);
}

INSTANTIATE_TEST_SUITE_P(Transports, RootElsewhereTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(Transports, GradientsTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::autograd::distributed::e2e
