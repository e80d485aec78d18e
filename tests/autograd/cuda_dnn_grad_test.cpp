// Gradients through autograd on CUDA vs CPU for the ops backed by tensor/cuda/dnn_ops.h (GEMM, conv,
// pooling, batch norm, softmax family, losses, embedding): the same float64 graph is built from CPU
// leaves and from CUDA copies, reduced with mseLoss(kSum) against a fixed target (itself a CUDA op, so the
// chain needs no other CUDA kernels), and every leaf gradient is compared at 1e-9 relative (float64; only
// summation order differs). Skips without a GPU; on a machine without one the device-mixing errors of the
// differentiable ops are checked instead.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "autograd_test_util.h"
#include "tensor/cuda/runtime.h"

namespace distgrad {
namespace {

using autograd_testing::randn;

Tensor toCuda(const Tensor& t) { return t.to(Device::cuda(0)); }

// Runs f on CPU leaves and on CUDA leaves (copies of the same values) and compares outputs and gradients.
void compareGradients(const std::string& what, const std::vector<Tensor>& inputs,
                      const std::function<Tensor(const std::vector<Tensor>&)>& f, double tol = 1e-9) {
  std::vector<Tensor> cpuLeaves, cudaLeaves;
  for (const Tensor& t : inputs) {
    const bool differentiable = t.dtype() != DType::kInt64;
    Tensor c = t.detach().cloneData();
    Tensor g = toCuda(c);
    if (differentiable) {
      c.setRequiresGrad(true);
      g.setRequiresGrad(true);
    }
    cpuLeaves.push_back(c);
    cudaLeaves.push_back(g);
  }
  Tensor yCpu = f(cpuLeaves);
  Tensor yCuda = f(cudaLeaves);
  ASSERT_TRUE(yCuda.device().isCuda()) << what;
  autograd_testing::expectNear(yCuda.to(Device::cpu()), yCpu.toVector<double>(), tol, what + " output");
  Tensor target = randn(yCpu.shape(), 99);
  Tensor lossCpu = mseLoss(yCpu, target, Reduction::kSum);
  Tensor lossCuda = mseLoss(yCuda, toCuda(target), Reduction::kSum);
  autograd::backward({lossCpu});
  autograd::backward({lossCuda});
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!cpuLeaves[i].requiresGrad()) continue;
    ASSERT_TRUE(cudaLeaves[i].grad().defined()) << what << " input " << i << " has no CUDA gradient";
    EXPECT_TRUE(cudaLeaves[i].grad().device().isCuda()) << what;
    autograd_testing::expectNear(cudaLeaves[i].grad().to(Device::cpu()), cpuLeaves[i].grad().toVector<double>(), tol,
                                 what + " gradient of input " + std::to_string(i));
  }
}

#define DG_REQUIRE_GPU() \
  if (!tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device"

TEST(CudaDnnGrad, LinearAlgebra) {
  DG_REQUIRE_GPU();
  compareGradients("matmul", {randn({4, 5}, 1), randn({5, 3}, 2)},
                   [](const std::vector<Tensor>& in) { return matmul(in[0], in[1]); });
  compareGradients("bmm", {randn({2, 4, 5}, 3), randn({2, 5, 3}, 4)},
                   [](const std::vector<Tensor>& in) { return bmm(in[0], in[1]); });
  compareGradients("linear", {randn({3, 2, 6}, 5), randn({4, 6}, 6), randn({4}, 7)},
                   [](const std::vector<Tensor>& in) { return linear(in[0], in[1], in[2]); });
}

TEST(CudaDnnGrad, Convolution) {
  DG_REQUIRE_GPU();
  Conv2dOptions o;
  o.stride = {2, 1};
  o.padding = {1, 1};
  compareGradients("conv2d", {randn({2, 3, 7, 6}, 1), randn({4, 3, 3, 3}, 2), randn({4}, 3)},
                   [o](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], in[2], o); });
  Conv2dOptions grouped;
  grouped.groups = 2;
  compareGradients("grouped conv2d", {randn({1, 4, 5, 5}, 4), randn({2, 2, 2, 2}, 5)},
                   [grouped](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], Tensor(), grouped); });
}

TEST(CudaDnnGrad, Pooling) {
  DG_REQUIRE_GPU();
  Pool2dOptions o;
  o.kernel = {3, 3};
  o.stride = {2, 2};
  o.padding = {1, 1};
  o.ceilMode = true;
  const Tensor x = randn({2, 3, 8, 7}, 1);
  compareGradients("maxPool2d", {x}, [o](const std::vector<Tensor>& in) { return maxPool2d(in[0], o); });
  compareGradients("avgPool2d", {x}, [o](const std::vector<Tensor>& in) { return avgPool2d(in[0], o); });
  compareGradients("adaptiveAvgPool2d", {x}, [](const std::vector<Tensor>& in) {
    return adaptiveAvgPool2d(in[0], {3, 2});
  });
}

TEST(CudaDnnGrad, BatchNormTrainingAndEval) {
  DG_REQUIRE_GPU();
  compareGradients(
      "batchNorm train", {randn({4, 3, 3, 2}, 1), randn({3}, 2), randn({3}, 3)},
      [](const std::vector<Tensor>& in) { return batchNorm(in[0], in[1], in[2], Tensor(), Tensor(), true); });
  const Tensor runMean = randn({3}, 4);
  const Tensor runVar = Tensor::full({3}, 0.8, DType::kFloat64);
  compareGradients("batchNorm eval", {randn({4, 3, 3, 2}, 5), randn({3}, 6), randn({3}, 7)},
                   [&](const std::vector<Tensor>& in) {
                     const Device d = in[0].device();
                     return batchNorm(in[0], in[1], in[2], runMean.to(d), runVar.to(d), false);
                   });
}

TEST(CudaDnnGrad, SoftmaxAndLosses) {
  DG_REQUIRE_GPU();
  compareGradients("softmax", {randn({3, 5, 2}, 1)}, [](const std::vector<Tensor>& in) { return softmax(in[0], 1); });
  compareGradients("logSoftmax", {randn({4, 6}, 2)},
                   [](const std::vector<Tensor>& in) { return logSoftmax(in[0], -1); });
  const Tensor targets = Tensor::fromVector(std::vector<int64_t>{1, 0, 4, 2}, {4});
  for (Reduction r : {Reduction::kNone, Reduction::kMean, Reduction::kSum}) {
    const std::string tag = " reduction " + std::to_string(static_cast<int>(r));
    compareGradients("crossEntropy" + tag, {randn({4, 5}, 3), targets},
                     [r](const std::vector<Tensor>& in) { return crossEntropy(in[0], in[1], r); });
    compareGradients("nllLoss" + tag, {randn({4, 5}, 4), targets},
                     [r](const std::vector<Tensor>& in) { return nllLoss(logSoftmax(in[0], 1), in[1], r); });
    compareGradients("mseLoss" + tag, {randn({4, 5}, 5), randn({4, 5}, 6)},
                     [r](const std::vector<Tensor>& in) { return mseLoss(in[0], in[1], r); });
  }
}

TEST(CudaDnnGrad, Embedding) {
  DG_REQUIRE_GPU();
  const Tensor idx = Tensor::fromVector(std::vector<int64_t>{3, 1, 3, 0, 3, 2}, {3, 2});
  compareGradients("embedding", {randn({5, 4}, 1), idx},
                   [](const std::vector<Tensor>& in) { return embedding(in[0], in[1]); });
}

// Runs everywhere: targets/indices on another device than the data are named with both devices (they
// used to be rejected as "only CPU tensors are supported").
TEST(CudaDnnGrad, TargetsAndIndicesMustShareTheDataDevice) {
  const Tensor logits = randn({2, 3}, 1);
  const Tensor targets = Tensor::fromVector(std::vector<int64_t>{0, 2}, {2});
  // A CPU tensor whose storage claims cuda:0; never read (the check fails first).
  std::vector<int64_t> host{0, 2};
  Tensor fakeCudaTargets = Tensor::fromStorage(
      tensor::Storage::wrap(host.data(), host.size() * sizeof(int64_t), Device::cuda(0), [](void*) {}), {2}, {1}, 0,
      DType::kInt64);
  autograd_testing::expectValueError([&] { crossEntropy(logits, fakeCudaTargets); }, "cuda:0");
  autograd_testing::expectValueError([&] { nllLoss(logits, fakeCudaTargets); }, "cuda:0");
  autograd_testing::expectValueError([&] { embedding(randn({4, 3}, 2), fakeCudaTargets); }, "cuda:0");
  EXPECT_NO_THROW(crossEntropy(logits, targets));
}

}  // namespace
}  // namespace distgrad
