// RRefs of CUDA tensors (docs/cuda.md, "CUDA over RPC"): a remote() whose value is a CUDA tensor stays on
// the owner's device; toHere() brings it back onto the caller's device through the inverse of the caller's
// device map; a CUDA argument of remote() lands on the owner's mapped device. Skips without a GPU.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../rpc/agent_test_util.h"
#include "rpc/device_map.h"
#include "rref/rref.h"
#include "tensor/cuda/runtime.h"
#include "tests/transport_params.h"

namespace distgrad::rref {
namespace {

using tensor::Device;

const rpc::Function<Tensor(int64_t)> kArange{"cuda_rref.arange"};       // 0..n-1 (float32) on cuda:0
const rpc::Function<Tensor(Tensor)> kTwice{"cuda_rref.twice"};          // its argument (on its device) twice
const rpc::Function<int64_t(Tensor)> kDeviceIndex{"cuda_rref.device"};  // -1 for CPU

class CudaRRefTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device";
    RRefContext::install(registry_);
    registry_.bind(kArange, [](int64_t n) {
      std::vector<float> v(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(i);
      return Tensor::fromVector(v, {n}).to(Device::cuda(0));
    });
    registry_.bind(kTwice, [](Tensor t) { return t + t; });
    registry_.bind(kDeviceIndex, [](Tensor t) -> int64_t { return t.device().isCuda() ? t.device().index : -1; });
    rpc::testing::ClusterSpec spec;
    spec.transport = GetParam();
    spec.size = 2;
    spec.customize = [](int rank, rpc::Options& options) {
      if (rank == 0) options.setDeviceMap("worker1", rpc::DeviceMap{{Device::cuda(0), Device::cuda(0)}});
    };
    rpc::testing::startCluster(cluster_, spec, world_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) ASSERT_FALSE(cluster_.errors[i]) << "rank " << i;
  }
  std::shared_ptr<RRefContext> rrefs(int rank) { return RRefContext::of(*cluster_.agents.at(rank)); }

  rpc::testing::World world_;
  rpc::Registry registry_;
  rpc::testing::Cluster cluster_;
};

TEST_P(CudaRRefTest, ToHereLandsOnTheCallersDevice) {
  constexpr int64_t n = 3 * 1024 * 1024 + 1;  // several staging chunks
  RRef<Tensor> r = rrefs(0)->remote("worker1", kArange, n);
  Tensor here = r.toHere();
  ASSERT_TRUE(here.device().isCuda());
  EXPECT_EQ(here.device().index, 0);
  auto values = here.to(Device::cpu()).toVector<float>();
  ASSERT_EQ(values.size(), static_cast<size_t>(n));
  for (int64_t i = 0; i < n; i += 4099) EXPECT_EQ(values[static_cast<size_t>(i)], static_cast<float>(i));
  EXPECT_EQ(values.back(), static_cast<float>(n - 1));
}

TEST_P(CudaRRefTest, CudaArgumentsOfRemoteLandOnTheMappedDevice) {
  const Tensor x = Tensor::fromVector({1.5f, -2.0f, 4.0f}, {3}).to(Device::cuda(0));
  RRef<int64_t> device = rrefs(0)->remote("worker1", kDeviceIndex, x);
  EXPECT_EQ(device.toHere(), 0);
  RRef<Tensor> twice = rrefs(0)->remote("worker1", kTwice, x);
  Tensor back = twice.toHere();
  ASSERT_TRUE(back.device().isCuda());
  EXPECT_EQ(back.to(Device::cpu()).toVector<float>(), (std::vector<float>{3.0f, -4.0f, 8.0f}));
}

INSTANTIATE_TEST_SUITE_P(Transports, CudaRRefTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::rref
