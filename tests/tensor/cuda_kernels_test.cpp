// The CUDA side of the raw kernels (tensor/cpu/{elementwise,reduce,shape_kernels}.h, tensor/random.h) and
// of Tensor's copies: every op runs on CPU inputs and on CUDA copies of them and the values are compared
// with a stated tolerance (cuda_test_util.h). Those tests skip without a GPU. The routing tests at the
// top run everywhere: they use "CUDA" tensors that wrap host memory (Storage::wrap), which is enough to
// reach the device checks without a device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tensor/cpu/elementwise.h"
#include "tensor/cpu/reduce.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/cuda/cuda_memory.h"
#include "tensor/random.h"
#include "tests/tensor/cuda_test_util.h"

namespace distgrad::tensor::kernels {
namespace {

using cuda_testing::cudaCopyOf;
using cuda_testing::expectCudaMatchesCpu;
using cuda_testing::expectValueErrorMentions;
using cuda_testing::kExact;
using cuda_testing::kFloat32Tol;
using cuda_testing::kFloat64Tol;
using cuda_testing::randomTensor;
using cuda_testing::tensorsClose;
using cuda_testing::Tolerance;
using Inputs = std::vector<Tensor>;
using Outputs = std::vector<Tensor>;

// A tensor that claims to live on cuda:0 but wraps host memory: enough to exercise routing and device
// checks on machines without a GPU (no kernel may ever touch its bytes).
Tensor fakeCudaTensor(const Shape& shape) {
  static std::vector<double> backing(1024);
  Storage s = Storage::wrap(backing.data(), backing.size() * sizeof(double), Device::cuda(0), nullptr);
  return Tensor::fromStorage(s, shape, contiguousStrides(shape), 0, DType::kFloat32);
}

Tolerance tolFor(DType dtype) { return dtype == DType::kFloat64 ? kFloat64Tol : (dtype == DType::kInt64 ? kExact : kFloat32Tol); }

// ---------------------------------------------------------------- routing (runs everywhere)

TEST(CudaRouting, MixingCpuAndCudaOperandsNamesBothDevices) {
  Tensor cpu = Tensor::ones({2, 3});
  Tensor gpu = fakeCudaTensor({2, 3});
  expectValueErrorMentions([&] { binary(BinaryOp::kAdd, cpu, gpu); }, {"add", "cpu", "cuda:0", "different devices"});
  expectValueErrorMentions([&] { binary(BinaryOp::kMul, gpu, cpu); }, {"mul", "cpu", "cuda:0"});
  expectValueErrorMentions([&] { where(cpu, gpu, gpu); }, {"where", "condition", "cpu", "cuda:0"});
  expectValueErrorMentions([&] { copyInto(cpu, gpu); }, {"copy", "destination", "cpu", "source", "cuda:0"});
  expectValueErrorMentions([&] { cat({cpu, gpu}, 0); }, {"cat", "tensor 1", "cuda:0", "cpu"});
  expectValueErrorMentions([&] { reluBackward(cpu, gpu); }, {"relu backward", "cpu", "cuda:0"});
  Tensor ga, gb;
  expectValueErrorMentions([&] { maxMinBackward(gpu, cpu, cpu, true, &ga, &gb); },
                           {"maximum backward", "gradient", "cuda:0", "cpu"});
  Tensor idx = Tensor::zeros({2}, DType::kInt64);
  expectValueErrorMentions([&] { maxDimBackward(fakeCudaTensor({2}), idx, {2, 3}, 1); },
                           {"max backward", "cuda:0", "cpu"});
}

TEST(CudaRouting, CudaOperandsWithoutAGpuAreAClearErrorNamingTheOp) {
  if (cuda::isAvailable()) GTEST_SKIP() << "a GPU is present";
  Tensor gpu = fakeCudaTensor({2, 3});
  expectValueErrorMentions([&] { binary(BinaryOp::kAdd, gpu, gpu); }, {"add", "CUDA"});
  expectValueErrorMentions([&] { unary(UnaryOp::kExp, gpu); }, {"exp", "CUDA"});
  expectValueErrorMentions([&] { mulScalar(gpu, 2.0); }, {"mul", "CUDA"});
  expectValueErrorMentions([&] { clamp(gpu, 0, 1); }, {"clamp", "CUDA"});
  expectValueErrorMentions([&] { sumAll(gpu); }, {"sum", "CUDA"});
  expectValueErrorMentions([&] { maxAll(gpu); }, {"max", "CUDA"});
  Tensor values;
  expectValueErrorMentions([&] { maxDim(gpu, 1, false, &values, nullptr); }, {"max", "CUDA"});
  expectValueErrorMentions([&] { contiguous(asStrided(gpu, {3, 2}, {1, 3}, 0)); }, {"contiguous", "CUDA"});
  expectValueErrorMentions([&] { cat({gpu, gpu}, 0); }, {"cat", "CUDA"});
  expectValueErrorMentions([&] { gpu.fill(1.0); }, {"Tensor::fill", "CUDA"});
  expectValueErrorMentions([&] { gpu.to(Device::cpu()); }, {"Tensor::copyFrom", "CUDA"});
  expectValueErrorMentions([&] { Tensor::ones({2}).to(Device::cuda(0)); }, {"CUDA"});
  Generator gen(1);
  expectValueErrorMentions([&] { uniform({4}, 0, 1, gen, DType::kFloat32, Device::cuda(0)); }, {"uniform", "CUDA"});
  expectValueErrorMentions([&] { normal({4}, 0, 1, gen, DType::kFloat32, Device::cuda(0)); }, {"normal", "CUDA"});
  expectValueErrorMentions([&] { cuda::emptyCache(0); }, {"emptyCache", "CUDA"});
}

// ---------------------------------------------------------------- elementwise

TEST(CudaElementwise, BinaryOpsWithBroadcastingMatchCpu) {
  DG_SKIP_WITHOUT_CUDA();
  const std::vector<std::pair<Shape, Shape>> shapes = {
      {{17, 33}, {17, 33}}, {{4, 1, 5}, {3, 1}}, {{2, 3, 4, 5}, {1, 3, 1, 1}}, {{}, {6}}, {{0, 3}, {3}}, {{5}, {}}};
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kInt64}) {
    for (BinaryOp op : {BinaryOp::kAdd, BinaryOp::kSub, BinaryOp::kMul, BinaryOp::kDiv, BinaryOp::kMaximum,
                        BinaryOp::kMinimum, BinaryOp::kEq, BinaryOp::kNe, BinaryOp::kLt, BinaryOp::kLe, BinaryOp::kGt,
                        BinaryOp::kGe}) {
      if (op == BinaryOp::kDiv && dtype == DType::kInt64) continue;
      for (size_t i = 0; i < shapes.size(); ++i) {
        Tensor a = randomTensor(shapes[i].first, 10 + i, dtype);
        Tensor b = randomTensor(shapes[i].second, 20 + i, dtype);
        expectCudaMatchesCpu([op](const Inputs& in) { return Outputs{binary(op, in[0], in[1])}; }, {a, b}, tolFor(dtype),
                             std::string(binaryOpName(op)) + " " + dtypeName(dtype) + " case " + std::to_string(i));
      }
    }
  }
}

TEST(CudaElementwise, NonContiguousOperandsAndNanPropagation) {
  DG_SKIP_WITHOUT_CUDA();
  Tensor a = randomTensor({8, 6}, 1);
  Tensor t = asStrided(a, {6, 8}, {1, 6}, 0);  // a transposed view
  Tensor b = randomTensor({6, 8}, 2);
  expectCudaMatchesCpu([](const Inputs& in) { return Outputs{binary(BinaryOp::kAdd, in[0], in[1])}; },
                       {t, b}, kFloat32Tol, "add transposed");
  // Views of CUDA tensors, made on the device side: slicing every other column.
  Tensor ga = cudaCopyOf(a);
  Tensor slice = asStrided(ga, {8, 3}, {6, 2}, 1);
  Tensor cpuSlice = asStrided(a, {8, 3}, {6, 2}, 1);
  EXPECT_TRUE(tensorsClose(unary(UnaryOp::kNeg, slice), unary(UnaryOp::kNeg, cpuSlice), kExact));
  Tensor withNan = Tensor::fromVector({1.f, std::nanf(""), -2.f, 5.f}, {4});
  Tensor other = Tensor::fromVector({std::nanf(""), 0.f, 3.f, 5.f}, {4});
  for (BinaryOp op : {BinaryOp::kMaximum, BinaryOp::kMinimum, BinaryOp::kEq}) {
    expectCudaMatchesCpu([op](const Inputs& in) { return Outputs{binary(op, in[0], in[1])}; }, {withNan, other}, kExact,
                         binaryOpName(op));
  }
}

TEST(CudaElementwise, UnaryOpsMatchCpu) {
  DG_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kInt64}) {
    Tensor x = randomTensor({7, 13}, 3, dtype);
    for (UnaryOp op : {UnaryOp::kNeg, UnaryOp::kExp, UnaryOp::kLog, UnaryOp::kSqrt, UnaryOp::kAbs, UnaryOp::kRelu,
                       UnaryOp::kGelu, UnaryOp::kTanh, UnaryOp::kSigmoid, UnaryOp::kSign}) {
      const bool floatOnly = !(op == UnaryOp::kNeg || op == UnaryOp::kAbs || op == UnaryOp::kRelu || op == UnaryOp::kSign);
      if (floatOnly && dtype == DType::kInt64) {
        EXPECT_THROW(unary(op, cudaCopyOf(x)), ValueError) << unaryOpName(op);
        continue;
      }
      // log/sqrt see |x| + 0.1 so both devices compute finite values.
      Tensor in = (op == UnaryOp::kLog || op == UnaryOp::kSqrt) ? addScalar(unary(UnaryOp::kAbs, x), 0.1) : x;
      // CUDA's expf/tanhf/normcdff and our vectorised CPU float32 versions differ by a few ulp.
      Tolerance tol = dtype == DType::kFloat32 ? Tolerance{2e-6, 1e-6} : tolFor(dtype);
      expectCudaMatchesCpu([op](const Inputs& v) { return Outputs{unary(op, v[0])}; }, {in}, tol,
                           std::string(unaryOpName(op)) + " " + dtypeName(dtype));
    }
  }
}

TEST(CudaElementwise, ScalarOpsPowClampAndWhereMatchCpu) {
  DG_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kInt64}) {
    Tensor x = randomTensor({5, 9}, 4, dtype);
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{addScalar(v[0], 2.5), mulScalar(v[0], -3.0)}; }, {x},
                         tolFor(dtype), std::string("scalar ops ") + dtypeName(dtype));
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{clamp(v[0], -0.5, 0.75), clamp(v[0], -3, 3)}; }, {x},
                         tolFor(dtype), std::string("clamp ") + dtypeName(dtype));
  }
  Tensor x = randomTensor({5, 9}, 5, DType::kFloat64);
  Tensor positive = addScalar(unary(UnaryOp::kAbs, x), 0.2);
  for (double e : {0.0, 1.0, 2.0, 3.0, 0.5, -1.0, 1.7, -2.3}) {
    Tensor in = (e == 0.5 || e == 1.7 || e == -2.3) ? positive : x;
    expectCudaMatchesCpu([e](const Inputs& v) { return Outputs{powScalar(v[0], e)}; }, {in}, {1e-12, 1e-12},
                         "pow " + std::to_string(e));
  }
  for (DType condType : {DType::kFloat32, DType::kFloat64, DType::kInt64}) {
    Tensor cond = binary(BinaryOp::kGt, randomTensor({4, 1}, 6), Tensor::scalar(0)).toDType(condType);
    Tensor a = randomTensor({4, 5}, 7, DType::kFloat64);
    Tensor b = randomTensor({5}, 8, DType::kFloat64);
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{where(v[0], v[1], v[2])}; }, {cond, a, b}, kExact,
                         std::string("where, condition ") + dtypeName(condType));
  }
}

TEST(CudaElementwise, BackwardPiecesMatchCpu) {
  DG_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    Tensor g = randomTensor({6, 7}, 9, dtype);
    Tensor x = randomTensor({6, 7}, 10, dtype);
    Tensor y = unary(UnaryOp::kSigmoid, x);  // in (0, 1): valid for every saved-output formula
    Tolerance tol = dtype == DType::kFloat32 ? Tolerance{5e-6, 1e-6} : Tolerance{1e-12, 1e-13};
    const std::string name = dtypeName(dtype);
    expectCudaMatchesCpu([](const Inputs& v) {
      return Outputs{reluBackward(v[0], v[1]), sigmoidBackward(v[0], v[2]), tanhBackward(v[0], v[2]),
                     sqrtBackward(v[0], v[2]), geluBackward(v[0], v[1]), absBackward(v[0], v[1])};
    }, {g, x, y}, tol, "pointwise backward " + name);
    for (double e : {0.0, 1.0, 2.0, 3.0}) {
      expectCudaMatchesCpu([e](const Inputs& v) { return Outputs{powBackward(v[0], v[1], e)}; }, {g, x}, tol,
                           "pow backward " + std::to_string(e) + " " + name);
    }
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{powBackward(v[0], v[1], 1.5)}; },
                         {g, addScalar(unary(UnaryOp::kAbs, x), 0.1)}, tol, "pow backward 1.5 " + name);
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{clampBackward(v[0], v[1], -0.3, 0.4)}; }, {g, x}, tol,
                         "clamp backward " + name);
    for (bool isMax : {true, false}) {
      Tensor a = randomTensor({6, 1}, 11, dtype);
      Tensor b = randomTensor({7}, 12, dtype);
      Tensor tied = Tensor::zeros({7}, dtype);  // ties with zeros of a (none here) and exact ties below
      expectCudaMatchesCpu([isMax](const Inputs& v) {
        Tensor ga, gb;
        maxMinBackward(v[0], v[1], v[2], isMax, &ga, &gb);
        return Outputs{ga, gb};
      }, {g, a, b}, kExact, std::string(isMax ? "maximum" : "minimum") + " backward " + name);
      expectCudaMatchesCpu([isMax](const Inputs& v) {
        Tensor ga, gb;
        maxMinBackward(v[0], v[1], v[1], isMax, &ga, &gb);  // all ties: the gradient splits evenly
        return Outputs{ga, gb};
      }, {randomTensor({7}, 13, dtype), tied}, kExact, std::string("tied backward ") + name);
    }
  }
}

// ---------------------------------------------------------------- reductions

TEST(CudaReduce, SumDimsMatchesCpuForEveryMaskAndLayout) {
  DG_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kInt64}) {
    Tensor x = randomTensor({6, 5, 7, 3}, 14, dtype);
    for (int bits = 0; bits < 16; ++bits) {
      std::vector<bool> mask = {bool(bits & 1), bool(bits & 2), bool(bits & 4), bool(bits & 8)};
      for (bool keepDim : {false, true}) {
        expectCudaMatchesCpu([&](const Inputs& v) { return Outputs{sumDims(v[0], mask, keepDim)}; }, {x}, tolFor(dtype),
                             std::string("sum ") + dtypeName(dtype) + " mask " + std::to_string(bits));
      }
    }
    // A permuted (non-contiguous) input.
    Tensor p = asStrided(x, {3, 7, 5, 6}, {1, 3, 21, 105}, 0);
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{sumDims(v[0], {false, true, false, true}, false)}; },
                         {p}, tolFor(dtype), std::string("sum permuted ") + dtypeName(dtype));
  }
}

TEST(CudaReduce, LongRunsSplitAcrossBlocksAndEmptyReductions) {
  DG_SKIP_WITHOUT_CUDA();
  // sumAll over 3M elements takes the split path; float32 accumulates in double on both devices.
  Tensor big = randomTensor({3, 1000, 1000}, 15);
  expectCudaMatchesCpu([](const Inputs& v) { return Outputs{sumAll(v[0])}; }, {big}, {1e-6, 1e-3}, "sumAll 3M");
  // Few outputs, long runs: block per output, split.
  expectCudaMatchesCpu([](const Inputs& v) { return Outputs{sumDims(v[0], {false, true, true}, false)}; }, {big},
                       {1e-6, 1e-3}, "sum over 1M per output");
  // Many outputs, reduced leading dim (a bias gradient).
  Tensor tall = randomTensor({4096, 64}, 16, DType::kFloat64);
  expectCudaMatchesCpu([](const Inputs& v) { return Outputs{sumDims(v[0], {true, false}, false)}; }, {tall},
                       {1e-12, 1e-12}, "bias-gradient sum");
  Tensor ints = Tensor::ones({1 << 20}, DType::kInt64);
  EXPECT_EQ(sumAll(cudaCopyOf(ints)).item(), double(1 << 20));
  // Empty reductions give zeros; empty outputs give empty tensors.
  Tensor empty = Tensor::zeros({0, 4});
  expectCudaMatchesCpu([](const Inputs& v) { return Outputs{sumDims(v[0], {true, false}, true), sumAll(v[0]),
                                                          sumDims(v[0], {false, true}, false)}; },
                       {empty}, kExact, "empty sums");
}

TEST(CudaReduce, MaxAndArgmaxMatchCpuIncludingTiesAndNan) {
  DG_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kInt64}) {
    Tensor x = randomTensor({9, 300, 4}, 17, dtype);
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{maxAll(v[0])}; }, {x}, kExact,
                         std::string("maxAll ") + dtypeName(dtype));
    for (int64_t dim : {0, 1, 2, -1}) {
      for (bool keepDim : {false, true}) {
        expectCudaMatchesCpu([&](const Inputs& v) {
          Tensor values, indices;
          maxDim(v[0], dim, keepDim, &values, &indices);
          return Outputs{values, indices};
        }, {x}, kExact, std::string("maxDim ") + dtypeName(dtype) + " dim " + std::to_string(dim));
      }
    }
  }
  // Ties report the first occurrence; NaN wins; a long run (split path) keeps both rules.
  std::vector<float> values(5000, 1.0f);
  values[4000] = 7.0f;
  values[4500] = 7.0f;
  Tensor ties = Tensor::fromVector(values, {1, 5000});
  values[3000] = std::nanf("");
  values[3500] = std::nanf("");
  Tensor nan = Tensor::fromVector(values, {1, 5000});
  for (const Tensor& t : {ties, nan}) {
    expectCudaMatchesCpu([](const Inputs& v) {
      Tensor vals, idx;
      maxDim(v[0], 1, false, &vals, &idx);
      return Outputs{vals, idx, maxAll(v[0])};
    }, {t}, kExact, "ties / NaN");
  }
  Tensor scalar = Tensor::scalar(3.0);
  expectCudaMatchesCpu([](const Inputs& v) {
    Tensor vals, idx;
    maxDim(v[0], 0, false, &vals, &idx);
    return Outputs{vals, idx};
  }, {scalar}, kExact, "maxDim of a 0-d tensor");
  EXPECT_THROW(maxAll(cudaCopyOf(Tensor::zeros({0}))), ValueError);
}

TEST(CudaReduce, MaxDimBackwardMatchesCpu) {
  DG_SKIP_WITHOUT_CUDA();
  Tensor x = randomTensor({4, 6, 5}, 18, DType::kFloat64);
  Tensor indices;
  maxDim(x, 1, false, nullptr, &indices);
  Tensor g = randomTensor({4, 5}, 19, DType::kFloat64);
  expectCudaMatchesCpu([](const Inputs& v) { return Outputs{maxDimBackward(v[0], v[1], {4, 6, 5}, 1)}; }, {g, indices},
                       kExact, "max backward");
}

// ---------------------------------------------------------------- layout and Tensor basics

TEST(CudaShape, CopiesBroadcastsContiguousAndCatMatchCpu) {
  DG_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kFloat32, DType::kFloat64, DType::kInt64}) {
    Tensor x = randomTensor({5, 8}, 20, dtype);
    Tensor transposed = asStrided(x, {8, 5}, {1, 8}, 0);
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{contiguous(v[0])}; }, {transposed}, kExact, "contiguous");
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{broadcastTo(v[0], {3, 5, 8})}; }, {x}, kExact,
                         "broadcastTo");
    expectCudaMatchesCpu([](const Inputs& v) {
      Tensor dst = Tensor::zeros({4, 5, 8}, v[0].dtype(), v[0].device());
      copyInto(asStrided(dst, {2, 5, 8}, {80, 8, 1}, 40), v[0]);  // broadcast into the second half
      return Outputs{dst};
    }, {x}, kExact, "copyInto a view");
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{cat({v[0], v[1], v[0]}, 1), cat({v[1], v[1]}, 0)}; },
                         {x, randomTensor({5, 8}, 30, dtype)}, kExact, "cat");
    expectCudaMatchesCpu([](const Inputs& v) { return Outputs{cat({v[0], v[1]}, 0)}; },
                         {asStrided(x, {5, 3}, {8, 2}, 1), Tensor::zeros({0, 3}, dtype)}, kExact, "cat strided + empty");
    for (DType target : {DType::kFloat32, DType::kFloat64, DType::kInt64}) {
      expectCudaMatchesCpu([target](const Inputs& v) { return Outputs{contiguousAs(v[0], target)}; }, {transposed},
                           kExact, std::string("contiguousAs ") + dtypeName(target));
    }
  }
}

TEST(CudaTensor, TransfersConversionsAndFillsMatchCpu) {
  DG_SKIP_WITHOUT_CUDA();
  Tensor x = randomTensor({6, 10}, 21, DType::kFloat64);
  Tensor view = asStrided(x, {10, 3}, {1, 20}, 2);  // non-contiguous
  // Host -> device from a view, device -> host of a device view, and conversions on both sides.
  Tensor onDevice = view.to(Device::cuda(0));
  EXPECT_TRUE(onDevice.device().isCuda());
  EXPECT_TRUE(tensorsClose(onDevice, view, kExact));
  Tensor deviceView = asStrided(cudaCopyOf(x), {10, 3}, {1, 20}, 2);
  EXPECT_TRUE(tensorsClose(deviceView.to(Device::cpu()), view, kExact));
  for (DType dt : {DType::kFloat32, DType::kInt64, DType::kBFloat16, DType::kFloat16}) {
    Tensor cpu = view.toDType(dt);
    Tensor gpu = deviceView.toDType(dt);
    EXPECT_EQ(gpu.device(), Device::cuda(0));
    EXPECT_TRUE(tensorsClose(gpu, cpu, kExact)) << dtypeName(dt);
    // Host-side converting copy into a device tensor, and device-side into a host tensor.
    Tensor dst = Tensor::empty({10, 3}, dt, Device::cuda(0));
    dst.copyFrom(view);
    EXPECT_TRUE(tensorsClose(dst, cpu, kExact)) << dtypeName(dt);
    Tensor host = Tensor::empty({10, 3}, DType::kFloat64);
    host.copyFrom(gpu);
    EXPECT_TRUE(tensorsClose(host, cpu.toDType(DType::kFloat64), kExact)) << dtypeName(dt);
  }
  // Into a non-contiguous device destination.
  Tensor dstFull = Tensor::zeros({3, 10}, DType::kFloat64, Device::cuda(0));
  asStrided(dstFull, {10, 3}, {1, 10}, 0).copyFrom(view);
  Tensor expected = Tensor::zeros({3, 10}, DType::kFloat64);
  asStrided(expected, {10, 3}, {1, 10}, 0).copyFrom(view);
  EXPECT_TRUE(tensorsClose(dstFull, expected, kExact));
  // fill / zeros / ones / cloneData / item / toVector on the device.
  for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kInt64, DType::kBFloat16, DType::kFloat16}) {
    Tensor t = Tensor::ones({3, 4}, dt, Device::cuda(0));
    EXPECT_EQ(t.toVector<double>(), std::vector<double>(12, 1.0)) << dtypeName(dt);
    asStrided(t, {3, 2}, {4, 2}, 1).fill(-2.0);
    Tensor ref = Tensor::ones({3, 4}, dt);
    asStrided(ref, {3, 2}, {4, 2}, 1).fill(-2.0);
    EXPECT_TRUE(tensorsClose(t, ref, kExact)) << dtypeName(dt);
    EXPECT_TRUE(tensorsClose(Tensor::zeros({5}, dt, Device::cuda(0)), Tensor::zeros({5}, dt), kExact));
    Tensor clone = t.cloneData();
    EXPECT_EQ(clone.device(), Device::cuda(0));
    EXPECT_FALSE(clone.storage().sameAs(t.storage()));
    EXPECT_TRUE(tensorsClose(clone, ref, kExact));
  }
  EXPECT_EQ(Tensor::scalar(4.5).to(Device::cuda(0)).item(), 4.5);
  EXPECT_EQ(cudaCopyOf(x).at({2, 3}), x.at({2, 3}));
  Tensor empty = Tensor::empty({0, 3}, DType::kFloat32, Device::cuda(0));
  EXPECT_EQ(empty.to(Device::cpu()).numel(), 0);
  empty.fill(1.0);
}

TEST(CudaTensor, CopiesBetweenTwoDevices) {
  DG_SKIP_WITHOUT_CUDA();
  if (cuda::deviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices";
  Tensor x = randomTensor({64, 33}, 22);
  Tensor on0 = x.to(Device::cuda(0));
  Tensor on1 = on0.to(Device::cuda(1));
  EXPECT_EQ(on1.device(), Device::cuda(1));
  EXPECT_TRUE(tensorsClose(on1, x, kExact));
  Tensor view = asStrided(on1, {33, 64}, {1, 33}, 0);
  Tensor back = Tensor::empty({33, 64}, DType::kFloat64, Device::cuda(0));
  back.copyFrom(view);  // strided + converting across devices
  EXPECT_TRUE(tensorsClose(back, asStrided(x, {33, 64}, {1, 33}, 0).toDType(DType::kFloat64), kExact));
  expectValueErrorMentions([&] { binary(BinaryOp::kAdd, on0, on1); }, {"add", "cuda:0", "cuda:1"});
}

TEST(CudaTensor, MoreThanTwoToThe31Elements) {
  DG_SKIP_WITHOUT_CUDA();
  // 2^31 + 3 float32 elements (8 GiB): indices beyond int32 in fills, pointwise ops and sums.
  const int64_t n = (int64_t{1} << 31) + 3;
  Tensor t = Tensor::empty({n}, DType::kFloat32, Device::cuda(0));
  t.fill(1.0);
  Tensor doubled = mulScalar(t, 2.0);
  t = Tensor();
  // The sum accumulates in double and is rounded to float32 once, as on the CPU.
  EXPECT_EQ(sumAll(doubled).item(), static_cast<double>(static_cast<float>(2.0 * static_cast<double>(n))));
  Tensor last = asStrided(doubled, {1}, {1}, n - 1);
  EXPECT_EQ(last.item(), 2.0);
}

// ---------------------------------------------------------------- random

TEST(CudaRandom, UniformAndNormalHaveTheRightMomentsAndAreReproducible) {
  DG_SKIP_WITHOUT_CUDA();
  for (DType dtype : {DType::kFloat32, DType::kFloat64}) {
    Generator gen(42);
    Tensor u = uniform({1 << 20}, -2.0, 3.0, gen, dtype, Device::cuda(0));
    Tensor z = normal({(1 << 20) + 3}, 1.5, 2.0, gen, dtype, Device::cuda(0));
    EXPECT_EQ(u.device(), Device::cuda(0));
    const std::vector<double> uv = u.toVector<double>();
    double lo = 1e9, hi = -1e9, mean = 0;
    for (double v : uv) {
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      mean += v / static_cast<double>(uv.size());
    }
    EXPECT_GE(lo, -2.0);
    EXPECT_LT(hi, 3.0);
    EXPECT_NEAR(mean, 0.5, 0.01);  // sd of the mean: 5 / sqrt(12 * 2^20) = 0.0014
    const std::vector<double> zv = z.toVector<double>();
    double zm = 0, zs = 0;
    for (double v : zv) zm += v / static_cast<double>(zv.size());
    for (double v : zv) zs += (v - zm) * (v - zm) / static_cast<double>(zv.size());
    EXPECT_NEAR(zm, 1.5, 0.01);
    EXPECT_NEAR(std::sqrt(zs), 2.0, 0.01);
    for (double v : zv) ASSERT_TRUE(std::isfinite(v));
    // The same seed gives the same values; the next call gives different ones.
    Generator again(42);
    EXPECT_TRUE(tensorsClose(uniform({1 << 20}, -2.0, 3.0, again, dtype, Device::cuda(0)), u, kExact));
    Tensor next = uniform({1 << 20}, -2.0, 3.0, again, dtype, Device::cuda(0));
    EXPECT_FALSE(tensorsClose(next, u, kExact));
  }
  Generator gen(7);
  Tensor h = normal({1000}, 0, 1, gen, DType::kFloat16, Device::cuda(0));
  EXPECT_EQ(h.dtype(), DType::kFloat16);
  Tensor perm = randperm(100, gen, Device::cuda(0));
  EXPECT_EQ(perm.device(), Device::cuda(0));
  std::vector<int64_t> pv = perm.toVector<int64_t>();
  std::sort(pv.begin(), pv.end());
  for (int64_t i = 0; i < 100; ++i) EXPECT_EQ(pv[i], i);
  EXPECT_EQ(kaimingUniform({16, 8}, gen, 0.0, Device::cuda(0)).device(), Device::cuda(0));
  EXPECT_EQ(kaimingNormalFanOut({16, 8, 3, 3}, gen, Device::cuda(0)).device(), Device::cuda(0));
}

// ---------------------------------------------------------------- the allocator on a device

TEST(CudaMemory, StorageReusesBlocksOnItsStreamAndReportsStats) {
  DG_SKIP_WITHOUT_CUDA();
  cuda::synchronizeDevice(0);
  cuda::emptyCache(0);
  const cuda::MemoryStats before = cuda::memoryStats(0);
  void* first = nullptr;
  {
    Tensor t = Tensor::empty({1000, 1000}, DType::kFloat32, Device::cuda(0));
    first = t.rawData();
    const cuda::MemoryStats during = cuda::memoryStats(0);
    EXPECT_GE(during.allocatedBytes, before.allocatedBytes + 4000000);
    EXPECT_GE(during.peakAllocatedBytes, during.allocatedBytes);
  }
  const cuda::MemoryStats after = cuda::memoryStats(0);
  EXPECT_EQ(after.allocatedBytes, before.allocatedBytes);
  EXPECT_GE(after.cachedBytes, 4000000u);
  Tensor again = Tensor::empty({1000, 1000}, DType::kFloat32, Device::cuda(0));
  EXPECT_EQ(again.rawData(), first);  // same stream, same size class: the cached block
  // Allocated on a side stream: not handed to the default stream while cached.
  cuda::Stream side = cuda::Stream::fromPool(0);
  void* sidePtr = nullptr;
  {
    cuda::StreamGuard guard(side);
    Tensor s = Tensor::empty({1000, 1000}, DType::kFloat32, Device::cuda(0));
    sidePtr = s.rawData();
  }
  Tensor onDefault = Tensor::empty({1000, 1000}, DType::kFloat32, Device::cuda(0));
  EXPECT_NE(onDefault.rawData(), sidePtr);
  again = Tensor();
  onDefault = Tensor();
  cuda::emptyCache(0);
  EXPECT_EQ(cuda::memoryStats(0).cachedBytes, 0u);
}

TEST(CudaMemory, RecordStreamKeepsABlockUntilTheOtherStreamIsDone) {
  DG_SKIP_WITHOUT_CUDA();
  cuda::synchronizeDevice(0);
  cuda::emptyCache(0);  // no other cached block of this size class on the default stream
  cuda::Stream side = cuda::Stream::fromPool(0);
  Tensor t = Tensor::ones({1 << 22}, DType::kFloat32, Device::cuda(0));
  void* ptr = t.rawData();
  {
    // Keep the side stream busy reading t, then drop t on the host.
    cuda::Event ready;
    ready.record(cuda::Stream::current(0));
    ready.block(side);
    cuda::StreamGuard guard(side);
    for (int i = 0; i < 20; ++i) sumAll(t);
    cuda::recordStream(t, side);
  }
  t = Tensor();
  Tensor next = Tensor::empty({1 << 22}, DType::kFloat32, Device::cuda(0));
  // Reused only if the side stream had finished when the allocation looked (so it is finished now).
  if (next.rawData() == ptr) {
    EXPECT_TRUE(side.query());
  }
  side.synchronize();
  Tensor later = Tensor::empty({1 << 22}, DType::kFloat32, Device::cuda(0));
  if (next.rawData() != ptr) {
    EXPECT_EQ(later.rawData(), ptr);  // the event has completed: the block is back
  }
}

TEST(CudaMemory, OutOfMemoryIsAClearError) {
  DG_SKIP_WITHOUT_CUDA();
  const int64_t huge = int64_t{1} << 48;  // 256 TiB of bytes
  expectValueErrorMentions([&] { Tensor::empty({huge}, DType::kFloat32, Device::cuda(0)); },
                           {"out of memory", "cuda:0", "bytes allocated", "bytes reserved"});
}

}  // namespace
}  // namespace distgrad::tensor::kernels
