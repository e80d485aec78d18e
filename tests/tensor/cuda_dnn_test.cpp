// CUDA GEMM / cuDNN / nn kernels (tensor/cuda/dnn_ops.h, reached through the kernels:: entry points of
// tensor/cpu/): every op runs on CPU and on CUDA copies of the same inputs and the results are compared
// with the tolerance stated at each check. Those cases skip without a GPU. The cases at the top run
// everywhere: math-mode settings, and clear errors for mixed devices and for CUDA operands without a GPU.
//
// Tolerances: float64 1e-10 relative (different summation orders only); float32 GEMM/conv in exact fp32
// mode 1e-4 relative to the magnitude (sums of up to a few hundred products, different blocking); TF32
// 5e-3; element-wise and pooling kernels 1e-5 (float32) / 1e-12 (float64).
//
// TODO(cleanup): the toCuda/expectClose helpers duplicate what tests/tensor/cuda_test_util.h (another
// branch) provides; unify at merge.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "tensor/cpu/batch_norm.h"
#include "tensor/cpu/conv.h"
#include "tensor/cpu/linalg.h"
#include "tensor/cpu/nn_kernels.h"
#include "tensor/cpu/pool.h"
#include "tensor/cuda/dnn_ops.h"
#include "tensor/cuda/math_mode.h"
#include "tensor/cuda/runtime.h"
#include "tensor/error.h"
#include "tensor/random.h"
#include "tensor/tensor.h"

namespace distgrad::tensor {
namespace {

namespace k = kernels;
using cuda::MathMode;

Tensor randn(const Shape& shape, uint64_t seed, DType dtype = DType::kFloat32) {
  Generator gen(seed);
  return normal(shape, 0.0, 1.0, gen, dtype);
}

Tensor toCuda(const Tensor& t) { return t.isContiguous() ? t.to(Device::cuda(0)) : t.cloneData().to(Device::cuda(0)); }
Tensor toCpu(const Tensor& t) { return t.isContiguous() ? t.to(Device::cpu()) : t.cloneData(); }

// |cuda - cpu| <= tol * (1 + |cpu|) element-wise, same shape; on the CPU copy of the CUDA result.
void expectClose(const Tensor& cpu, const Tensor& onCuda, double tol, const std::string& what) {
  ASSERT_TRUE(onCuda.defined()) << what;
  EXPECT_TRUE(onCuda.device().isCuda()) << what << ": result on " << onCuda.device().str();
  ASSERT_EQ(cpu.shape(), onCuda.shape()) << what;
  const std::vector<double> want = cpu.toVector<double>();
  const std::vector<double> got = toCpu(onCuda).toVector<double>();
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(want[i])) {
      ASSERT_TRUE(std::isnan(got[i])) << what << " element " << i;
      continue;
    }
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::abs(want[i]))) << what << " element " << i;
  }
}

// A tensor that claims to live on cuda:0 without any device memory behind it: enough to reach the
// device-routing checks on a machine without a GPU (nothing reads its bytes before they fail).
Tensor fakeCudaTensor(const Shape& shape) {
  const size_t bytes = static_cast<size_t>(numelOf(shape)) * sizeof(float);
  void* host = std::malloc(bytes > 0 ? bytes : 1);
  Storage s = Storage::wrap(host, bytes, Device::cuda(0), [](void* p) { std::free(p); });
  return Tensor::fromStorage(s, shape, contiguousStrides(shape), 0, DType::kFloat32);
}

std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "<no ValueError>";
}

void expectMentions(const std::string& message, std::initializer_list<const char*> fragments) {
  for (const char* f : fragments) EXPECT_NE(message.find(f), std::string::npos) << "'" << f << "' not in: " << message;
}

#define DG_REQUIRE_GPU() \
  if (!cuda::isAvailable()) GTEST_SKIP() << "no CUDA device"

// ================================================================ cases that run everywhere

TEST(CudaMathMode, DefaultsToExactFp32AndRoundTrips) {
  EXPECT_EQ(cuda::matmulMathMode(), MathMode::kFp32);
  EXPECT_EQ(cuda::convMathMode(), MathMode::kFp32);
  cuda::setMatmulMathMode(MathMode::kTf32);
  EXPECT_EQ(cuda::matmulMathMode(), MathMode::kTf32);
  cuda::setMatmulMathMode(MathMode::kBf16);
  EXPECT_EQ(cuda::matmulMathMode(), MathMode::kBf16);
  cuda::setMatmulMathMode(MathMode::kFp32);
  EXPECT_EQ(cuda::matmulMathMode(), MathMode::kFp32);
  {
    cuda::MatmulMathModeGuard guard(MathMode::kTf32);
    EXPECT_EQ(cuda::matmulMathMode(), MathMode::kTf32);
  }
  EXPECT_EQ(cuda::matmulMathMode(), MathMode::kFp32);

  cuda::setConvMathMode(MathMode::kTf32);
  EXPECT_EQ(cuda::convMathMode(), MathMode::kTf32);
  expectMentions(errorOf([] { cuda::setConvMathMode(MathMode::kBf16); }), {"setConvMathMode", "bf16"});
  EXPECT_EQ(cuda::convMathMode(), MathMode::kTf32);  // a rejected setting changes nothing
  cuda::setConvMathMode(MathMode::kFp32);
  EXPECT_EQ(cuda::convMathMode(), MathMode::kFp32);
}

TEST(CudaMathMode, ConvAlgorithmSearchRoundTrips) {
  EXPECT_EQ(cuda::convAlgorithmSearch(), cuda::ConvAlgorithmSearch::kHeuristic);
  cuda::setConvAlgorithmSearch(cuda::ConvAlgorithmSearch::kBenchmark);
  EXPECT_EQ(cuda::convAlgorithmSearch(), cuda::ConvAlgorithmSearch::kBenchmark);
  expectMentions(errorOf([] { cuda::setConvAlgorithmSearch(static_cast<cuda::ConvAlgorithmSearch>(7)); }),
                 {"setConvAlgorithmSearch", "7"});
  cuda::setConvAlgorithmSearch(cuda::ConvAlgorithmSearch::kHeuristic);
  EXPECT_EQ(cuda::convAlgorithmSearch(), cuda::ConvAlgorithmSearch::kHeuristic);
}

TEST(CudaMathMode, NamesParseBack) {
  for (MathMode m : {MathMode::kFp32, MathMode::kTf32, MathMode::kBf16}) {
    EXPECT_EQ(cuda::parseMathMode(cuda::mathModeName(m)), m);
  }
  expectMentions(errorOf([] { cuda::parseMathMode("fp16"); }), {"parseMathMode", "fp16"});
  expectMentions(errorOf([] { cuda::setMatmulMathMode(static_cast<MathMode>(42)); }), {"setMatmulMathMode", "42"});
}

TEST(CudaDnnRouting, MixingCpuAndCudaOperandsNamesBothDevices) {
  Tensor cpuA = randn({2, 3}, 1);
  Tensor cpuB = randn({3, 4}, 2);
  Tensor gpuB = fakeCudaTensor({3, 4});
  expectMentions(errorOf([&] { k::matmul(cpuA, gpuB); }), {"matmul", "cpu", "cuda:0"});
  expectMentions(errorOf([&] { k::linear(cpuA, fakeCudaTensor({4, 3}), Tensor()); }), {"linear", "cpu", "cuda:0"});
  expectMentions(errorOf([&] {
                   k::linear(cpuA, randn({4, 3}, 3), fakeCudaTensor({4}));
                 }),
                 {"linear", "bias", "cuda:0"});
  Tensor x = randn({1, 2, 5, 5}, 4);
  expectMentions(errorOf([&] {
                   k::conv2d(x, fakeCudaTensor({3, 2, 3, 3}), Tensor(), {});
                 }),
                 {"conv2d", "weight", "cpu", "cuda:0"});
  expectMentions(errorOf([&] { k::batchNormEval(x, Tensor(), Tensor(), fakeCudaTensor({2}), randn({2}, 5), 1e-5); }),
                 {"batchNorm", "running mean", "cuda:0"});
  Tensor targets = Tensor::fromVector(std::vector<int64_t>{0, 1}, {2});
  expectMentions(errorOf([&] {
                   k::crossEntropy(fakeCudaTensor({2, 3}), targets, k::LossReduction::kMean);
                 }),
                 {"crossEntropy", "targets", "cpu", "cuda:0"});
  expectMentions(errorOf([&] {
                   k::mseLoss(cpuA, fakeCudaTensor({2, 3}), k::LossReduction::kSum);
                 }),
                 {"mseLoss", "cpu", "cuda:0"});
  expectMentions(errorOf([&] { k::embedding(fakeCudaTensor({4, 2}), targets); }), {"embedding", "indices", "cpu"});
}

TEST(CudaDnnRouting, CudaOperandsWithoutAUsableDeviceNameTheOpAndDevice) {
  if (cuda::isAvailable()) GTEST_SKIP() << "a GPU is present";
  Tensor a = fakeCudaTensor({2, 3}), b = fakeCudaTensor({3, 4});
  expectMentions(errorOf([&] { k::matmul(a, b); }), {"matmul", "CUDA"});
  expectMentions(errorOf([&] { k::softmax(a, 1); }), {"softmax", "CUDA"});
  expectMentions(errorOf([&] {
                   k::conv2d(fakeCudaTensor({1, 1, 4, 4}), fakeCudaTensor({1, 1, 3, 3}), Tensor(), {});
                 }),
                 {"conv2d", "CUDA"});
  expectMentions(errorOf([&] { k::maxPool2d(fakeCudaTensor({1, 1, 4, 4}), {}, true); }), {"maxPool2d", "CUDA"});
  expectMentions(errorOf([&] {
                   k::batchNormTrain(fakeCudaTensor({2, 3}), Tensor(), Tensor(), 1e-5);
                 }),
                 {"batchNorm", "CUDA"});
  Generator gen(1);
  expectMentions(errorOf([&] { k::dropout(a, 0.5, gen); }), {"dropout", "CUDA"});
}

#ifndef DG_WITH_CUDA
TEST(CudaDnnRouting, BuiltWithoutCudaSaysSo) {
  expectMentions(errorOf([] {
                   k::matmul(fakeCudaTensor({2, 2}), fakeCudaTensor({2, 2}));
                 }),
                 {"matmul", "built without CUDA"});
  expectMentions(errorOf([] { cuda::dnn::softmax(randn({2}, 1), 0); }), {"softmax", "built without CUDA"});
}
#endif

// ================================================================ GEMM (GPU)

TEST(CudaGemm, MatmulMatchesCpuAcrossShapesAndDTypes) {
  DG_REQUIRE_GPU();
  struct Case {
    Shape a, b;
  };
  const std::vector<Case> cases = {
      {{5, 7}, {7, 3}},          {{7}, {7, 3}},          {{5, 7}, {7}},    {{7}, {7}},       {{4, 5, 6}, {6, 2}},
      {{2, 1, 4, 5}, {3, 5, 6}}, {{1, 3, 2}, {4, 2, 5}}, {{0, 3}, {3, 4}}, {{3, 0}, {0, 4}}, {{65, 129}, {129, 33}},
  };
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    const double tol = dtype == DType::kFloat64 ? 1e-10 : 1e-4;
    uint64_t seed = 10;
    for (const Case& c : cases) {
      Tensor a = randn(c.a, ++seed, dtype), b = randn(c.b, ++seed, dtype);
      expectClose(k::matmul(a, b), k::matmul(toCuda(a), toCuda(b)), tol,
                  "matmul " + shapeStr(c.a) + " x " + shapeStr(c.b) + " " + dtypeName(dtype));
    }
  }
}

TEST(CudaGemm, TransposedNonContiguousAndReducingBatches) {
  DG_REQUIRE_GPU();
  Tensor a = randn({3, 6, 4}, 1), b = randn({3, 5, 6}, 2);  // a^T [3,4,6] x b^T [3,6,5] -> [3,4,5]
  expectClose(k::batchedMatmul(a, true, b, true, {3}), k::batchedMatmul(toCuda(a), true, toCuda(b), true, {3}), 1e-4,
              "batchedMatmul a^T b^T");
  // Sum over the batch (the gradient of a broadcast operand).
  Tensor c = randn({3, 4, 6}, 3);
  expectClose(k::batchedMatmul(c, false, b, true, {1}), k::batchedMatmul(toCuda(c), false, toCuda(b), true, {1}), 1e-4,
              "batchedMatmul reducing the batch");
  // A column slice: neither last-dim stride is 1, so the operand is copied on the device first.
  Tensor wide = randn({4, 12}, 4);
  Tensor gw = toCuda(wide);
  auto everyOther = [](const Tensor& t) { return Tensor::fromStorage(t.storage(), {4, 6}, {12, 2}, 0, t.dtype()); };
  Tensor rhs = randn({6, 3}, 5);
  expectClose(k::matmul(everyOther(wide), rhs), k::matmul(everyOther(gw), toCuda(rhs)), 1e-4, "matmul strided view");
  // A transposed view (strides (1, ld)) goes to the GEMM without a copy.
  Tensor tv = Tensor::fromStorage(gw.storage(), {12, 4}, {1, 12}, 0, DType::kFloat32);
  Tensor tvCpu = Tensor::fromStorage(wide.storage(), {12, 4}, {1, 12}, 0, DType::kFloat32);
  Tensor r2 = randn({4, 2}, 6);
  expectClose(k::matmul(tvCpu, r2), k::matmul(tv, toCuda(r2)), 1e-4, "matmul transposed view");
}

TEST(CudaGemm, LinearForwardAndBackward) {
  DG_REQUIRE_GPU();
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    const double tol = dtype == DType::kFloat64 ? 1e-10 : 1e-4;
    Tensor x = randn({2, 3, 16}, 1, dtype), w = randn({8, 16}, 2, dtype), bias = randn({8}, 3, dtype);
    Tensor g = randn({2, 3, 8}, 4, dtype);
    expectClose(k::linear(x, w, bias), k::linear(toCuda(x), toCuda(w), toCuda(bias)), tol, "linear with bias");
    expectClose(k::linear(x, w, Tensor()), k::linear(toCuda(x), toCuda(w), Tensor()), tol, "linear without bias");
    expectClose(k::linearBackwardInput(g, w, x.shape()), k::linearBackwardInput(toCuda(g), toCuda(w), x.shape()), tol,
                "linear backward input");
    expectClose(k::linearBackwardWeight(g, x), k::linearBackwardWeight(toCuda(g), toCuda(x)), tol,
                "linear backward weight");
    expectClose(k::linearBackwardBias(g), k::linearBackwardBias(toCuda(g)), tol, "linear backward bias");
  }
}

TEST(CudaGemm, RawGemmMatchesCpuGemm) {
  DG_REQUIRE_GPU();
  const int64_t m = 33, n = 17, kk = 65;
  Tensor a = randn({kk, m}, 1), b = randn({n, kk}, 2), c = randn({m, n}, 3);  // op(A) = A^T, op(B) = B^T
  Tensor want = c.cloneData();
  k::gemm(true, true, m, n, kk, 0.5f, a.data<float>(), m, b.data<float>(), kk, 2.0f, want.data<float>(), n);
  Tensor ga = toCuda(a), gb = toCuda(b), gc = toCuda(c);
  cuda::dnn::gemm(0, true, true, m, n, kk, 0.5f, ga.data<float>(), m, gb.data<float>(), kk, 2.0f, gc.data<float>(), n);
  expectClose(want, gc, 1e-4, "gemm alpha/beta/transposes");
}

TEST(CudaGemm, Tf32IsCloseButFp32IsExactToRounding) {
  DG_REQUIRE_GPU();
  Tensor a = randn({256, 512}, 1), b = randn({512, 128}, 2);
  Tensor want = k::matmul(a.toDType(DType::kFloat64), b.toDType(DType::kFloat64));
  Tensor ga = toCuda(a), gb = toCuda(b);
  expectClose(want, k::matmul(ga, gb).toDType(DType::kFloat64), 1e-4, "fp32 mode");
  {
    cuda::MatmulMathModeGuard guard(MathMode::kTf32);
    // TF32 keeps 10 mantissa bits: |error| ~ 2^-11 * sqrt(k) * |a||b| ~ 1e-2 for k = 512 unit normals.
    expectClose(want, k::matmul(ga, gb).toDType(DType::kFloat64), 5e-2, "tf32 mode");
  }
  {
    cuda::MatmulMathModeGuard guard(MathMode::kBf16);
    expectClose(want, k::matmul(ga, gb).toDType(DType::kFloat64), 0.5, "bf16 mode");
  }
  // float64 ignores the mode.
  cuda::MatmulMathModeGuard guard(MathMode::kTf32);
  Tensor a64 = a.toDType(DType::kFloat64), b64 = b.toDType(DType::kFloat64);
  expectClose(want, k::matmul(toCuda(a64), toCuda(b64)), 1e-10, "float64 under tf32 mode");
}

// ================================================================ convolution (GPU)

TEST(CudaConv, ForwardAndBackwardMatchCpu) {
  DG_REQUIRE_GPU();
  struct Case {
    Shape x, w;
    k::Conv2dParams p;
  };
  std::vector<Case> cases;
  cases.push_back({{2, 3, 9, 9}, {4, 3, 3, 3}, {}});
  k::Conv2dParams strided;
  strided.stride = {2, 2};
  strided.padding = {1, 1};
  cases.push_back({{2, 4, 10, 8}, {6, 4, 3, 3}, strided});
  k::Conv2dParams dilated;
  dilated.dilation = {2, 1};
  dilated.padding = {2, 1};
  cases.push_back({{1, 2, 7, 7}, {3, 2, 3, 3}, dilated});
  k::Conv2dParams grouped;
  grouped.groups = 2;
  grouped.padding = {1, 1};
  cases.push_back({{2, 4, 6, 6}, {6, 2, 3, 3}, grouped});
  cases.push_back({{3, 8, 5, 5}, {16, 8, 1, 1}, {}});
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    const double tol = dtype == DType::kFloat64 ? 1e-10 : 1e-4;
    uint64_t seed = 100;
    for (const Case& c : cases) {
      const std::string what = "conv " + shapeStr(c.x) + " * " + shapeStr(c.w) + " " + dtypeName(dtype);
      Tensor x = randn(c.x, ++seed, dtype), w = randn(c.w, ++seed, dtype), b = randn({c.w[0]}, ++seed, dtype);
      Tensor y = k::conv2d(x, w, b, c.p);
      expectClose(y, k::conv2d(toCuda(x), toCuda(w), toCuda(b), c.p), tol, what + " forward");
      Tensor g = randn(y.shape(), ++seed, dtype);
      k::Conv2dGrads want = k::conv2dBackward(g, x, w, c.p, true, true, true);
      k::Conv2dGrads got = k::conv2dBackward(toCuda(g), toCuda(x), toCuda(w), c.p, true, true, true);
      expectClose(want.input, got.input, tol, what + " dx");
      expectClose(want.weight, got.weight, tol, what + " dw");
      expectClose(want.bias, got.bias, tol, what + " db");
      expectClose(k::conv2dBackwardBias(g), k::conv2dBackwardBias(toCuda(g)), tol, what + " db alone");
    }
  }
}

TEST(CudaConv, BenchmarkSearchAndTf32GiveTheSameConvolution) {
  DG_REQUIRE_GPU();
  k::Conv2dParams p;
  p.padding = {1, 1};
  Tensor x = randn({4, 16, 12, 12}, 1), w = randn({32, 16, 3, 3}, 2);
  Tensor want = k::conv2d(x, w, Tensor(), p);
  Tensor g = randn(want.shape(), 3);
  k::Conv2dGrads wantGrads = k::conv2dBackward(g, x, w, p, true, true, false);
  cuda::setConvAlgorithmSearch(cuda::ConvAlgorithmSearch::kBenchmark);
  const size_t before = cuda::dnn::convAlgorithmCacheSize();
  Tensor got = k::conv2d(toCuda(x), toCuda(w), Tensor(), p);
  k::Conv2dGrads gotGrads = k::conv2dBackward(toCuda(g), toCuda(x), toCuda(w), p, true, true, false);
  EXPECT_EQ(cuda::dnn::convAlgorithmCacheSize(), before + 3);  // one choice per pass, keyed by the search
  cuda::setConvAlgorithmSearch(cuda::ConvAlgorithmSearch::kHeuristic);
  // k = 16 * 9 = 144 products per output: 1e-4 relative covers fp32 reassociation.
  expectClose(want, got, 1e-4, "benchmark-chosen forward");
  expectClose(wantGrads.input, gotGrads.input, 1e-4, "benchmark-chosen backward data");
  expectClose(wantGrads.weight, gotGrads.weight, 1e-4, "benchmark-chosen backward filter");
  // TF32 keeps 10 mantissa bits: ~1e-3 relative per product, ~1e-2 on sums of 144 unit-normal products.
  cuda::setConvMathMode(MathMode::kTf32);
  Tensor tf32 = k::conv2d(toCuda(x), toCuda(w), Tensor(), p);
  cuda::setConvMathMode(MathMode::kFp32);
  expectClose(want, tf32, 2e-2, "tf32 forward");
}

TEST(CudaConv, AlgorithmChoicesAreCachedPerShape) {
  DG_REQUIRE_GPU();
  Tensor x = toCuda(randn({2, 3, 12, 12}, 1)), w = toCuda(randn({5, 3, 3, 3}, 2));
  k::conv2d(x, w, Tensor(), {});
  const size_t after = cuda::dnn::convAlgorithmCacheSize();
  k::conv2d(x, w, Tensor(), {});
  EXPECT_EQ(cuda::dnn::convAlgorithmCacheSize(), after);  // same shape: no new query
  k::conv2d(toCuda(randn({2, 3, 14, 12}, 3)), w, Tensor(), {});
  EXPECT_EQ(cuda::dnn::convAlgorithmCacheSize(), after + 1);
}

// ================================================================ pooling (GPU)

TEST(CudaPool, MaxAvgAndAdaptiveMatchCpuForwardAndBackward) {
  DG_REQUIRE_GPU();
  std::vector<k::Pool2dParams> params = {
      {2, 2, 2, 2, 0, 0, false}, {3, 3, 2, 2, 1, 1, false}, {3, 3, 2, 2, 1, 1, true},  // ceil: overhang -> our kernel
      {2, 3, 1, 2, 1, 1, false}, {3, 2, 3, 2, 0, 1, true},
  };
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    const double tol = dtype == DType::kFloat64 ? 1e-12 : 1e-5;
    Tensor x = randn({2, 3, 9, 8}, 7, dtype);
    Tensor gx = toCuda(x);
    for (const k::Pool2dParams& p : params) {
      const std::string what = "pool k" + std::to_string(p.kernelH) + "x" + std::to_string(p.kernelW) + " s" +
                               std::to_string(p.strideH) + " p" + std::to_string(p.padH) + (p.ceilMode ? " ceil" : "");
      k::MaxPool2dResult mx = k::maxPool2d(x, p, true, k::CpuImpl::kLoops);
      k::MaxPool2dResult gmx = k::maxPool2d(gx, p, true);
      expectClose(mx.output, gmx.output, tol, what + " max forward");
      Tensor g = randn(mx.output.shape(), 8, dtype);
      expectClose(k::maxPool2dBackward(g, *mx.saved), k::maxPool2dBackward(toCuda(g), *gmx.saved), tol,
                  what + " max backward");
      Tensor avg = k::avgPool2d(x, p, k::CpuImpl::kLoops);
      expectClose(avg, k::avgPool2d(gx, p), tol, what + " avg forward");
      expectClose(k::avgPool2dBackward(g, x.shape(), p, k::CpuImpl::kLoops),
                  k::avgPool2dBackward(toCuda(g), x.shape(), p), tol, what + " avg backward");
    }
    for (auto [oh, ow] : {std::pair<int64_t, int64_t>{1, 1}, {3, 3}, {4, 5}, {9, 8}, {10, 3}}) {
      const std::string what = "adaptive " + std::to_string(oh) + "x" + std::to_string(ow);
      Tensor y = k::adaptiveAvgPool2d(x, oh, ow);
      expectClose(y, k::adaptiveAvgPool2d(gx, oh, ow), tol, what + " forward");
      Tensor g = randn(y.shape(), 9, dtype);
      expectClose(k::adaptiveAvgPool2dBackward(g, x.shape()), k::adaptiveAvgPool2dBackward(toCuda(g), x.shape()), tol,
                  what + " backward");
    }
  }
}

TEST(CudaPool, MaxPoolingPropagatesNanLikeTheCpu) {
  DG_REQUIRE_GPU();
  Tensor x = randn({1, 1, 4, 4}, 3);
  x.data<float>()[5] = std::nanf("");
  k::Pool2dParams p;
  expectClose(k::maxPool2d(x, p, false, k::CpuImpl::kLoops).output, k::maxPool2d(toCuda(x), p, false).output, 0,
              "max pool with NaN");
}

// ================================================================ batch norm (GPU)

TEST(CudaBatchNorm, TrainEvalBackwardAndRunningStatsMatchCpu) {
  DG_REQUIRE_GPU();
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    const double tol = dtype == DType::kFloat64 ? 1e-10 : 1e-4;
    for (const Shape& shape : {Shape{4, 3, 5, 6}, Shape{8, 5}, Shape{2, 4, 3, 2, 2}}) {
      const std::string what = "batchNorm " + shapeStr(shape) + " " + dtypeName(dtype);
      const int64_t c = shape[1];
      Tensor x = randn(shape, 1, dtype), w = randn({c}, 2, dtype), b = randn({c}, 3, dtype);
      k::BatchNormTrainResult want = k::batchNormTrain(x, w, b, 1e-5);
      k::BatchNormTrainResult got = k::batchNormTrain(toCuda(x), toCuda(w), toCuda(b), 1e-5);
      expectClose(want.output, got.output, tol, what + " train output");
      expectClose(want.mean, got.mean, tol, what + " batch mean");
      expectClose(want.var, got.var, tol, what + " batch var");
      Tensor noAffine = k::batchNormTrain(x, Tensor(), Tensor(), 1e-5).output;
      expectClose(noAffine, k::batchNormTrain(toCuda(x), Tensor(), Tensor(), 1e-5).output, tol, what + " no affine");
      Tensor rm = randn({c}, 4, dtype), rv = Tensor::full({c}, 0.7, dtype);
      expectClose(k::batchNormEval(x, w, b, rm, rv, 1e-5),
                  k::batchNormEval(toCuda(x), toCuda(w), toCuda(b), toCuda(rm), toCuda(rv), 1e-5), tol, what + " eval");
      Tensor g = randn(shape, 6, dtype);
      for (bool training : {true, false}) {
        const Tensor& m = training ? want.mean : rm;
        const Tensor& v = training ? want.var : rv;
        k::BatchNormGrads wg = k::batchNormBackward(g, x, w, m, v, 1e-5, training, {true, true, true});
        k::BatchNormGrads gg = k::batchNormBackward(toCuda(g), toCuda(x), toCuda(w), toCuda(m), toCuda(v), 1e-5,
                                                    training, {true, true, true});
        const std::string mode = training ? " train" : " eval";
        expectClose(wg.x, gg.x, tol, what + mode + " dx");
        expectClose(wg.weight, gg.weight, tol, what + mode + " dweight");
        expectClose(wg.bias, gg.bias, tol, what + mode + " dbias");
      }
      Tensor runMean = randn({c}, 7, dtype), runVar = Tensor::full({c}, 1.5, dtype);
      Tensor gRunMean = toCuda(runMean), gRunVar = toCuda(runVar);
      const int64_t count = numelOf(shape) / c;
      k::updateRunningStats(runMean, runVar, want.mean, want.var, count, 0.1);
      k::updateRunningStats(gRunMean, gRunVar, got.mean, got.var, count, 0.1);
      expectClose(runMean, gRunMean, tol, what + " running mean");
      expectClose(runVar, gRunVar, tol, what + " running var");
    }
  }
}

// ================================================================ softmax, losses, dropout, embedding (GPU)

TEST(CudaNn, SoftmaxFamilyMatchesCpuAlongEveryDim) {
  DG_REQUIRE_GPU();
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    const double tol = dtype == DType::kFloat64 ? 1e-12 : 1e-5;
    Tensor x = randn({3, 4, 5}, 1, dtype);
    for (int64_t dim = 0; dim < 3; ++dim) {
      const std::string what = std::string(dtypeName(dtype)) + " dim " + std::to_string(dim);
      Tensor s = k::softmax(x, dim), ls = k::logSoftmax(x, dim);
      Tensor gs = k::softmax(toCuda(x), dim), gls = k::logSoftmax(toCuda(x), dim);
      expectClose(s, gs, tol, "softmax " + what);
      expectClose(ls, gls, tol, "logSoftmax " + what);
      Tensor g = randn(x.shape(), 2, dtype);
      expectClose(k::softmaxBackward(g, s, dim), k::softmaxBackward(toCuda(g), gs, dim), tol,
                  "softmax backward " + what);
      expectClose(k::logSoftmaxBackward(g, ls, dim), k::logSoftmaxBackward(toCuda(g), gls, dim), tol,
                  "logSoftmax backward " + what);
    }
    Tensor large = Tensor::full({2, 3}, 1000.0, dtype);
    expectClose(k::logSoftmax(large, 1), k::logSoftmax(toCuda(large), 1), tol, "logSoftmax of large logits");
  }
}

TEST(CudaNn, LossesAndTheirGradientsMatchCpu) {
  DG_REQUIRE_GPU();
  Tensor targets = Tensor::fromVector(std::vector<int64_t>{2, 0, 4, 4, 1, 3}, {6});
  Tensor gt = toCuda(targets);
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    const double tol = dtype == DType::kFloat64 ? 1e-12 : 1e-5;
    Tensor logits = randn({6, 5}, 1, dtype);
    Tensor gl = toCuda(logits);
    for (k::LossReduction r : {k::LossReduction::kNone, k::LossReduction::kMean, k::LossReduction::kSum}) {
      const std::string what = std::string(dtypeName(dtype)) + " reduction " + std::to_string(static_cast<int>(r));
      k::CrossEntropyResult want = k::crossEntropy(logits, targets, r);
      k::CrossEntropyResult got = k::crossEntropy(gl, gt, r);
      expectClose(want.loss, got.loss, tol, "crossEntropy " + what);
      Tensor g = r == k::LossReduction::kNone ? randn({6}, 2, dtype) : Tensor::scalar(0.75, dtype);
      expectClose(k::crossEntropyBackward(g, logits, targets, want, r),
                  k::crossEntropyBackward(toCuda(g), gl, gt, got, r), tol, "crossEntropy backward " + what);
      Tensor lp = k::logSoftmax(logits, 1);
      expectClose(k::nllLoss(lp, targets, r), k::nllLoss(toCuda(lp), gt, r), tol, "nllLoss " + what);
      expectClose(k::nllLossBackward(g, targets, lp.shape(), dtype, r),
                  k::nllLossBackward(toCuda(g), gt, lp.shape(), dtype, r), tol, "nllLoss backward " + what);
      Tensor target = randn({6, 5}, 3, dtype);
      Tensor gm = r == k::LossReduction::kNone ? randn({6, 5}, 4, dtype) : g;
      expectClose(k::mseLoss(logits, target, r), k::mseLoss(gl, toCuda(target), r), tol, "mseLoss " + what);
      k::MseLossGrads mw = k::mseLossBackward(gm, logits, target, r, true, true);
      k::MseLossGrads mg = k::mseLossBackward(toCuda(gm), gl, toCuda(target), r, true, true);
      expectClose(mw.input, mg.input, tol, "mseLoss backward input " + what);
      expectClose(mw.target, mg.target, tol, "mseLoss backward target " + what);
    }
  }
  // An out-of-range target is the CPU's error, naming the value and its position.
  Tensor bad = toCuda(Tensor::fromVector(std::vector<int64_t>{0, 7, 1}, {3}));
  expectMentions(errorOf([&] {
                   k::crossEntropy(toCuda(randn({3, 5}, 9)), bad, k::LossReduction::kMean);
                 }),
                 {"crossEntropy", "target 7", "position 1", "5 classes"});
  expectMentions(errorOf([&] {
                   k::nllLoss(toCuda(randn({3, 5}, 9)), bad, k::LossReduction::kMean);
                 }),
                 {"nllLoss", "target 7"});
}

TEST(CudaNn, DropoutMaskIsInvertedSeededAndUnbiased) {
  DG_REQUIRE_GPU();
  const int64_t n = 1 << 16;
  const double p = 0.3;
  Tensor x = toCuda(randn({n}, 1));
  Generator gen(42);
  k::DropoutResult r = k::dropout(x, p, gen);
  const std::vector<float> mask = toCpu(r.mask).toVector<float>();
  const std::vector<float> out = toCpu(r.output).toVector<float>();
  const std::vector<float> in = toCpu(x).toVector<float>();
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  int64_t dropped = 0;
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_TRUE(mask[i] == 0.f || mask[i] == scale) << "mask element " << i << " = " << mask[i];
    dropped += mask[i] == 0.f;
    ASSERT_FLOAT_EQ(out[i], in[i] * mask[i]) << i;
  }
  // Binomial(n, p): sd = sqrt(n p (1-p)) ~ 117; 6 sd is a bound a correct generator never crosses.
  EXPECT_NEAR(static_cast<double>(dropped), p * n, 6 * std::sqrt(n * p * (1 - p)));
  Generator again(42);
  EXPECT_EQ(toCpu(k::dropout(x, p, again).mask).toVector<float>(), mask);  // reproducible
  EXPECT_NE(toCpu(k::dropout(x, p, again).mask).toVector<float>(), mask);  // the generator moved on
}

TEST(CudaNn, EmbeddingForwardBackwardWithRepeatedIndices) {
  DG_REQUIRE_GPU();
  Tensor w = randn({6, 4}, 1, DType::kFloat64);
  Tensor idx = Tensor::fromVector(std::vector<int64_t>{5, 0, 5, 2, 2, 2}, {2, 3});
  Tensor gi = toCuda(idx);
  expectClose(k::embedding(w, idx), k::embedding(toCuda(w), gi), 0, "embedding forward");
  Tensor g = randn({2, 3, 4}, 2, DType::kFloat64);
  expectClose(k::embeddingBackward(g, idx, w.shape()), k::embeddingBackward(toCuda(g), gi, w.shape()), 1e-12,
              "embedding backward");
  Tensor bad = toCuda(Tensor::fromVector(std::vector<int64_t>{1, -1}, {2}));
  expectMentions(errorOf([&] { k::embedding(toCuda(w), bad); }), {"embedding", "index -1", "position 1"});
}

TEST(CudaNn, EmptyInputsGiveEmptyResults) {
  DG_REQUIRE_GPU();
  Tensor x = toCuda(Tensor::empty({0, 5}));
  EXPECT_EQ(k::softmax(x, 1).shape(), (Shape{0, 5}));
  Tensor t = toCuda(Tensor::empty({0}, DType::kInt64));
  EXPECT_EQ(k::crossEntropy(x, t, k::LossReduction::kNone).loss.shape(), (Shape{0}));
  EXPECT_EQ(k::matmul(x, toCuda(randn({5, 3}, 1))).shape(), (Shape{0, 3}));
  EXPECT_EQ(k::embedding(toCuda(randn({4, 2}, 1)), t).shape(), (Shape{0, 2}));
}

}  // namespace
}  // namespace distgrad::tensor
