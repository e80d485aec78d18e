// Pooling ops: values against hand-computed numbers and an independent naive reference, float32 (oneDNN)
// against float64 (loops), float64 gradchecks, and argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "autograd_test_util.h"
#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/cpu/pool.h"
#include "tensor/random.h"
#include "test_util.h"

namespace distgrad {
namespace {

namespace kernels = tensor::kernels;

using autograd_testing::expectValueError;
using testing::expectNear;
using testing::shaped;

// Distinct values (a shuffled 0..n-1, scaled) so max pooling has no ties and gradchecks are well-defined.
Tensor distinct(const Shape& shape, uint64_t seed, DType dtype = DType::kFloat64) {
  tensor::Generator gen(seed);
  Tensor perm = tensor::randperm(tensor::numelOf(shape), gen);
  std::vector<double> v;
  for (int64_t p : perm.toVector<int64_t>()) v.push_back(0.1 * static_cast<double>(p) - 3.0);
  return shaped(v, shape, dtype);
}

// Naive pooling written independently of the kernels: materialises the padded plane (-inf for max, 0 for
// average) and applies PyTorch's divisor rule.
std::vector<double> naivePool(const Tensor& x, Pool2dOptions o, bool isMax) {
  const auto v = x.toVector<double>();
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  const int64_t kh = o.kernel[0], kw = o.kernel[1];
  const int64_t sh = o.stride[0] ? o.stride[0] : kh, sw = o.stride[1] ? o.stride[1] : kw;
  const int64_t ph = o.padding[0], pw = o.padding[1];
  auto outLen = [&](int64_t in, int64_t k, int64_t s, int64_t p) {
    double span = static_cast<double>(in + 2 * p - k) / static_cast<double>(s);
    int64_t len = static_cast<int64_t>(o.ceilMode ? std::ceil(span) : std::floor(span)) + 1;
    if (o.ceilMode && (len - 1) * s >= in + p) --len;
    return len;
  };
  const int64_t oh = outLen(h, kh, sh, ph), ow = outLen(w, kw, sw, pw);
  std::vector<double> out;
  for (int64_t b = 0; b < n * c; ++b) {
    for (int64_t i = 0; i < oh; ++i) {
      for (int64_t j = 0; j < ow; ++j) {
        double best = -std::numeric_limits<double>::infinity(), sum = 0;
        int64_t cells = 0;
        for (int64_t di = 0; di < kh; ++di) {
          for (int64_t dj = 0; dj < kw; ++dj) {
            const int64_t r = i * sh - ph + di, col = j * sw - pw + dj;
            if (r >= h + ph || col >= w + pw) continue;  // ceil-mode overhang: not even padding
            ++cells;
            if (r < 0 || col < 0 || r >= h || col >= w) continue;  // padding
            const double val = v[static_cast<size_t>(b * h * w + r * w + col)];
            best = std::max(best, val);
            sum += val;
          }
        }
        out.push_back(isMax ? best : sum / static_cast<double>(cells));
      }
    }
  }
  return out;
}

Tensor gradOf(const Tensor& y, const Tensor& x, const Tensor& gy) { return autograd::grad({y}, {x}, {gy})[0]; }

// ---------------------------------------------------------------- output sizes

TEST(PoolTest, PooledLengthFollowsPyTorch) {
  EXPECT_EQ(kernels::pooledLength(4, 2, 2, 0, false), 2);
  EXPECT_EQ(kernels::pooledLength(5, 2, 2, 0, false), 2);
  EXPECT_EQ(kernels::pooledLength(5, 2, 2, 0, true), 3);
  EXPECT_EQ(kernels::pooledLength(112, 3, 2, 1, false), 56);  // ResNet stem
  // Ceil mode would start a 4th window at padded index 6 = H + pad: dropped.
  EXPECT_EQ(kernels::pooledLength(5, 2, 2, 1, true), 3);
  EXPECT_EQ(kernels::pooledLength(6, 3, 2, 1, true), 4);
}

// ---------------------------------------------------------------- max pooling

TEST(PoolTest, MaxPoolHandComputed) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = shaped({1, 5, 2, 0,   //
                       3, 4, 8, 1,   //
                       -1, 0, 7, 6,  //
                       2, 9, 3, 5},
                      {1, 1, 4, 4}, dt);
    Tensor y = maxPool2d(x, {});
    EXPECT_EQ(y.shape(), (Shape{1, 1, 2, 2}));
    EXPECT_EQ(y.dtype(), dt);
    expectNear(y.toVector<double>(), {5, 8, 9, 7}, 0);
  }
}

TEST(PoolTest, MaxPoolPaddingStrideAndCeilMatchNaive) {
  const std::vector<Pool2dOptions> cases = {
      {{3, 3}, {2, 2}, {1, 1}, false},  // ResNet stem
      {{3, 2}, {1, 2}, {1, 0}, false},  // stride != kernel, asymmetric
      {{2, 2}, {2, 2}, {0, 0}, true},   // ceil mode, partial last window
      {{3, 3}, {2, 2}, {1, 1}, true},   // ceil mode with padding
      {{2, 3}, {3, 2}, {1, 1}, true},
  };
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    for (const auto& o : cases) {
      Tensor x = distinct({2, 3, 7, 9}, 7, dt);
      expectNear(maxPool2d(x, o).toVector<double>(), naivePool(x, o, true), 1e-6);
    }
  }
}

TEST(PoolTest, MaxPoolCeilModeHandComputed) {
  // 5x5, kernel 2 stride 2 ceil: the last row/column of windows see one input row/column.
  std::vector<double> v(25);
  for (int i = 0; i < 25; ++i) v[i] = i;
  Tensor x = shaped(v, {1, 1, 5, 5});
  Tensor y = maxPool2d(x, {{2, 2}, {2, 2}, {0, 0}, true});
  EXPECT_EQ(y.shape(), (Shape{1, 1, 3, 3}));
  expectNear(y.toVector<double>(), {6, 8, 9, 16, 18, 19, 21, 23, 24}, 0);
}

TEST(PoolTest, MaxPoolBackwardRoutesToArgmax) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = shaped({1, 5, 2, 0, 3, 4, 8, 1, -1, 0, 7, 6, 2, 9, 3, 5}, {1, 1, 4, 4}, dt);
    x.setRequiresGrad();
    Tensor y = maxPool2d(x, {});
    Tensor g = gradOf(y, x, shaped({10, 20, 30, 40}, {1, 1, 2, 2}, dt));
    expectNear(g.toVector<double>(), {0, 10, 0, 0, 0, 0, 20, 0, 0, 0, 40, 0, 0, 30, 0, 0}, 0);
  }
}

TEST(PoolTest, MaxPoolOverlappingWindowsAccumulate) {
  // kernel 3 stride 1 on 3x4: both windows' maximum is the 9 at (1,1), so its gradient is the sum.
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = shaped({0, 1, 2, 3, 4, 9, 5, 6, 7, 8, 0, 1}, {1, 1, 3, 4}, dt);
    x.setRequiresGrad();
    Tensor y = maxPool2d(x, {{3, 3}, {1, 1}, {0, 0}, false});
    expectNear(y.toVector<double>(), {9, 9}, 0);
    Tensor g = gradOf(y, x, shaped({1, 2}, {1, 1, 1, 2}, dt));
    expectNear(g.toVector<double>(), {0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0}, 0);
  }
}

TEST(PoolTest, MaxPoolFloat32MatchesFloat64ForwardAndBackward) {
  const std::vector<Pool2dOptions> cases = {{{3, 3}, {2, 2}, {1, 1}, false}, {{2, 2}, {2, 2}, {0, 0}, true},
                                            {{3, 3}, {1, 1}, {1, 1}, false}};
  for (const auto& o : cases) {
    Tensor x64 = distinct({2, 4, 11, 10}, 3);
    Tensor x32 = x64.toDType(DType::kFloat32);
    x64.setRequiresGrad();
    x32.setRequiresGrad();
    Tensor y64 = maxPool2d(x64, o), y32 = maxPool2d(x32, o);
    expectNear(y32.toVector<double>(), y64.toVector<double>(), 1e-5);
    tensor::Generator gen(5);
    Tensor gy = tensor::normal(y64.shape(), 0, 1, gen, DType::kFloat64);
    expectNear(gradOf(y32, x32, gy.toDType(DType::kFloat32)).toVector<double>(), gradOf(y64, x64, gy).toVector<double>(),
               1e-5);
  }
}

TEST(PoolTest, MaxPoolOneDnnAndLoopsAgreeOnFloat32) {
  Tensor x = distinct({3, 5, 13, 12}, 11, DType::kFloat32);
  for (const auto& o : {Pool2dOptions{{3, 3}, {2, 2}, {1, 1}, false}, Pool2dOptions{{2, 2}, {2, 2}, {0, 0}, true}}) {
    kernels::Pool2dParams p{o.kernel[0], o.kernel[1], o.stride[0], o.stride[1], o.padding[0], o.padding[1], o.ceilMode};
    auto dnnl = kernels::maxPool2d(x, p, true, kernels::CpuImpl::kOneDnn);
    auto loops = kernels::maxPool2d(x, p, true, kernels::CpuImpl::kLoops);
    EXPECT_TRUE(dnnl.saved->usesOneDnn());
    EXPECT_FALSE(loops.saved->usesOneDnn());
    expectNear(dnnl.output.toVector<double>(), loops.output.toVector<double>(), 0);
    tensor::Generator gen(2);
    Tensor gy = tensor::normal(dnnl.output.shape(), 0, 1, gen);
    expectNear(kernels::maxPool2dBackward(gy, *dnnl.saved).toVector<double>(),
               kernels::maxPool2dBackward(gy, *loops.saved).toVector<double>(), 1e-6);
  }
}

TEST(PoolTest, MaxPoolPropagatesNaN) {
  Tensor x = shaped({1, std::nan(""), 2, 3}, {1, 1, 2, 2});
  EXPECT_TRUE(std::isnan(maxPool2d(x, {}).item()));
}

TEST(PoolTest, MaxPoolNonContiguousInput) {
  // A transposed view: the op must read it through its strides.
  Tensor base = distinct({1, 2, 6, 5}, 9);
  Tensor t = Tensor::fromStorage(base.storage(), {1, 2, 5, 6}, {60, 30, 1, 5}, 0, DType::kFloat64);
  ASSERT_FALSE(t.isContiguous());
  Pool2dOptions o{{2, 2}, {2, 2}, {0, 0}, false};
  expectNear(maxPool2d(t, o).toVector<double>(), naivePool(t.cloneData(), o, true), 0);
}

TEST(PoolTest, MaxPoolGradcheck) {
  const std::vector<Pool2dOptions> cases = {{{3, 3}, {2, 2}, {1, 1}, false}, {{2, 3}, {1, 2}, {1, 1}, true},
                                            {{2, 2}, {2, 2}, {0, 0}, true}};
  for (const auto& o : cases) {
    Tensor x = distinct({2, 2, 5, 6}, 4);
    x.setRequiresGrad();
    auto r = autograd::gradcheck([&](const std::vector<Tensor>& in) { return maxPool2d(in[0], o); }, {x});
    EXPECT_TRUE(r.ok) << r.message;
  }
}

// ---------------------------------------------------------------- average pooling

TEST(PoolTest, AvgPoolCountsPaddingInDivisor) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = shaped({1, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 1, 3, 3}, dt);
    Tensor y = avgPool2d(x, {{3, 3}, {1, 1}, {1, 1}, false});
    // Corner: (1+2+4+5)/9; edge: (1+2+3+4+5+6)/9; centre: 45/9.
    expectNear(y.toVector<double>(),
               {12.0 / 9, 21.0 / 9, 16.0 / 9, 27.0 / 9, 5, 33.0 / 9, 24.0 / 9, 39.0 / 9, 28.0 / 9}, 1e-6);
  }
}

TEST(PoolTest, AvgPoolCeilOverhangIsNotCounted) {
  // 5x5, kernel 2 stride 2 ceil: the last column window holds one real column; the overhang beyond the
  // (zero) padding is not counted, so it averages 2 cells (PyTorch), not 4.
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    std::vector<double> v(25);
    for (int i = 0; i < 25; ++i) v[i] = i;
    Tensor x = shaped(v, {1, 1, 5, 5}, dt);
    Tensor y = avgPool2d(x, {{2, 2}, {2, 2}, {0, 0}, true});
    expectNear(y.toVector<double>(), {3, 5, 6.5, 13, 15, 16.5, 20.5, 22.5, 24}, 1e-6);
  }
}

TEST(PoolTest, AvgPoolMatchesNaive) {
  const std::vector<Pool2dOptions> cases = {{{3, 3}, {2, 2}, {1, 1}, false}, {{2, 3}, {1, 2}, {1, 1}, false},
                                            {{3, 3}, {2, 2}, {1, 1}, true}, {{2, 2}, {3, 3}, {1, 0}, true}};
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    for (const auto& o : cases) {
      tensor::Generator gen(21);
      Tensor x = tensor::normal({2, 3, 8, 7}, 0, 1, gen, dt);
      expectNear(avgPool2d(x, o).toVector<double>(), naivePool(x, o, false), 1e-5);
    }
  }
}

TEST(PoolTest, AvgPoolBackwardHandComputed) {
  // Non-overlapping 2x2 windows: every cell gets a quarter of its window's gradient.
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = Tensor::zeros({1, 1, 2, 4}, dt);
    x.setRequiresGrad();
    Tensor y = avgPool2d(x, {});
    Tensor g = gradOf(y, x, shaped({4, 8}, {1, 1, 1, 2}, dt));
    expectNear(g.toVector<double>(), {1, 1, 2, 2, 1, 1, 2, 2}, 0);
  }
}

TEST(PoolTest, AvgPoolOneDnnAndLoopsAgreeOnFloat32) {
  tensor::Generator gen(8);
  Tensor x = tensor::normal({3, 4, 12, 9}, 0, 1, gen);
  for (const auto& o : {Pool2dOptions{{3, 3}, {2, 2}, {1, 1}, false}, Pool2dOptions{{2, 2}, {1, 1}, {1, 1}, false}}) {
    kernels::Pool2dParams p{o.kernel[0], o.kernel[1], o.stride[0], o.stride[1], o.padding[0], o.padding[1], o.ceilMode};
    Tensor a = kernels::avgPool2d(x, p, kernels::CpuImpl::kOneDnn);
    Tensor b = kernels::avgPool2d(x, p, kernels::CpuImpl::kLoops);
    expectNear(a.toVector<double>(), b.toVector<double>(), 1e-5);
    Tensor gy = tensor::normal(a.shape(), 0, 1, gen);
    expectNear(kernels::avgPool2dBackward(gy, x.shape(), p, kernels::CpuImpl::kOneDnn).toVector<double>(),
               kernels::avgPool2dBackward(gy, x.shape(), p, kernels::CpuImpl::kLoops).toVector<double>(), 1e-5);
  }
}

TEST(PoolTest, AvgPoolFloat32MatchesFloat64Backward) {
  Pool2dOptions o{{3, 3}, {2, 2}, {1, 1}, true};
  tensor::Generator gen(12);
  Tensor x64 = tensor::normal({2, 3, 9, 8}, 0, 1, gen, DType::kFloat64);
  Tensor x32 = x64.toDType(DType::kFloat32);
  x64.setRequiresGrad();
  x32.setRequiresGrad();
  Tensor y64 = avgPool2d(x64, o), y32 = avgPool2d(x32, o);
  expectNear(y32.toVector<double>(), y64.toVector<double>(), 1e-5);
  Tensor gy = tensor::normal(y64.shape(), 0, 1, gen, DType::kFloat64);
  expectNear(gradOf(y32, x32, gy.toDType(DType::kFloat32)).toVector<double>(), gradOf(y64, x64, gy).toVector<double>(),
             1e-5);
}

TEST(PoolTest, AvgPoolGradcheck) {
  const std::vector<Pool2dOptions> cases = {{{3, 3}, {2, 2}, {1, 1}, false}, {{2, 3}, {1, 2}, {1, 1}, true},
                                            {{2, 2}, {2, 2}, {0, 0}, true}};
  for (const auto& o : cases) {
    tensor::Generator gen(13);
    Tensor x = tensor::normal({2, 2, 5, 6}, 0, 1, gen, DType::kFloat64);
    x.setRequiresGrad();
    auto r = autograd::gradcheck([&](const std::vector<Tensor>& in) { return avgPool2d(in[0], o); }, {x});
    EXPECT_TRUE(r.ok) << r.message;
  }
}

// ---------------------------------------------------------------- adaptive average pooling

TEST(PoolTest, AdaptiveAvgPoolNonDivisibleHandComputed) {
  // 1x5 -> 1x3: windows [0,2), [1,4), [3,5).
  Tensor x = shaped({1, 2, 3, 4, 5}, {1, 1, 1, 5});
  Tensor y = adaptiveAvgPool2d(x, {1, 3});
  expectNear(y.toVector<double>(), {1.5, 3, 4.5}, 1e-12);
  // 5x7 -> 3x4 against the window formula.
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    tensor::Generator gen(14);
    Tensor a = tensor::normal({2, 3, 5, 7}, 0, 1, gen, dt);
    const auto v = a.toVector<double>();
    std::vector<double> expected;
    for (int64_t p = 0; p < 6; ++p) {
      for (int64_t i = 0; i < 3; ++i) {
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t h0 = i * 5 / 3, h1 = ((i + 1) * 5 + 2) / 3, w0 = j * 7 / 4, w1 = ((j + 1) * 7 + 3) / 4;
          double s = 0;
          for (int64_t h = h0; h < h1; ++h) {
            for (int64_t w = w0; w < w1; ++w) s += v[static_cast<size_t>(p * 35 + h * 7 + w)];
          }
          expected.push_back(s / static_cast<double>((h1 - h0) * (w1 - w0)));
        }
      }
    }
    expectNear(adaptiveAvgPool2d(a, {3, 4}).toVector<double>(), expected, 1e-5);
  }
}

TEST(PoolTest, AdaptiveAvgPoolGlobalAndUpsampling) {
  Tensor x = shaped({1, 2, 3, 4, 5, 6, 7, 8}, {1, 2, 2, 2});
  expectNear(adaptiveAvgPool2d(x, {1, 1}).toVector<double>(), {2.5, 6.5}, 1e-12);
  // Output larger than input: cells repeat.
  Tensor small = shaped({1, 2}, {1, 1, 1, 2});
  expectNear(adaptiveAvgPool2d(small, {2, 3}).toVector<double>(), {1, 1.5, 2, 1, 1.5, 2}, 1e-12);
}

TEST(PoolTest, AdaptiveAvgPoolGradcheck) {
  for (Pair out : {Pair{3, 4}, Pair{1, 1}, Pair{4, 2}}) {
    tensor::Generator gen(15);
    Tensor x = tensor::normal({2, 2, 5, 7}, 0, 1, gen, DType::kFloat64);
    x.setRequiresGrad();
    auto r = autograd::gradcheck([&](const std::vector<Tensor>& in) { return adaptiveAvgPool2d(in[0], out); }, {x});
    EXPECT_TRUE(r.ok) << r.message;
  }
}

TEST(PoolTest, AdaptiveAvgPoolFloat32MatchesFloat64Backward) {
  tensor::Generator gen(16);
  Tensor x64 = tensor::normal({2, 3, 7, 7}, 0, 1, gen, DType::kFloat64);
  Tensor x32 = x64.toDType(DType::kFloat32);
  x64.setRequiresGrad();
  x32.setRequiresGrad();
  Tensor y64 = adaptiveAvgPool2d(x64, {3, 2}), y32 = adaptiveAvgPool2d(x32, {3, 2});
  Tensor gy = tensor::normal(y64.shape(), 0, 1, gen, DType::kFloat64);
  expectNear(gradOf(y32, x32, gy.toDType(DType::kFloat32)).toVector<double>(), gradOf(y64, x64, gy).toVector<double>(),
             1e-5);
}

// ---------------------------------------------------------------- edge cases

TEST(PoolTest, EmptyBatch) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = Tensor::zeros({0, 3, 6, 6}, dt);
    x.setRequiresGrad();
    Tensor y = maxPool2d(x, {{3, 3}, {2, 2}, {1, 1}, false});
    EXPECT_EQ(y.shape(), (Shape{0, 3, 3, 3}));
    EXPECT_EQ(gradOf(y, x, Tensor::zeros(y.shape(), dt)).shape(), x.shape());
    EXPECT_EQ(avgPool2d(x, {}).shape(), (Shape{0, 3, 3, 3}));
    EXPECT_EQ(adaptiveAvgPool2d(x, {2, 2}).shape(), (Shape{0, 3, 2, 2}));
  }
}

TEST(PoolTest, ThreadedLoopsMatchSingleThreaded) {
  // float64 runs on the loops, which split planes across OpenMP threads when the process allows more.
  Tensor x = distinct({4, 6, 9, 9}, 17);
  x.setRequiresGrad();
  Pool2dOptions o{{3, 3}, {2, 2}, {1, 1}, true};
  auto run = [&] {
    std::vector<std::vector<double>> r;
    for (Tensor y : {maxPool2d(x, o), avgPool2d(x, o), adaptiveAvgPool2d(x, {4, 5})}) {
      r.push_back(y.toVector<double>());
      r.push_back(gradOf(y, x, Tensor::ones(y.shape(), DType::kFloat64)).toVector<double>());
    }
    return r;
  };
  auto single = run();
  tensor::setNumThreads(2);
  auto threaded = run();
  tensor::setNumThreads(1);
  EXPECT_EQ(single, threaded);
}

// ---------------------------------------------------------------- errors

TEST(PoolTest, BadArgumentsThrow) {
  Tensor x = Tensor::zeros({1, 1, 4, 4});
  expectValueError([&] { maxPool2d(Tensor::zeros({1, 4, 4}), {}); }, "maxPool2d: expected x of rank 4");
  expectValueError([&] { avgPool2d(Tensor::zeros({4, 4}), {}); }, "avgPool2d: expected x of rank 4");
  expectValueError([&] { maxPool2d(x, {{0, 2}, {0, 0}, {0, 0}, false}); }, "maxPool2d: kernel must be positive");
  expectValueError([&] { maxPool2d(x, {{2, 2}, {-1, 1}, {0, 0}, false}); }, "maxPool2d: stride");
  expectValueError([&] { avgPool2d(x, {{2, 2}, {2, 2}, {2, 0}, false}); }, "at most half the kernel");
  expectValueError([&] { maxPool2d(x, {{5, 5}, {1, 1}, {0, 0}, false}); }, "too small");
  expectValueError([&] { maxPool2d(Tensor::zeros({1, 1, 4, 4}, DType::kInt64), {}); }, "float32 or float64");
  expectValueError([&] { adaptiveAvgPool2d(x, {0, 2}); }, "adaptiveAvgPool2d: output size must be positive");
  expectValueError([&] { adaptiveAvgPool2d(Tensor::zeros({1, 4, 4}), {1, 1}); }, "adaptiveAvgPool2d: expected x");
}

}  // namespace
}  // namespace distgrad
