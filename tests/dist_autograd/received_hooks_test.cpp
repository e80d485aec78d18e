// Hooks on a tensor received through an RPC inside a distributed autograd context run in the distributed
// backward exactly as hooks on a local tensor do (the RecvBackward node runs its hooks before its gradients
// go back to the sender). Found by examples/rnn_model_parallel.cpp, whose trainer hooked a received tensor.
#include <gtest/gtest.h>

#include <atomic>

#include "../rpc/agent_test_util.h"
#include "autograd/distributed/dist_autograd.h"
#include "autograd/ops.h"
#include "tensor/random.h"
#include "tests/transport_params.h"

namespace distgrad::autograd::distributed {
namespace {

const rpc::Function<Tensor(Tensor)> kDouble{"received_hooks.double"};

class ReceivedTensorHooks : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    install(registry_);
    registry_.bind(kDouble, [](Tensor x) { return x * 2.0; });
    rpc::testing::ClusterSpec spec;
    spec.transport = GetParam();
    spec.size = 2;
    rpc::testing::startCluster(cluster_, spec, world_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) ASSERT_FALSE(cluster_.errors[i]) << "rank " << i;
  }
  rpc::Agent& agent(int rank) { return *cluster_.agents.at(rank); }

  rpc::testing::World world_;
  rpc::Registry registry_;
  rpc::testing::Cluster cluster_;
};

TEST_P(ReceivedTensorHooks, HooksOnAReceivedTensorRun) {
  tensor::Generator gen(1);
  Tensor x = tensor::uniform({3}, -1.0, 1.0, gen, DType::kFloat64).setRequiresGrad();
  std::atomic<int> receivedHook{0}, localHook{0};
  Tensor seen;
  {
    DistContext ctx(agent(0));
    Tensor h = x * 3.0;                                  // local
    Tensor y = agent(0).rpcSync("worker1", kDouble, h);  // received: its grad_fn is a RecvBackward
    y.registerHook([&](const Tensor& g) {
      ++receivedHook;
      seen = g;
      return g;
    });
    h.registerHook([&](const Tensor& g) {
      ++localHook;
      return g;
    });
    ctx.backward(sum(y * y));
    EXPECT_EQ(localHook.load(), 1);     // passes: hooks on local tensors run
    EXPECT_EQ(receivedHook.load(), 1);  // fails: the received tensor's hook never runs
    if (seen.defined()) {
      // d(sum y^2)/dy = 2y
      auto g = seen.toVector<double>();
      auto v = y.toVector<double>();
      for (size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], 2 * v[i], 1e-12);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, ReceivedTensorHooks, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));

}  // namespace
}  // namespace distgrad::autograd::distributed
