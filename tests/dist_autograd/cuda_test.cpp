// Distributed autograd with CUDA tensors (docs/cuda.md, "CUDA over RPC"): a stage on another worker
// computing on its GPU, the activations sent with a device map and the result returned through its
// inverse; the gradients flow back along the recorded edges through the inverse of each forward message's
// map and accumulate in the context on the leaves' devices. Compared with the same model computed on the
// CPU in one process. Skips without a GPU.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "../rpc/agent_test_util.h"
#include "autograd/distributed/dist_autograd.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "rpc/device_map.h"
#include "rref/rref.h"
#include "tensor/cuda/runtime.h"
#include "tensor/random.h"
#include "tests/transport_params.h"

namespace distgrad::autograd::distributed {
namespace {

using tensor::Device;

const rpc::Function<Tensor(Tensor)> kGpuStage{"cuda_autograd.stage"};  // tanh(x @ W_callee) on the callee's GPU

class DistAutogradCuda : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device";
    tensor::Generator gen(11);
    cpuWeight0_ = tensor::uniform({4, 5}, -1.0, 1.0, gen, DType::kFloat64);
    cpuWeight1_ = tensor::uniform({5, 3}, -1.0, 1.0, gen, DType::kFloat64);
    cpuInput_ = tensor::uniform({2, 4}, -1.0, 1.0, gen, DType::kFloat64);
    weight0_ = cpuWeight0_.to(Device::cuda(0)).setRequiresGrad();
    weight1_ = cpuWeight1_.to(Device::cuda(0)).setRequiresGrad();
    install(registry_);
    rref::RRefContext::install(registry_);
    registry_.bind(kGpuStage, [this](Tensor x) {
      EXPECT_TRUE(x.device().isCuda()) << "the activation arrived on " << x.device().str();
      return tanh(matmul(x, weight1_));
    });
    rpc::testing::ClusterSpec spec;
    spec.transport = GetParam();
    spec.size = 2;
    // Only worker0 maps; worker1 answers through the inverse (reply) and sends gradients back through the
    // inverse of the forward message's map.
    spec.customize = [](int rank, rpc::Options& options) {
      if (rank == 0) options.setDeviceMap("worker1", rpc::DeviceMap{{Device::cuda(0), Device::cuda(0)}});
    };
    rpc::testing::startCluster(cluster_, spec, world_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) ASSERT_FALSE(cluster_.errors[i]) << "rank " << i;
  }
  rpc::Agent& agent(int rank) { return *cluster_.agents.at(rank); }

  Tensor cpuWeight0_, cpuWeight1_, cpuInput_;
  Tensor weight0_, weight1_;
  rpc::testing::World world_;
  rpc::Registry registry_;
  rpc::testing::Cluster cluster_;
};

// float64 on both devices: the only differences are summation orders inside matmul.
void expectClose(const Tensor& actual, const Tensor& expected, const char* what) {
  ASSERT_TRUE(actual.defined()) << what;
  EXPECT_TRUE(actual.device().isCuda()) << what << " is on " << actual.device().str();
  ASSERT_EQ(actual.shape(), expected.shape()) << what;
  auto a = actual.to(Device::cpu()).toVector<double>();
  auto e = expected.toVector<double>();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], e[i], 1e-10) << what << " element " << i;
}

TEST_P(DistAutogradCuda, GradientsMatchASingleProcessCpuReference) {
  for (auto mode : {BackwardMode::kExact, BackwardMode::kFast}) {
    Tensor x = cpuInput_.to(Device::cuda(0)).setRequiresGrad();
    Gradients root, remote;
    {
      DistContext ctx(agent(0));
      Tensor h = agent(0).rpcSync("worker1", kGpuStage, tanh(matmul(x, weight0_)));
      ASSERT_TRUE(h.device().isCuda());
      Tensor loss = sum(h * h);
      BackwardOptions options;
      options.mode = mode;
      ctx.backward(loss, options);
      root = ctx.gradients();
      remote = gradientsOf(agent(1), ctx.id());
    }
    Tensor cx = cpuInput_.detach().setRequiresGrad();
    Tensor cw0 = cpuWeight0_.detach().setRequiresGrad();
    Tensor cw1 = cpuWeight1_.detach().setRequiresGrad();
    Tensor ch = tanh(matmul(tanh(matmul(cx, cw0)), cw1));
    auto reference = grad({sum(ch * ch)}, {cx, cw0, cw1});
    expectClose(root.get(x), reference[0], "d loss / d x");
    expectClose(root.get(weight0_), reference[1], "d loss / d W0");
    expectClose(remote.get(weight1_), reference[2], "d loss / d W1 (on worker1)");
    EXPECT_FALSE(weight0_.grad().defined());
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, DistAutogradCuda, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::autograd::distributed
