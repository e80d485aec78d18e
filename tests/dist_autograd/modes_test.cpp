// Backward modes and passes, over inproc and tcp: a send whose result no root uses (an RPC result computed
// but left out of the loss, a remote() value never fetched) lets kExact complete with the right gradients,
// while kFast (which waits for every send) fails with a clear timeout instead of hanging, and leaves no
// worker wedged or leaking; several passes of one context accumulate with retainGraph, and a pass after the
// graph was freed fails clearly; two trainers running contexts concurrently against one shared parameter
// owner each get exactly their own batch's gradients.
#include <gtest/gtest.h>

#include <thread>

#include "dist_autograd_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::autograd::distributed::e2e {
namespace {

using SteadyTime = std::chrono::steady_clock;

class ModesTest : public DistAutogradFixture {
 protected:
  // The same forward plus a send whose result no root uses: `variant` 0 computes worker1's l1b on x by
  // RPC and drops the result; variant 1 remote()s it and never fetches the value.
  Tensor lossWithUnusedBranch(const TwoWorkerMlp& m, int variant) {
    if (variant == 0) {
      Tensor unused = agent(0).rpcSync(name(1), kLayer, std::string("l1b"), m.x);
      EXPECT_TRUE(unused.requiresGrad());
    } else {
      rref::RRef<Tensor> unused = rrefs(0)->remote(name(1), kLayer, std::string("l1b"), m.x);
      EXPECT_EQ(unused.owner(), name(1));
    }
    return twoWorkerLoss(m);
  }
};

const char* variantName(int variant) { return variant == 0 ? "unused rpc result" : "unfetched remote()"; }

TEST_P(ModesTest, UnusedBranchExactCompletesWithTheRightGradients) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  const TwoWorkerMlp m = twoWorkerMlp(1001);
  for (int variant : {0, 1}) {
    SCOPED_TRACE(variantName(variant));
    DistContext ctx(agent(0));
    Tensor loss = lossWithUnusedBranch(m, variant);
    BackwardOptions options;
    options.mode = BackwardMode::kExact;
    options.timeout = 10s;  // a hang would be a failure, not a stuck test
    ctx.backward(loss, options);
    // Exactly the used leaves: worker1's l1b got nothing.
    expectGradients(ctx, 0, m.expected);
    EXPECT_FALSE(gradientsOf(agent(1), ctx.id()).contains(layer("worker1", "l1b").weight));
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
  EXPECT_TRUE(rrefsSettled()) << rrefTables();
}

TEST_P(ModesTest, UnusedBranchFastTimesOutClearlyAndLeavesNothingWedged) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  const TwoWorkerMlp m = twoWorkerMlp(1101);
  for (int variant : {0, 1}) {
    SCOPED_TRACE(variantName(variant));
    {
      DistContext ctx(agent(0));
      Tensor loss = lossWithUnusedBranch(m, variant);
      BackwardOptions options;
      options.mode = BackwardMode::kFast;
      options.timeout = 500ms;
      const auto begin = SteadyTime::now();
      rpc::Error error = rpc::testing::errorOf([&] { ctx.backward(loss, options); });
      const auto elapsed = SteadyTime::now() - begin;
      EXPECT_EQ(error.kind, rpc::ErrorKind::kTimeout) << error.describe();
      EXPECT_FALSE(error.message.empty());
      EXPECT_GE(elapsed, 450ms);
      EXPECT_LT(elapsed, 10s) << "the 500 ms deadline was not honoured";
    }
    // Nothing is wedged: new contexts on the same workers work in both modes, and every context is released.
    expectStillWorking(m);
    EXPECT_TRUE(allReleased()) << liveCounts();
    EXPECT_TRUE(rrefsSettled()) << rrefTables();
  }
}

TEST_P(ModesTest, RetainGraphPassesAccumulateAndAFreedGraphFailsClearly) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  const TwoWorkerMlp once = twoWorkerMlp(1201);
  // The same leaves, k times the single-pass gradients.
  auto times = [&](double k) {
    std::vector<Expected> out = once.expected;
    for (Expected& e : out) e.gradient = mul(e.gradient, k);
    return out;
  };
  for (BackwardMode mode : bothModes()) {
    SCOPED_TRACE(backwardModeName(mode));
    DistContext ctx(agent(0));
    Tensor loss = twoWorkerLoss(once);
    BackwardOptions retain;
    retain.mode = mode;
    retain.retainGraph = true;
    ctx.backward(loss, retain);
    expectGradients(ctx, 0, once.expected);
    ctx.backward(loss, retain);
    expectGradients(ctx, 0, times(2.0));
    BackwardOptions last;
    last.mode = mode;
    ctx.backward(loss, last);  // frees the graph on every worker
    expectGradients(ctx, 0, times(3.0));
    try {
      ctx.backward(loss, last);
      ADD_FAILURE() << "a pass over a freed graph succeeded";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("retainGraph"), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(allReleased()) << liveCounts();
}

TEST_P(ModesTest, TwoTrainersConcurrentlyAgainstOneParameterOwner) {
  // worker0 and worker2 train against worker1's shared l1, each in its own context with its own batches;
  // both contexts are live at once on worker1 and their backward passes overlap.
  ASSERT_NO_FATAL_FAILURE(start(3));
  constexpr int kIterations = 4;
  std::vector<std::unique_ptr<rpc::testing::Event>> forwardDone;
  std::vector<std::unique_ptr<rpc::testing::Event>> checked;
  for (int i = 0; i < kIterations; ++i) {
    forwardDone.push_back(std::make_unique<rpc::testing::Event>(2));
    checked.push_back(std::make_unique<rpc::testing::Event>(2));
  }
  auto trainer = [&](int rank) {
    const std::string me = name(rank);
    Reference ref;
    const Layer& r1 = ref.layer("worker1", "l1");
    const Layer& r2 = ref.layer(me, "l2");
    const Layer& rh = ref.layer(me, "head");
    for (int it = 0; it < kIterations; ++it) {
      SCOPED_TRACE(me + " iteration " + std::to_string(it));
      const uint64_t seed = 5000 + 100 * static_cast<uint64_t>(rank) + static_cast<uint64_t>(it);
      const Tensor x = input({8, 5}, seed);
      const Tensor y = labels(8, 3, seed + 50);
      const Tensor xr = twin(x);
      const Tensor lossR = headLoss(applyLayer(applyLayer(xr, r1), r2), rh, y);
      const auto g = Reference::gradients(lossR, {xr, r1.weight, r1.bias, r2.weight, r2.bias, rh.weight, rh.bias});
      std::vector<Expected> expected = {Expected{me, "x", x, g[0]}};
      appendAll(expected, layerExpected("worker1", "l1", {g[1], g[2]}));
      appendAll(expected, layerExpected(me, "l2", {g[3], g[4]}));
      appendAll(expected, layerExpected(me, "head", {g[5], g[6]}));
      try {
        DistContext ctx(agent(rank));
        Tensor h = agent(rank).rpcSync(name(1), kLayer, std::string("l1"), x);
        Tensor loss = headLoss(applyLayer(h, layer(me, "l2")), layer(me, "head"), y);
        // Both contexts exist on worker1 before either backward starts.
        forwardDone[it]->set();
        EXPECT_TRUE(forwardDone[it]->waitFor());
        BackwardOptions options;
        options.mode = bothModes()[static_cast<size_t>(it) % 2];
        options.timeout = 20s;
        ctx.backward(loss, options);
        expectGradients(ctx, rank, expected);
        // Keep this context alive until the other trainer checked its own.
        checked[it]->set();
        EXPECT_TRUE(checked[it]->waitFor());
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        forwardDone[it]->set();
        checked[it]->set();
      }
    }
  };
  std::thread first(trainer, 0);
  std::thread second(trainer, 2);
  first.join();
  second.join();
  EXPECT_TRUE(allReleased()) << liveCounts();
}

INSTANTIATE_TEST_SUITE_P(Transports, ModesTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::autograd::distributed::e2e
