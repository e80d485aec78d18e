// Autograd on CUDA tensors: every differentiable elementwise, reduction and layout op's values and
// gradients on the device against the CPU (cuda_test_util.h), the engine's CUDA handling (accumulation
// into .grad, zero-filled gradients on the right device, Note [Backward streams]), and device errors
// that run without a GPU.
#include <gtest/gtest.h>

#include <vector>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "tensor/cuda/runtime.h"
#include "tests/tensor/cuda_test_util.h"

namespace distgrad {
namespace {

using cuda_testing::cudaCopyOf;
using cuda_testing::expectCudaGradsMatchCpu;
using cuda_testing::expectValueErrorMentions;
using cuda_testing::kExact;
using cuda_testing::randomTensor;
using cuda_testing::tensorsClose;
using cuda_testing::Tolerance;
using Inputs = std::vector<Tensor>;
using Outputs = std::vector<Tensor>;

// float64 everywhere: the comparisons then test the formulas, not float32 rounding.
constexpr Tolerance kTol{1e-10, 1e-12};

Tensor leafOf(const Shape& shape, uint64_t seed) {
  Tensor t = randomTensor(shape, seed, DType::kFloat64);
  t.setRequiresGrad(true);
  return t;
}

TEST(CudaAutograd, MixingDevicesInADifferentiableOpIsAClearError) {
  static std::vector<double> backing(64);
  Tensor fake = Tensor::fromStorage(tensor::Storage::wrap(backing.data(), backing.size() * sizeof(double), Device::cuda(0), nullptr),
                                    {4}, {1}, 0, DType::kFloat64);
  Tensor cpu = leafOf({4}, 1);
  expectValueErrorMentions([&] { add(cpu, fake); }, {"add", "cpu", "cuda:0"});
  expectValueErrorMentions([&] { mul(fake, cpu); }, {"mul", "cpu", "cuda:0"});
}

TEST(CudaAutograd, ElementwiseGradientsMatchCpu) {
  DG_SKIP_WITHOUT_CUDA();
  Tensor a = leafOf({4, 5}, 2);
  Tensor b = leafOf({5}, 3);
  Tensor positive = add(abs(randomTensor({4, 5}, 4, DType::kFloat64)), 0.5).detach().setRequiresGrad(true);
  expectCudaGradsMatchCpu([](const Inputs& v) {
    return Outputs{add(v[0], v[1]), sub(v[0], v[1]), mul(v[0], v[1]), div(v[0], add(abs(v[1]), 1.0))};
  }, {a, b}, kTol, "arithmetic with broadcasting");
  expectCudaGradsMatchCpu([](const Inputs& v) {
    return Outputs{neg(v[0]), exp(v[0]), tanh(v[0]), sigmoid(v[0]), relu(v[0]), gelu(v[0]), abs(v[0]),
                   mul(v[0], 3.0), add(v[0], -1.0), clamp(v[0], -0.5, 0.5), pow(v[0], 2.0), pow(v[0], 3.0)};
  }, {a}, kTol, "unary");
  expectCudaGradsMatchCpu([](const Inputs& v) { return Outputs{log(v[0]), sqrt(v[0]), pow(v[0], 1.5), pow(v[0], -1.0)}; },
                          {positive}, kTol, "unary on positive inputs");
  expectCudaGradsMatchCpu([](const Inputs& v) { return Outputs{maximum(v[0], v[1]), minimum(v[0], v[1])}; }, {a, b},
                          kTol, "maximum / minimum");
  expectCudaGradsMatchCpu([](const Inputs& v) { return Outputs{where(gt(v[0], v[1].detach()), v[0], v[1])}; }, {a, b},
                          kTol, "where");
}

TEST(CudaAutograd, ReductionGradientsMatchCpu) {
  DG_SKIP_WITHOUT_CUDA();
  Tensor x = leafOf({3, 4, 5}, 5);
  expectCudaGradsMatchCpu([](const Inputs& v) {
    return Outputs{sum(v[0]), sum(v[0], {0, 2}), sum(v[0], {1}, true), mean(v[0]), mean(v[0], {-1}),
                   var(v[0], {1}), max(v[0]), max(v[0], 1), max(v[0], 2, true)};
  }, {x}, kTol, "reductions");
  Tensor idx = argmax(cudaCopyOf(x), 1);
  EXPECT_EQ(idx.device(), Device::cuda(0));
  EXPECT_TRUE(tensorsClose(idx, argmax(x, 1), kExact));
}

TEST(CudaAutograd, LayoutGradientsMatchCpu) {
  DG_SKIP_WITHOUT_CUDA();
  Tensor x = leafOf({2, 3, 4}, 6);
  Tensor y = leafOf({2, 3, 4}, 7);
  expectCudaGradsMatchCpu([](const Inputs& v) {
    return Outputs{reshape(v[0], {6, 4}), transpose(v[0], 0, 2), permute(v[0], {1, 2, 0}), narrow(v[0], 2, 1, 2),
                   slice(v[0], 1, 0, 3, 2), select(v[0], 1, 1), expand(unsqueeze(sum(v[0], {2}), 2), {-1, -1, 5}),
                   flatten(v[0]), squeeze(unsqueeze(v[0], 0)), clone(transpose(v[0], 0, 1)),
                   contiguous(transpose(v[0], 1, 2))};
  }, {x}, kTol, "views and copies");
  expectCudaGradsMatchCpu([](const Inputs& v) {
    std::vector<Tensor> pieces = split(v[0], 3, 2);
    return Outputs{cat({v[0], v[1]}, 1), stack({v[0], v[1]}, 0), pieces[0], pieces[1]};
  }, {x, y}, kTol, "cat / stack / split");
}

TEST(CudaAutograd, LeafGradientsAccumulateOnTheDevice) {
  DG_SKIP_WITHOUT_CUDA();
  Tensor cpu = leafOf({3, 4}, 8);
  Tensor gpu = cudaCopyOf(cpu);
  for (int i = 0; i < 3; ++i) {
    backward(sum(mul(cpu, cpu)));
    backward(sum(mul(gpu, gpu)));
  }
  ASSERT_TRUE(gpu.grad().defined());
  EXPECT_EQ(gpu.grad().device(), Device::cuda(0));
  EXPECT_TRUE(tensorsClose(gpu.grad(), cpu.grad(), kTol));
  // An implicit root gradient for a one-element CUDA tensor is made on the device.
  Tensor g2 = cudaCopyOf(leafOf({2}, 9));
  backward(sum(g2));
  EXPECT_EQ(g2.grad().device(), Device::cuda(0));
  EXPECT_EQ(g2.grad().toVector<double>(), (std::vector<double>{1.0, 1.0}));
}

TEST(CudaAutograd, ToDeviceCarriesTheGraphAcrossDevices) {
  DG_SKIP_WITHOUT_CUDA();
  // CPU leaf -> GPU work -> back to the CPU, against the same computation on the CPU alone.
  Tensor cpu = leafOf({3, 4}, 10);
  Tensor reference = leafOf({3, 4}, 10);
  Tensor onGpu = toDevice(cpu, Device::cuda(0));
  EXPECT_EQ(onGpu.device(), Device::cuda(0));
  ASSERT_NE(onGpu.gradFn(), nullptr);
  backward(sum(mul(toDevice(tanh(onGpu), Device::cpu()), 3.0)));
  backward(sum(mul(tanh(reference), 3.0)));
  ASSERT_TRUE(cpu.grad().defined());
  EXPECT_EQ(cpu.grad().device(), Device::cpu());
  EXPECT_TRUE(tensorsClose(cpu.grad(), reference.grad(), kTol));
}

TEST(CudaAutograd, ToDeviceWithoutAGpuIsAClearError) {
  if (tensor::cuda::isAvailable()) GTEST_SKIP() << "this machine has a CUDA device";
  Tensor cpu = leafOf({2}, 11);
  expectValueErrorMentions([&] { toDevice(cpu, Device::cuda(0)); }, {"CUDA"});
}

TEST(CudaAutograd, MissingOutputGradientsAreZeroFilledOnTheDevice) {
  DG_SKIP_WITHOUT_CUDA();
  Tensor x = cudaCopyOf(leafOf({3}, 10));
  Tensor first = x.detach().cloneData();
  Tensor second = x.detach().cloneData();
  Tensor seen;
  autograd::recordOp("TwoOutputs", {x}, std::vector<Tensor>{first, second},
                     [&seen](const std::vector<Tensor>& grads, const autograd::Node&) {
                       seen = grads[1];
                       return std::vector<Tensor>{add(grads[0], grads[1])};
                     });
  backward(sum(first));  // only the first output gets a gradient
  ASSERT_TRUE(seen.defined());
  EXPECT_EQ(seen.device(), Device::cuda(0));
  EXPECT_EQ(seen.toVector<double>(), std::vector<double>(3, 0.0));
  EXPECT_EQ(x.grad().toVector<double>(), std::vector<double>(3, 1.0));
}

TEST(CudaAutograd, BackwardRunsOnTheStreamTheForwardRanOn) {
  DG_SKIP_WITHOUT_CUDA();
  Tensor cpuX = leafOf({256, 64}, 11);
  Tensor x = cudaCopyOf(cpuX);
  const tensor::cuda::Stream side = tensor::cuda::Stream::fromPool(0);
  const tensor::cuda::Stream hub = tensor::cuda::Stream::current(0);
  ASSERT_NE(side, hub);
  std::vector<tensor::cuda::Stream> backwardStreams;
  Tensor y;
  {
    tensor::cuda::StreamGuard guard(side);
    // The side stream waits for x's upload on the default stream before reading it.
    tensor::cuda::Event uploaded;
    uploaded.record(hub);
    uploaded.block(side);
    Tensor h = tanh(mul(x, x));
    Tensor marked = h.detach().cloneData();
    autograd::recordOp("Probe", {h}, marked, [&backwardStreams](const std::vector<Tensor>& g, const autograd::Node&) {
      backwardStreams.push_back(tensor::cuda::Stream::current(0));
      return std::vector<Tensor>{g[0]};
    });
    y = sum(marked);
    ASSERT_TRUE(y.gradFn()->forwardStream().has_value());
    EXPECT_EQ(*y.gradFn()->forwardStream(), side);
  }
  backward(y);  // called on the default stream
  ASSERT_EQ(backwardStreams.size(), 1u);
  EXPECT_EQ(backwardStreams[0], side);
  EXPECT_EQ(tensor::cuda::Stream::current(0), hub);  // the engine restored the caller's stream
  // The gradient (accumulated on the hub after the side stream's work) is right.
  backward(sum(tanh(mul(cpuX, cpuX))));
  EXPECT_TRUE(tensorsClose(x.grad(), cpuX.grad(), kTol));
  // A node whose forward ran on the caller's stream needs no cross-stream events.
  Tensor z = sum(exp(x));
  EXPECT_EQ(*z.gradFn()->forwardStream(), hub);
}

}  // namespace
}  // namespace distgrad
