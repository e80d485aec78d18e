// CUDA storage basics. Every test skips cleanly on machines without a usable GPU (or built without CUDA).
#include <gtest/gtest.h>

#include "tensor/cuda/cuda_memory.h"
#include "tensor/tensor.h"

namespace distgrad::tensor {
namespace {

TEST(CudaStorage, ReportsAvailabilityWithoutFailing) {
  // Must never throw, also without a driver.
  EXPECT_GE(cuda::deviceCount(), 0);
  EXPECT_EQ(cuda::isAvailable(), cuda::deviceCount() > 0);
}

TEST(CudaStorage, UnavailableDeviceIsAClearError) {
  if (cuda::isAvailable()) GTEST_SKIP() << "a GPU is present";
  EXPECT_THROW(Tensor::empty({4}, DType::kFloat32, Device::cuda(0)), ValueError);
}

TEST(CudaStorage, RoundTripThroughDevice) {
  if (!cuda::isAvailable()) GTEST_SKIP() << "no CUDA device";
  Tensor host = Tensor::fromVector({1.f, 2.f, 3.f, 4.f, 5.f, 6.f}, {2, 3});
  Tensor dev = host.to(Device::cuda(0));
  EXPECT_TRUE(dev.device().isCuda());
  EXPECT_EQ(dev.shape(), host.shape());
  Tensor back = dev.to(Device::cpu());
  EXPECT_EQ(back.toVector<float>(), host.toVector<float>());
  Tensor z = Tensor::zeros({3}, DType::kFloat64, Device::cuda(0));
  EXPECT_EQ(z.toVector<double>(), std::vector<double>(3, 0.0));
}

}  // namespace
}  // namespace distgrad::tensor
