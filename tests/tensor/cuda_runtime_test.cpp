// CUDA runtime pieces (tensor/cuda/runtime.h): without a GPU every device-needing call is a clear
// ValueError; with one, guards restore state and events order streams. GPU cases skip without a GPU.
#include <gtest/gtest.h>

#include "tensor/cuda/runtime.h"
#include "tensor/error.h"
#include "tensor/tensor.h"

namespace distgrad::tensor::cuda {
namespace {

TEST(CudaRuntime, WithoutAGpuEveryDeviceCallIsAClearError) {
  if (isAvailable()) GTEST_SKIP() << "a GPU is present";
  EXPECT_THROW(DeviceGuard{0}, ValueError);
  EXPECT_THROW(Stream::current(0), ValueError);
  EXPECT_THROW(Stream::fromPool(0), ValueError);
  EXPECT_THROW(synchronizeDevice(0), ValueError);
  try {
    requireDevice(0, "test");
    FAIL() << "requireDevice(0) did not throw";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("test"), std::string::npos) << e.what();
  }
  Event never;
  EXPECT_FALSE(never.recorded());
  EXPECT_TRUE(never.query());  // nothing recorded: nothing to wait for
}

TEST(CudaRuntime, NegativeAndOutOfRangeDevicesAreRejected) {
  EXPECT_THROW(requireDevice(-1, "test"), ValueError);
  EXPECT_THROW(requireDevice(deviceCount(), "test"), ValueError);
}

TEST(CudaRuntime, StreamGuardSetsAndRestoresTheCurrentStream) {
  if (!isAvailable()) GTEST_SKIP() << "no CUDA device";
  Stream before = Stream::current(0);
  EXPECT_TRUE(before.isDefault());
  Stream pooled = Stream::fromPool(0);
  EXPECT_FALSE(pooled.isDefault());
  {
    StreamGuard guard(pooled);
    EXPECT_EQ(Stream::current(0), pooled);
  }
  EXPECT_EQ(Stream::current(0), before);
}

TEST(CudaRuntime, AnEventOrdersWorkAcrossStreams) {
  if (!isAvailable()) GTEST_SKIP() << "no CUDA device";
  Tensor host = Tensor::fromVector(std::vector<float>(1 << 20, 3.f), {1 << 20});
  Tensor dev = host.to(Device::cuda(0));
  Event timingStart(true), timingEnd(true), done;
  Stream a = Stream::fromPool(0), b = Stream::fromPool(0);
  timingStart.record(a);
  timingEnd.record(a);
  done.record(a);
  done.block(b);
  b.synchronize();
  EXPECT_TRUE(done.query());
  EXPECT_GE(timingStart.elapsedMs(timingEnd), 0.f);
  EXPECT_THROW(done.elapsedMs(timingEnd), ValueError);  // created without timing
  EXPECT_EQ(dev.to(Device::cpu()).toVector<float>(), host.toVector<float>());
}

}  // namespace
}  // namespace distgrad::tensor::cuda
