// conv2d: values against hand-computed results and a naive direct-convolution reference, the float32
// oneDNN path (every memory layout) against the float64 reference path, float64 gradchecks over option
// combinations (stride, padding, dilation, groups, bias) and bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "autograd_test_util.h"
#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "tensor/cpu/conv.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/random.h"

namespace distgrad {
namespace {

using autograd_testing::randn;
using autograd_testing::leaf;
using autograd_testing::expectNear;
using autograd_testing::errorOf;

namespace kernels = tensor::kernels;

kernels::Conv2dParams paramsOf(const Conv2dOptions& o) {
  kernels::Conv2dParams p;
  p.stride = o.stride;
  p.padding = o.padding;
  p.dilation = o.dilation;
  p.groups = o.groups;
  return p;
}

// Direct 7-loop convolution in float64 (independent of the im2col reference inside the kernels).
std::vector<double> naiveConv(const Tensor& x, const Tensor& w, const Tensor& bias, const Conv2dOptions& o,
                              Shape& outShape) {
  const auto xv = x.toVector<double>(), wv = w.toVector<double>();
  const std::vector<double> bv = bias.defined() ? bias.toVector<double>() : std::vector<double>();
  const int64_t n = x.shape()[0], c = x.shape()[1], h = x.shape()[2], wd = x.shape()[3];
  const int64_t oc = w.shape()[0], cg = w.shape()[1], kh = w.shape()[2], kw = w.shape()[3];
  const int64_t og = oc / o.groups;
  const int64_t oh = (h + 2 * o.padding[0] - o.dilation[0] * (kh - 1) - 1) / o.stride[0] + 1;
  const int64_t ow = (wd + 2 * o.padding[1] - o.dilation[1] * (kw - 1) - 1) / o.stride[1] + 1;
  outShape = {n, oc, oh, ow};
  std::vector<double> y(static_cast<size_t>(n * oc * oh * ow), 0.0);
  for (int64_t b = 0; b < n; ++b)
    for (int64_t o2 = 0; o2 < oc; ++o2) {
      const int64_t g = o2 / og;
      for (int64_t i = 0; i < oh; ++i)
        for (int64_t j = 0; j < ow; ++j) {
          double s = bv.empty() ? 0.0 : bv[o2];
          for (int64_t ci = 0; ci < cg; ++ci)
            for (int64_t p = 0; p < kh; ++p)
              for (int64_t q = 0; q < kw; ++q) {
                const int64_t iy = i * o.stride[0] - o.padding[0] + p * o.dilation[0];
                const int64_t ix = j * o.stride[1] - o.padding[1] + q * o.dilation[1];
                if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
                s += xv[((b * c + g * cg + ci) * h + iy) * wd + ix] * wv[((o2 * cg + ci) * kh + p) * kw + q];
              }
          y[((b * oc + o2) * oh + i) * ow + j] = s;
        }
    }
  return y;
}

Conv2dOptions opts(Pair stride, Pair padding, Pair dilation, int64_t groups) {
  Conv2dOptions o;
  o.stride = stride;
  o.padding = padding;
  o.dilation = dilation;
  o.groups = groups;
  return o;
}

struct ConvCase {
  Shape x, w;
  Conv2dOptions o;
  bool bias;
  std::string name;
};

// Non-square images and kernels, batch > 1, every option on its own and combined.
const std::vector<ConvCase> kCases = {
    {{2, 3, 7, 6}, {4, 3, 3, 3}, opts({1, 1}, {0, 0}, {1, 1}, 1), true, "plain 3x3"},
    {{2, 3, 7, 6}, {4, 3, 3, 2}, opts({1, 1}, {1, 1}, {1, 1}, 1), false, "pad 1, 3x2 kernel"},
    {{2, 4, 9, 8}, {6, 4, 3, 3}, opts({2, 2}, {1, 1}, {1, 1}, 1), true, "stride 2"},
    {{1, 2, 9, 10}, {3, 2, 3, 3}, opts({2, 1}, {0, 2}, {1, 1}, 1), true, "asymmetric stride/pad"},
    {{2, 2, 9, 9}, {3, 2, 3, 3}, opts({1, 1}, {2, 2}, {2, 2}, 1), true, "dilation 2"},
    {{2, 2, 10, 8}, {2, 2, 2, 3}, opts({1, 2}, {1, 0}, {3, 2}, 1), false, "dilation 3x2"},
    {{2, 4, 6, 7}, {6, 2, 3, 3}, opts({1, 1}, {1, 1}, {1, 1}, 2), true, "groups 2"},
    {{2, 4, 8, 8}, {4, 1, 3, 3}, opts({2, 2}, {1, 1}, {1, 1}, 4), true, "depthwise stride 2"},
    {{1, 6, 7, 9}, {3, 2, 2, 2}, opts({2, 1}, {1, 1}, {2, 1}, 3), false, "groups 3 + dilation + stride"},
    {{3, 5, 5, 5}, {7, 5, 1, 1}, opts({1, 1}, {0, 0}, {1, 1}, 1), true, "1x1"},
};

// ---------------------------------------------------------------- values

TEST(Conv2d, HandComputed) {
  // y[i,j] = x[i,j] + x[i+1,j+1] + 0.5 for a diagonal 2x2 kernel.
  Tensor x = Tensor::fromVector({1, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 1, 3, 3});
  Tensor w = Tensor::fromVector({1, 0, 0, 1}, {1, 1, 2, 2});
  Tensor b = Tensor::fromVector({0.5f}, {1});
  Tensor y = conv2d(x, w, b);
  EXPECT_EQ(y.shape(), (Shape{1, 1, 2, 2}));
  EXPECT_EQ(y.toVector<float>(), (std::vector<float>{6.5f, 8.5f, 12.5f, 14.5f}));
  // Padding 1, stride 2: the corners of the padded 5x5 grid.
  Tensor y2 = conv2d(x, w, Tensor(), opts({2, 2}, {1, 1}, {1, 1}, 1));
  EXPECT_EQ(y2.shape(), (Shape{1, 1, 2, 2}));
  EXPECT_EQ(y2.toVector<float>(), (std::vector<float>{1, 3, 7, 14}));
  // Same in float64.
  Tensor y64 = conv2d(x.toDType(DType::kFloat64), w.toDType(DType::kFloat64), b.toDType(DType::kFloat64));
  EXPECT_EQ(y64.toVector<double>(), (std::vector<double>{6.5, 8.5, 12.5, 14.5}));
}

TEST(Conv2d, Float64MatchesNaiveReference) {
  uint64_t seed = 1;
  for (const auto& c : kCases) {
    Tensor x = randn(c.x, seed++), w = randn(c.w, seed++), b = c.bias ? randn({c.w[0]}, seed++) : Tensor();
    Shape shape;
    std::vector<double> ref = naiveConv(x, w, b, c.o, shape);
    Tensor y = conv2d(x, w, b, c.o);
    EXPECT_EQ(y.shape(), shape) << c.name;
    expectNear(y, ref, 1e-12, c.name);
  }
}

TEST(Conv2d, Float32OneDnnMatchesReferenceInEveryLayout) {
  uint64_t seed = 100;
  for (const auto& c : kCases) {
    Tensor x = randn(c.x, seed++), w = randn(c.w, seed++), b = c.bias ? randn({c.w[0]}, seed++) : Tensor();
    Shape shape;
    std::vector<double> ref = naiveConv(x, w, b, c.o, shape);
    Tensor x32 = x.toDType(DType::kFloat32), w32 = w.toDType(DType::kFloat32);
    Tensor b32 = b.defined() ? b.toDType(DType::kFloat32) : Tensor();
    for (auto layout : {kernels::ConvLayout::kBlocked, kernels::ConvLayout::kPlain, kernels::ConvLayout::kChannelsLast}) {
      Tensor y = kernels::conv2d(x32, w32, b32, paramsOf(c.o), layout);
      EXPECT_EQ(y.shape(), shape) << c.name;
      EXPECT_EQ(y.dtype(), DType::kFloat32);
      expectNear(y, ref, 1e-4, c.name + " layout " + std::to_string(static_cast<int>(layout)));
    }
    // Through the differentiable op (default layout), twice: the second call reuses the cached plan.
    expectNear(conv2d(x32, w32, b32, c.o), ref, 1e-4, c.name + " op");
    expectNear(conv2d(x32, w32, b32, c.o), ref, 1e-4, c.name + " op, cached");
  }
}

TEST(Conv2d, Float32GradientsMatchFloat64InEveryLayout) {
  uint64_t seed = 200;
  for (const auto& c : kCases) {
    Tensor x = randn(c.x, seed++), w = randn(c.w, seed++);
    Shape yShape = kernels::conv2dOutputShape(c.x, c.w, paramsOf(c.o));
    Tensor g = randn(yShape, seed++);
    const auto p = paramsOf(c.o);
    Tensor dx64 = kernels::conv2dBackwardInput(g, w, c.x, p);
    auto [dw64, db64] = kernels::conv2dBackwardWeight(g, x, c.w, p, true);
    Tensor g32 = g.toDType(DType::kFloat32);
    for (auto layout : {kernels::ConvLayout::kBlocked, kernels::ConvLayout::kPlain, kernels::ConvLayout::kChannelsLast}) {
      const std::string what = c.name + " layout " + std::to_string(static_cast<int>(layout));
      Tensor dx32 = kernels::conv2dBackwardInput(g32, w.toDType(DType::kFloat32), c.x, p, layout);
      expectNear(dx32, dx64.toVector<double>(), 1e-4, what + " dx");
      auto [dw32, db32] = kernels::conv2dBackwardWeight(g32, x.toDType(DType::kFloat32), c.w, p, true, layout);
      expectNear(dw32, dw64.toVector<double>(), 1e-4, what + " dw");
      expectNear(db32, db64.toVector<double>(), 1e-4, what + " db");
      auto [dwOnly, none] = kernels::conv2dBackwardWeight(g32, x.toDType(DType::kFloat32), c.w, p, false, layout);
      EXPECT_FALSE(none.defined());
      expectNear(dwOnly, dw64.toVector<double>(), 1e-4, what + " dw without bias");
    }
    expectNear(kernels::conv2dBackwardBias(g32), db64.toVector<double>(), 1e-4, c.name + " bias only");
  }
}

TEST(Conv2d, ResNetShapesFloat32MatchFloat64) {
  // The shapes the benchmark and ResNet-18 on 32x32 inputs use (smaller batch to stay fast).
  for (int64_t ch : {64, 128}) {
    const int64_t hw = ch == 64 ? 8 : 4;
    Tensor x = randn({2, ch, hw, hw}, 300 + ch), w = randn({ch, ch, 3, 3}, 400 + ch);
    Conv2dOptions o = opts({1, 1}, {1, 1}, {1, 1}, 1);
    Tensor y32 = conv2d(x.toDType(DType::kFloat32), w.toDType(DType::kFloat32), Tensor(), o);
    Tensor y64 = conv2d(x, w, Tensor(), o);
    expectNear(y32, y64.toVector<double>(), 2e-4, "resnet " + std::to_string(ch));
  }
}

TEST(Conv2d, NonContiguousInputs) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    // x as an NHWC buffer viewed as NCHW (permuted strides), and every other image of a larger batch.
    Tensor nhwc = randn({2, 5, 6, 3}, 501, dt);
    Tensor x = Tensor::fromStorage(nhwc.storage(), {2, 3, 5, 6}, {90, 1, 18, 3}, 0, dt);
    ASSERT_FALSE(x.isContiguous());
    Tensor w = randn({4, 3, 3, 3}, 502, dt);
    Conv2dOptions o = opts({1, 1}, {1, 1}, {1, 1}, 1);
    Shape shape;
    std::vector<double> ref = naiveConv(x.cloneData(), w, Tensor(), o, shape);
    expectNear(conv2d(x, w, Tensor(), o), ref, 1e-4, "permuted input");
    Tensor big = randn({4, 3, 5, 6}, 503, dt);
    Tensor everyOther = Tensor::fromStorage(big.storage(), {2, 3, 5, 6}, {180, 30, 6, 1}, 0, dt);
    std::vector<double> ref2 = naiveConv(everyOther.cloneData(), w, Tensor(), o, shape);
    expectNear(conv2d(everyOther, w, Tensor(), o), ref2, 1e-4, "strided batch");
  }
}

TEST(Conv2d, BackwardThroughAutogradMatchesKernels) {
  Tensor x = leaf(randn({2, 4, 6, 6}, 601, DType::kFloat32));
  Tensor w = leaf(randn({6, 2, 3, 3}, 602, DType::kFloat32));
  Tensor b = leaf(randn({6}, 603, DType::kFloat32));
  Conv2dOptions o = opts({1, 1}, {1, 1}, {1, 1}, 2);
  Tensor y = conv2d(x, w, b, o);
  Tensor g = randn(y.shape(), 604, DType::kFloat32);
  auto grads = autograd::grad({y}, {x, w, b}, {g});
  const auto p = paramsOf(o);
  expectNear(grads[0], kernels::conv2dBackwardInput(g, w, x.shape(), p).toVector<double>(), 1e-6, "dx");
  auto [dw, db] = kernels::conv2dBackwardWeight(g, x, w.shape(), p, true);
  expectNear(grads[1], dw.toVector<double>(), 1e-6, "dw");
  expectNear(grads[2], db.toVector<double>(), 1e-6, "db");
  // Only the bias requires grad: the bias-only path.
  Tensor xd = x.detach(), wd = w.detach();
  Tensor y2 = conv2d(xd, wd, b, o);
  auto gb = autograd::grad({y2}, {b}, {g});
  expectNear(gb[0], db.toVector<double>(), 1e-5, "db only");
}

// ---------------------------------------------------------------- gradchecks

TEST(Conv2d, GradcheckOptionCombinations) {
  // Small versions of the cases (gradcheck costs two forwards per input element).
  const std::vector<ConvCase> cases = {
      {{2, 2, 4, 5}, {3, 2, 2, 3}, opts({1, 1}, {0, 0}, {1, 1}, 1), true, "plain"},
      {{1, 2, 5, 4}, {2, 2, 3, 3}, opts({2, 1}, {1, 1}, {1, 1}, 1), true, "stride + pad"},
      {{1, 2, 6, 6}, {2, 2, 2, 2}, opts({1, 2}, {1, 0}, {2, 3}, 1), false, "dilation"},
      {{2, 4, 4, 4}, {4, 2, 3, 3}, opts({1, 1}, {1, 1}, {1, 1}, 2), true, "groups 2"},
      {{1, 3, 5, 5}, {3, 1, 3, 3}, opts({2, 2}, {1, 1}, {2, 2}, 3), false, "depthwise + dilation + stride"},
  };
  for (const auto& c : cases) {
    Tensor x = leaf(randn(c.x, 700)), w = leaf(randn(c.w, 701));
    std::vector<Tensor> inputs{x, w};
    if (c.bias) inputs.push_back(leaf(randn({c.w[0]}, 702)));
    const Conv2dOptions o = c.o;
    auto r = autograd::gradcheck(
        [o](const std::vector<Tensor>& in) { return conv2d(in[0], in[1], in.size() > 2 ? in[2] : Tensor(), o); },
        inputs);
    EXPECT_TRUE(r.ok) << c.name << ": " << r.message;
  }
}

// ---------------------------------------------------------------- bad inputs

TEST(Conv2d, BadInputs) {
  Tensor x = Tensor::zeros({1, 4, 5, 5}), w = Tensor::zeros({2, 4, 3, 3});
  std::string msg = errorOf([&] { conv2d(Tensor::zeros({4, 5, 5}), w); });
  EXPECT_NE(msg.find("conv2d"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4-D"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, Tensor::zeros({2, 4, 3})); });
  EXPECT_NE(msg.find("weight must be 4-D"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, Tensor::zeros({2, 3, 3, 3})); });
  EXPECT_NE(msg.find("[1, 4, 5, 5]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3, 3, 3]"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, Tensor::zeros({3, 2, 3, 3}), Tensor(), opts({1, 1}, {0, 0}, {1, 1}, 3)); });
  EXPECT_NE(msg.find("groups (3) must divide the input channels (4)"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, Tensor::zeros({3, 2, 3, 3}), Tensor(), opts({1, 1}, {0, 0}, {1, 1}, 2)); });
  EXPECT_NE(msg.find("groups (2) must divide the output channels (3)"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, w, Tensor::zeros({3})); });
  EXPECT_NE(msg.find("bias"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, w.toDType(DType::kFloat64)); });
  EXPECT_NE(msg.find("dtype"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, Tensor::zeros({2, 4, 7, 7})); });
  EXPECT_NE(msg.find("smaller than the dilated kernel"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, w, Tensor(), opts({0, 1}, {0, 0}, {1, 1}, 1)); });
  EXPECT_NE(msg.find("stride must be >= 1"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, w, Tensor(), opts({1, 1}, {-1, 0}, {1, 1}, 1)); });
  EXPECT_NE(msg.find("padding must be >= 0"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, w, Tensor(), opts({1, 1}, {0, 0}, {0, 1}, 1)); });
  EXPECT_NE(msg.find("dilation must be >= 1"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x, w, Tensor(), opts({1, 1}, {0, 0}, {1, 1}, 0)); });
  EXPECT_NE(msg.find("groups must be >= 1"), std::string::npos) << msg;
  msg = errorOf([&] { conv2d(x.toDType(DType::kInt64), w.toDType(DType::kInt64)); });
  EXPECT_NE(msg.find("float32 or float64"), std::string::npos) << msg;
}

TEST(Conv2d, ConcurrentThreadsAndThreadCounts) {
  // Plans and buffers are per thread and primitives run with user scratchpads: concurrent convolutions on
  // several threads must agree with the reference; so must a plan created after the thread count changes.
  Tensor x = randn({2, 16, 6, 6}, 801), w = randn({8, 16, 3, 3}, 802), b = randn({8}, 803);
  Conv2dOptions o = opts({1, 1}, {1, 1}, {1, 1}, 1);
  Shape shape;
  const std::vector<double> ref = naiveConv(x, w, b, o, shape);
  Tensor x32 = x.toDType(DType::kFloat32), w32 = w.toDType(DType::kFloat32), b32 = b.toDType(DType::kFloat32);
  std::vector<std::vector<double>> results(3);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < results.size(); ++i) {
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < 5; ++rep) results[i] = conv2d(x32, w32, b32, o).toVector<double>();
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& r : results) {
    ASSERT_EQ(r.size(), ref.size());
    for (size_t j = 0; j < r.size(); ++j) ASSERT_NEAR(r[j], ref[j], 1e-4 * (1 + std::abs(ref[j])));
  }
  tensor::setNumThreads(2);
  Tensor y2 = conv2d(x32, w32, b32, o);
  tensor::setNumThreads(1);
  expectNear(y2, ref, 1e-4, "two threads");
}

TEST(Conv2d, AutoLayoutFollowsTheMeasuredRule) {
  kernels::Conv2dParams same;
  same.padding = {1, 1};
  kernels::Conv2dParams down = same;
  down.stride = {2, 2};
  using L = kernels::ConvLayout;
  EXPECT_EQ(kernels::chooseConvLayout({32, 3, 32, 32}, {64, 3, 3, 3}, same), L::kPlain);
  EXPECT_EQ(kernels::chooseConvLayout({32, 64, 8, 8}, {64, 64, 3, 3}, same), L::kChannelsLast);
  EXPECT_EQ(kernels::chooseConvLayout({32, 64, 8, 8}, {128, 64, 3, 3}, down), L::kBlocked);
  EXPECT_EQ(kernels::chooseConvLayout({32, 256, 2, 2}, {256, 256, 3, 3}, same), L::kBlocked);
  kernels::Conv2dParams grouped = same;
  grouped.groups = 64;
  EXPECT_EQ(kernels::chooseConvLayout({32, 64, 8, 8}, {64, 1, 3, 3}, grouped), L::kBlocked);
}

TEST(Conv2d, EmptyBatch) {
  Tensor y = conv2d(Tensor::zeros({0, 2, 5, 5}), Tensor::zeros({3, 2, 3, 3}), Tensor::ones({3}));
  EXPECT_EQ(y.shape(), (Shape{0, 3, 3, 3}));
}

}  // namespace
}  // namespace distgrad
