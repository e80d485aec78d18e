// Tracing of the layers above rpc/ (docs/tracing.md), two workers over inproc and tcp with a trace
// directory: a fetch of an RRef whose value is not there yet is an rref.wait span at the owner; a
// distributed backward records every node it runs (named by the node, with the context id) and the
// gradients sent back (autograd.send_gradients) and received (autograd.recv_gradients, same context and
// message); a DistributedOptimizer step records optim.step on the owner of the parameters.
#include "rpc/trace.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "autograd/ops.h"
#include "models/nn/linear.h"
#include "models/optim/distributed_optimizer.h"
#include "rref/remote_module.h"
#include "tensor/random.h"
#include "tests/rpc/trace_test_util.h"
#include "tests/rref/rref_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::trace_test {
namespace {

// A Linear stage (float64) served as a RemoteModule; a type of this test only (its own class name).
class Stage : public models::Module {
 public:
  Stage(int64_t in, int64_t out, uint64_t seed) : Module("Stage") {
    tensor::Generator gen(seed);
    linear_ = registerModule("linear", std::make_shared<models::Linear>(in, out, gen));
    toDType(DType::kFloat64);
  }
  Tensor forward(const Tensor& x) override { return linear_->forward(x); }

 private:
  std::shared_ptr<models::Linear> linear_;
};

const rpc::Class<Stage>& stageClass() {
  static const rpc::Class<Stage> cls = rref::moduleClass<Stage>("trace_test.Stage");
  return cls;
}

}  // namespace
}  // namespace distgrad::trace_test

DG_REMOTE_MODULE(distgrad::trace_test::Stage, distgrad::trace_test::stageClass());

namespace distgrad::trace_test {
namespace {

using tools::FlatObject;
using trace::testing::named;
using trace::testing::readTrace;
using trace::testing::TempDir;
using trace::testing::TraceFile;

// Opens the gate of rref::testing::kGated on the callee.
inline const rpc::Function<int64_t()> kOpenGate{"trace_test.open_gate"};

class LayerTraceTest : public rref::testing::RRefFixture {
 protected:
  void startTraced(const std::string& dir) {
    rpc::testing::ClusterSpec spec;
    spec.transport = GetParam();
    spec.size = 2;
    spec.traceDir = dir;
    // One executor thread: calls from one peer run in the order they arrived (see the test).
    spec.executorThreads = 1;
    registry_ = rref::testing::makeRegistry(world_);
    autograd::distributed::install(registry_);
    models::optim::DistributedOptimizer::install(registry_);
    rref::bindRemoteModule(registry_, stageClass())
        .factory<int64_t, int64_t, uint64_t>(
            [](int64_t in, int64_t out, uint64_t seed) { return std::make_shared<Stage>(in, out, seed); });
    registry_.bind(kOpenGate, [this] {
      std::lock_guard<std::mutex> lock(world_.mutex);
      world_.gate->setValue(1);
      world_.gate.reset();
      return int64_t{0};
    });
    rpc::testing::startCluster(cluster_, spec, rpcWorld_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) ASSERT_FALSE(cluster_.errors[i]) << "rank " << i;
    std::lock_guard<std::mutex> lock(world_.mutex);
    for (auto& agent : cluster_.agents) world_.agents[agent->name()] = agent.get();
  }
  void shutdownAll() {
    std::vector<std::thread> threads;
    for (auto& a : cluster_.agents) threads.emplace_back([&a] { a->shutdown(); });
    for (auto& t : threads) t.join();
  }
};

Tensor data(const Shape& shape, uint64_t seed) {
  tensor::Generator gen(seed);
  return tensor::uniform(shape, -1.0, 1.0, gen, DType::kFloat64);
}

TEST_P(LayerTraceTest, RRefWaitsBackwardNodesGradientsAndOptimizerStepsAreTraced) {
  TempDir dir;
  startTraced(dir.path());
  // An RRef whose value waits at its owner (gated) while worker0 fetches it: the fetch is queued there.
  {
    rref::RRef<int64_t> seed = rrefs(0)->remote(name(1), rref::testing::kGated, int64_t{1});
    ASSERT_TRUE(world_.gateEntered.waitFor());
    // With an explicit timeout toHere fetches at once (without one it would wait for the creation
    // answer, which carries the value: docs/rref_protocol.md, Note [Value in creation reply]).
    auto pending = seed.toHereAsync(std::chrono::milliseconds(60000));
    // The gate opens by a call sent after the fetch on the same link: worker1's single executor thread runs
    // the fetch first (it finds no value and is queued by whenResolved), then opens the gate.
    EXPECT_EQ(agent(0).rpcSync(name(1), kOpenGate), 0);
    EXPECT_EQ(pending.get(), 2);
  }
  // One distributed step: forward through worker1's stage, backward, optimizer step on worker1.
  uint64_t contextId = 0;
  {
    auto stage = rref::RemoteModule<Stage>::create(rrefs(0), name(1), int64_t{4}, int64_t{3}, uint64_t{7});
    models::optim::DistributedOptimizer opt(agent(0), models::optim::OptimizerSpec::sgd({.learningRate = 0.1}),
                                            stage.remoteParameters(), {});
    autograd::distributed::DistContext ctx(agent(0));
    contextId = ctx.id();
    Tensor loss = mseLoss(stage.forward(data({5, 4}, 1)), data({5, 3}, 2));
    ctx.backward({loss});
    opt.step(ctx);
  }
  EXPECT_TRUE(allSettled()) << tables();
  shutdownAll();

  const TraceFile w0 = readTrace(dir.path() + "/worker0.trace.jsonl");
  const TraceFile w1 = readTrace(dir.path() + "/worker1.trace.jsonl");
  ASSERT_TRUE(w0.end && w1.end);

  const auto waits = named(w1, "rref.wait");
  ASSERT_EQ(waits.size(), 1u) << "the fetch of the gated value waited at its owner";
  EXPECT_EQ(waits[0]->string("type"), "async");
  EXPECT_EQ(waits[0]->string("cat"), "rref");
  EXPECT_EQ(waits[0]->integer("a0"), 1) << "the owner's rank";
  EXPECT_LT(*waits[0]->integer("b"), *waits[0]->integer("e"));
  EXPECT_TRUE(named(w0, "rref.wait").empty());

  // Gradients leave worker0 (its RecvBackward for worker1's reply) and arrive at worker1 for the same
  // context and message.
  const auto sent = named(w0, "autograd.send_gradients");
  const auto received = named(w1, "autograd.recv_gradients");
  ASSERT_EQ(sent.size(), 1u);
  ASSERT_EQ(received.size(), 1u);
  EXPECT_EQ(sent[0]->integer("a0"), static_cast<int64_t>(contextId));
  EXPECT_EQ(received[0]->integer("a0"), static_cast<int64_t>(contextId));
  EXPECT_EQ(received[0]->integer("a1"), sent[0]->integer("a1"));
  EXPECT_EQ(sent[0]->integer("a2"), 5 * 3 * 8) << "the gradient of a [5, 3] float64 output";
  EXPECT_EQ(received[0]->integer("a2"), sent[0]->integer("a2"));
  // The propagation is an RPC like any other.
  EXPECT_EQ(named(w1, "rpc.server.execute").size() >= 1, true);
  bool propagated = false;
  for (const FlatObject* e : named(w1, "rpc.server.execute"))
    propagated |= e->string("detail") == "dg.autograd.propagate";
  EXPECT_TRUE(propagated);

  // Every node worker1 ran in the pass is a span of category autograd carrying the context id; worker1
  // ran the Linear's backward (a matmul and an addition at least).
  size_t nodes = 0;
  for (const TraceFile* file : {&w0, &w1}) {
    for (const auto& e : file->events) {
      if (e.string("cat") != "autograd" || e.string("type") != "span") continue;
      EXPECT_EQ(e.integer("a0"), static_cast<int64_t>(contextId)) << *e.string("name");
      EXPECT_TRUE(e.has("a1")) << "the pass id";
      if (file == &w1) ++nodes;
    }
  }
  EXPECT_GE(nodes, 2u);

  const auto steps = named(w1, "optim.step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]->string("cat"), "optimizer");
  EXPECT_EQ(steps[0]->integer("a0"), 2) << "weight and bias had gradients";
  EXPECT_TRUE(named(w0, "optim.step").empty()) << "worker0 owns no parameter";
}

INSTANTIATE_TEST_SUITE_P(Transports, LayerTraceTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::trace_test
