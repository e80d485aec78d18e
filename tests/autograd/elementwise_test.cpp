// Elementwise ops: values against hand-computed numbers and reference loops, broadcasting (including the
// fast paths), non-contiguous inputs, errors, and a float64 gradcheck for every differentiable op.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "tensor/random.h"
#include "test_util.h"

namespace distgrad {
namespace {

using namespace distgrad::testing;

// Random values in [lo, hi] (for ops defined only on part of the line).
Tensor randu(const Shape& shape, uint64_t seed, double lo, double hi) {
  tensor::Generator gen(seed);
  Tensor t = tensor::uniform(shape, lo, hi, gen, DType::kFloat64);
  t.setRequiresGrad();
  return t;
}

// ---------------------------------------------------------------- values

TEST(Elementwise, BinarySameShapeValues) {
  Tensor a = Tensor::fromVector({1, 2, 3, 4}, {2, 2});
  Tensor b = Tensor::fromVector({5, 6, 7, 8}, {2, 2});
  expectValues(a + b, {2, 2}, {6, 8, 10, 12});
  expectValues(a - b, {2, 2}, {-4, -4, -4, -4});
  expectValues(a * b, {2, 2}, {5, 12, 21, 32});
  expectValues(a / b, {2, 2}, {0.2, 2.0 / 6, 3.0 / 7, 0.5});
  EXPECT_EQ((a + b).dtype(), DType::kFloat32);
}

TEST(Elementwise, ScalarForms) {
  Tensor a = Tensor::fromVector({1, -2, 3}, {3});
  expectValues(a + 1.5, {3}, {2.5, -0.5, 4.5});
  expectValues(2.0 + a, {3}, {3, 0, 5});
  expectValues(a - 1.0, {3}, {0, -3, 2});
  expectValues(10.0 - a, {3}, {9, 12, 7});
  expectValues(a * 3.0, {3}, {3, -6, 9});
  expectValues(-2.0 * a, {3}, {-2, 4, -6});
  expectValues(a / 4.0, {3}, {0.25, -0.5, 0.75});
  expectValues(-a, {3}, {-1, 2, -3});
}

TEST(Elementwise, BroadcastRowColumnAndScalar) {
  Tensor m = Tensor::fromVector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor row = Tensor::fromVector({10, 20, 30}, {3});
  Tensor col = Tensor::fromVector({100, 200}, {2, 1});
  expectValues(m + row, {2, 3}, {11, 22, 33, 14, 25, 36});
  expectValues(row + m, {2, 3}, {11, 22, 33, 14, 25, 36});
  expectValues(m * col, {2, 3}, {100, 200, 300, 800, 1000, 1200});
  expectValues(col - m, {2, 3}, {99, 98, 97, 196, 195, 194});
  // outer product via broadcasting both operands: [2,1] * [3] -> [2,3]
  expectValues(col * row, {2, 3}, {1000, 2000, 3000, 2000, 4000, 6000});
  Tensor s = Tensor::scalar(2.0);
  expectValues(m / s, {2, 3}, {0.5, 1, 1.5, 2, 2.5, 3});
  expectValues(s - m, {2, 3}, {1, 0, -1, -2, -3, -4});
  Tensor one = Tensor::fromVector({3}, {1});
  expectValues(m * one, {2, 3}, {3, 6, 9, 12, 15, 18});
  // rank promotion: [3] + [] -> [3]; [] + [] -> []
  expectValues(row + s, {3}, {12, 22, 32});
  expectValues(s + s, {}, {4});
}

// Reference: out[i] = a[bcast i] op b[bcast i] by explicit index arithmetic, for 4-d shapes.
std::vector<double> reference4d(const Tensor& a, const Tensor& b, const Shape& out,
                                const std::function<double(double, double)>& f) {
  auto idx = [](const Tensor& t, int64_t n, int64_t c, int64_t h, int64_t w) {
    int64_t i[4] = {n, c, h, w};
    int64_t lead = 4 - t.dim();
    int64_t off = 0;
    for (int64_t d = 0; d < t.dim(); ++d) off += (t.shape()[d] == 1 ? 0 : i[lead + d]) * t.strides()[d];
    return off;
  };
  auto av = a.toVector<double>();  // a, b are contiguous here
  auto bv = b.toVector<double>();
  std::vector<double> r;
  for (int64_t n = 0; n < out[0]; ++n)
    for (int64_t c = 0; c < out[1]; ++c)
      for (int64_t h = 0; h < out[2]; ++h)
        for (int64_t w = 0; w < out[3]; ++w) r.push_back(f(av[idx(a, n, c, h, w)], bv[idx(b, n, c, h, w)]));
  return r;
}

TEST(Elementwise, BroadcastPatternsMatchReference) {
  struct Case {
    Shape a, b, out;
  };
  const std::vector<Case> cases = {
      {{4, 3, 5, 6}, {1, 3, 1, 1}, {4, 3, 5, 6}},  // per-channel scale (NCHW * [1,C,1,1])
      {{4, 3, 5, 6}, {3, 1, 1}, {4, 3, 5, 6}},     // rank promotion
      {{4, 3, 5, 6}, {6}, {4, 3, 5, 6}},           // row
      {{4, 1, 5, 1}, {1, 3, 1, 6}, {4, 3, 5, 6}},  // both broadcast, interleaved
      {{4, 3, 1, 6}, {4, 3, 5, 6}, {4, 3, 5, 6}},  // broadcast in the middle, left operand
      {{1, 1, 1, 1}, {4, 3, 5, 6}, {4, 3, 5, 6}},  // one-element left operand
  };
  for (const auto& c : cases) {
    for (DType dt : {DType::kFloat32, DType::kFloat64}) {
      Tensor a = randn(c.a, 1, dt, false);
      Tensor b = randn(c.b, 2, dt, false);
      auto tol = dt == DType::kFloat32 ? 1e-5 : 1e-12;
      expectValues(a + b, c.out, reference4d(a, b, c.out, [](double x, double y) { return x + y; }), tol);
      expectValues(a * b, c.out, reference4d(a, b, c.out, [](double x, double y) { return x * y; }), tol);
      expectValues(a - b, c.out, reference4d(a, b, c.out, [](double x, double y) { return x - y; }), tol);
      expectValues(maximum(a, b), c.out,
                   reference4d(a, b, c.out, [](double x, double y) { return std::max(x, y); }), tol);
    }
  }
}

TEST(Elementwise, NonContiguousInputs) {
  Tensor m = Tensor::fromVector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor t = transpose(m, 0, 1);  // [3,2]: 1 4 / 2 5 / 3 6
  ASSERT_FALSE(t.isContiguous());
  Tensor c = Tensor::fromVector({1, 1, 2, 2, 3, 3}, {3, 2});
  expectValues(t + c, {3, 2}, {2, 5, 4, 7, 6, 9});
  expectValues(t * t, {3, 2}, {1, 16, 4, 25, 9, 36});
  expectValues(exp(t), {3, 2}, {std::exp(1.0), std::exp(4.0), std::exp(2.0), std::exp(5.0), std::exp(3.0), std::exp(6.0)},
               1e-3);
  expectValues(neg(t), {3, 2}, {-1, -4, -2, -5, -3, -6});
  // strided slice: every other column
  Tensor s = slice(m, 1, 0, 3, 2);  // [[1,3],[4,6]]
  expectValues(s * 2.0, {2, 2}, {2, 6, 8, 12});
  expectValues(s + Tensor::fromVector({10, 20}, {2}), {2, 2}, {11, 23, 14, 26});
  // expanded (stride 0) input
  Tensor e = expand(Tensor::fromVector({1, 2}, {2, 1}), {2, 3});
  expectValues(e + m, {2, 3}, {2, 3, 4, 6, 7, 8});
}

TEST(Elementwise, Int64Arithmetic) {
  Tensor a = Tensor::fromVector<int64_t>({1, 2, 3}, {3});
  Tensor b = Tensor::fromVector<int64_t>({10, 20, 30}, {3});
  Tensor s = a * b + a;
  EXPECT_EQ(s.dtype(), DType::kInt64);
  EXPECT_EQ(s.toVector<int64_t>(), (std::vector<int64_t>{11, 42, 93}));
  EXPECT_EQ((a * 2.0).toVector<int64_t>(), (std::vector<int64_t>{2, 4, 6}));
  EXPECT_EQ(relu(neg(a) + 2.0).toVector<int64_t>(), (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(abs(neg(a)).toVector<int64_t>(), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(clamp(b, 15, 25).toVector<int64_t>(), (std::vector<int64_t>{15, 20, 25}));
  // true division is float-only
  expectThrowsWith([&] { div(a, b); }, {"div", "float"});
  expectThrowsWith([&] { exp(a); }, {"exp", "int64"});
}

TEST(Elementwise, UnaryValues) {
  Tensor x = Tensor::fromVector({-2.0f, -0.5f, 0.0f, 0.5f, 2.0f}, {5});
  std::vector<double> xs = {-2, -0.5, 0, 0.5, 2};
  auto map = [&](double (*f)(double)) {
    std::vector<double> r;
    for (double v : xs) r.push_back(f(v));
    return r;
  };
  expectValues(exp(x), {5}, map([](double v) { return std::exp(v); }), 1e-5);
  expectValues(tanh(x), {5}, map([](double v) { return std::tanh(v); }), 1e-6);
  expectValues(sigmoid(x), {5}, map([](double v) { return 1 / (1 + std::exp(-v)); }), 1e-6);
  expectValues(abs(x), {5}, {2, 0.5, 0, 0.5, 2});
  expectValues(relu(x), {5}, {0, 0, 0, 0.5, 2});
  // exact GELU: x * Phi(x); Phi(2) = 0.9772498680518208, Phi(0.5) = 0.6914624612740131
  expectValues(gelu(x), {5}, {-2 * (1 - 0.9772498680518208), -0.5 * (1 - 0.6914624612740131), 0,
                              0.5 * 0.6914624612740131, 2 * 0.9772498680518208},
               1e-6);
  Tensor p = Tensor::fromVector({0.25f, 1.0f, 4.0f}, {3});
  expectValues(log(p), {3}, {std::log(0.25), 0, std::log(4.0)}, 1e-6);
  expectValues(sqrt(p), {3}, {0.5, 1, 2}, 1e-6);
  expectValues(pow(p, 2), {3}, {0.0625, 1, 16}, 1e-6);
  expectValues(pow(p, 3), {3}, {0.015625, 1, 64}, 1e-5);
  expectValues(pow(p, 0.5), {3}, {0.5, 1, 2}, 1e-6);
  expectValues(pow(p, -1), {3}, {4, 1, 0.25}, 1e-6);
  expectValues(pow(p, 1.5), {3}, {0.125, 1, 8}, 1e-5);
  expectValues(pow(p, 0), {3}, {1, 1, 1});
  expectValues(clamp(x, -1, 1), {5}, {-1, -0.5, 0, 0.5, 1});
  // sigmoid saturates without overflow
  Tensor big = Tensor::fromVector({-1000.0f, 1000.0f}, {2});
  expectValues(sigmoid(big), {2}, {0, 1});
}

TEST(Elementwise, UnaryLargeContiguousMatchesScalar) {
  // Long enough to run the vectorised main loop and a remainder.
  Tensor x = randn({1037}, 5, DType::kFloat32, false);
  auto xv = x.toVector<double>();
  auto check = [&](const Tensor& y, double (*f)(double), double tol) {
    auto yv = y.toVector<double>();
    for (size_t i = 0; i < xv.size(); ++i) ASSERT_NEAR(yv[i], f(xv[i]), tol) << i;
  };
  check(relu(x), [](double v) { return v > 0 ? v : 0.0; }, 0);
  check(tanh(x), [](double v) { return std::tanh(v); }, 1e-6);
  check(exp(x), [](double v) { return std::exp(v); }, 1e-4);
  check(gelu(x), [](double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); }, 1e-6);
  check(x * x, [](double v) { return v * v; }, 1e-5);
}

TEST(Elementwise, MaximumMinimumAndNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor a = Tensor::fromVector({1, 5, nan, 2}, {4});
  Tensor b = Tensor::fromVector({3, 4, 1, nan}, {4});
  auto mx = maximum(a, b).toVector<float>();
  auto mn = minimum(a, b).toVector<float>();
  EXPECT_EQ(mx[0], 3);
  EXPECT_EQ(mx[1], 5);
  EXPECT_TRUE(std::isnan(mx[2]));
  EXPECT_TRUE(std::isnan(mx[3]));
  EXPECT_EQ(mn[0], 1);
  EXPECT_EQ(mn[1], 4);
  EXPECT_TRUE(std::isnan(mn[2]));
  EXPECT_TRUE(std::isnan(mn[3]));
}

TEST(Elementwise, ComparisonsGiveZeroOneInOperandDtype) {
  Tensor a = Tensor::fromVector({1, 2, 3}, {3});
  Tensor b = Tensor::fromVector({2, 2, 2}, {3});
  expectValues(eq(a, b), {3}, {0, 1, 0});
  expectValues(ne(a, b), {3}, {1, 0, 1});
  expectValues(lt(a, b), {3}, {1, 0, 0});
  expectValues(le(a, b), {3}, {1, 1, 0});
  expectValues(gt(a, b), {3}, {0, 0, 1});
  expectValues(ge(a, b), {3}, {0, 1, 1});
  EXPECT_EQ(lt(a, b).dtype(), DType::kFloat32);
  // broadcasting, float64 and int64
  Tensor d = Tensor::fromVector<double>({1, 2, 3, 4}, {2, 2});
  Tensor th = Tensor::fromVector<double>({2.5}, {1});
  Tensor g = gt(d, th);
  EXPECT_EQ(g.dtype(), DType::kFloat64);
  expectValues(g, {2, 2}, {0, 0, 1, 1});
  Tensor i = Tensor::fromVector<int64_t>({5, 7}, {2});
  EXPECT_EQ(eq(i, Tensor::fromVector<int64_t>({7}, {1})).toVector<int64_t>(), (std::vector<int64_t>{0, 1}));
  // not differentiable: the result never requires grad
  Tensor x = randn({3}, 1);
  Tensor y = randn({3}, 2);
  EXPECT_FALSE(lt(x, y).requiresGrad());
  EXPECT_FALSE(eq(x, y).requiresGrad());
}

TEST(Elementwise, WhereBroadcasts) {
  Tensor cond = Tensor::fromVector({1, 0, 1}, {3});
  Tensor a = Tensor::fromVector({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = Tensor::scalar(-1);
  expectValues(where(cond, a, b), {2, 3}, {1, -1, 3, 4, -1, 6});
  // int64 condition with float values; column condition
  Tensor ci = Tensor::fromVector<int64_t>({0, 3}, {2, 1});
  expectValues(where(ci, a, b), {2, 3}, {-1, -1, -1, 4, 5, 6});
  expectThrowsWith([&] { where(cond, a, Tensor::fromVector<double>({1}, {1})); }, {"where", "float32", "float64"});
}

TEST(Elementwise, BroadcastShapesAndSumToShape) {
  EXPECT_EQ(broadcastShapes({2, 1, 4}, {3, 1}, "t"), (Shape{2, 3, 4}));
  EXPECT_EQ(broadcastShapes({}, {5}, "t"), (Shape{5}));
  EXPECT_EQ(broadcastShapes({0, 1}, {1, 3}, "t"), (Shape{0, 3}));
  expectThrowsWith([] { broadcastShapes({2, 3}, {4}, "myop"); }, {"myop", "[2, 3]", "[4]"});
  Tensor g = Tensor::fromVector({1, 2, 3, 4, 5, 6}, {2, 3});
  expectValues(sumToShape(g, {3}), {3}, {5, 7, 9});
  expectValues(sumToShape(g, {2, 1}), {2, 1}, {6, 15});
  expectValues(sumToShape(g, {1, 3}), {1, 3}, {5, 7, 9});
  expectValues(sumToShape(g, {}), {}, {21});
  expectValues(sumToShape(g, {1}), {1}, {21});
  EXPECT_TRUE(sumToShape(g, {2, 3}).sameAs(g));
  EXPECT_THROW(sumToShape(g, {4}), ValueError);
}

// ---------------------------------------------------------------- errors

TEST(Elementwise, IncompatibleShapesNameOpAndShapes) {
  Tensor a = Tensor::zeros({2, 3});
  Tensor b = Tensor::zeros({2, 4});
  expectThrowsWith([&] { add(a, b); }, {"add", "[2, 3]", "[2, 4]"});
  expectThrowsWith([&] { sub(a, b); }, {"sub", "[2, 3]", "[2, 4]"});
  expectThrowsWith([&] { mul(a, b); }, {"mul", "[2, 3]", "[2, 4]"});
  expectThrowsWith([&] { div(a, b); }, {"div", "[2, 3]", "[2, 4]"});
  expectThrowsWith([&] { maximum(a, b); }, {"maximum", "[2, 3]", "[2, 4]"});
  expectThrowsWith([&] { lt(a, b); }, {"lt", "[2, 3]", "[2, 4]"});
  expectThrowsWith([&] { where(a, a, b); }, {"where", "[2, 3]", "[2, 4]"});
}

TEST(Elementwise, DtypeMismatchAndBadArguments) {
  Tensor f = Tensor::zeros({3});
  Tensor d = Tensor::zeros({3}, DType::kFloat64);
  expectThrowsWith([&] { add(f, d); }, {"add", "float32", "float64"});
  expectThrowsWith([&] { mul(d, f); }, {"mul", "float64", "float32"});
  expectThrowsWith([&] { minimum(f, d); }, {"minimum", "dtype"});
  expectThrowsWith([&] { eq(f, d); }, {"eq", "dtype"});
  expectThrowsWith([&] { clamp(f, 2, 1); }, {"clamp", "min"});
  expectThrowsWith([&] { add(f, Tensor()); }, {"add", "undefined"});
  Tensor h = Tensor::zeros({3}).toDType(DType::kBFloat16);
  expectThrowsWith([&] { add(h, h); }, {"add", "bfloat16"});
  expectThrowsWith([&] { exp(h); }, {"exp", "bfloat16"});
}

// ---------------------------------------------------------------- autograd

TEST(ElementwiseGrad, HandComputedGradients) {
  Tensor x = Tensor::fromVector<double>({1, 2, 3}, {3});
  x.setRequiresGrad();
  Tensor y = Tensor::fromVector<double>({4, 5, 6}, {3});
  y.setRequiresGrad();
  backward(sum(x * y + x));  // d/dx = y + 1, d/dy = x
  expectValues(x.grad(), {3}, {5, 6, 7});
  expectValues(y.grad(), {3}, {1, 2, 3});
  // bias-style broadcast: gradient of the row operand is summed over rows
  Tensor m = Tensor::fromVector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  m.setRequiresGrad();
  Tensor bias = Tensor::fromVector<double>({0, 0, 0}, {3});
  bias.setRequiresGrad();
  backward(sum((m + bias) * m));  // d/dbias = sum_rows m
  expectValues(bias.grad(), {3}, {5, 7, 9});
  expectValues(m.grad(), {2, 3}, {2, 4, 6, 8, 10, 12});
}

TEST(ElementwiseGrad, MaximumTieSplitsGradient) {
  Tensor a = Tensor::fromVector<double>({1, 2, 3}, {3});
  Tensor b = Tensor::fromVector<double>({2, 2, 1}, {3});
  a.setRequiresGrad();
  b.setRequiresGrad();
  backward(sum(maximum(a, b)));
  expectValues(a.grad(), {3}, {0, 0.5, 1});
  expectValues(b.grad(), {3}, {1, 0.5, 0});
}

TEST(ElementwiseGrad, NoRecordingUnderNoGrad) {
  Tensor x = randn({3}, 1);
  autograd::NoGradGuard guard;
  Tensor y = exp(x) * x;
  EXPECT_FALSE(y.requiresGrad());
  EXPECT_EQ(y.gradFn(), nullptr);
}

TEST(ElementwiseGrad, BinaryOpsWithBroadcasting) {
  const std::vector<std::pair<Shape, Shape>> shapes = {
      {{2, 3}, {2, 3}}, {{2, 3}, {3}}, {{2, 1, 4}, {3, 1}}, {{}, {2, 2}}, {{2, 3, 2, 2}, {1, 3, 1, 1}}};
  for (const auto& [sa, sb] : shapes) {
    SCOPED_TRACE(tensor::shapeStr(sa) + " with " + tensor::shapeStr(sb));
    Tensor a = randn(sa, 1);
    Tensor b = randn(sb, 2);
    Tensor bPos = randu(sb, 3, 0.5, 2.0);
    expectGradcheck([](const std::vector<Tensor>& in) { return add(in[0], in[1]); }, {a, b});
    expectGradcheck([](const std::vector<Tensor>& in) { return sub(in[0], in[1]); }, {a, b});
    expectGradcheck([](const std::vector<Tensor>& in) { return sub(in[1], in[0]); }, {a, b});
    expectGradcheck([](const std::vector<Tensor>& in) { return mul(in[0], in[1]); }, {a, b});
    expectGradcheck([](const std::vector<Tensor>& in) { return div(in[0], in[1]); }, {a, bPos});
    expectGradcheck([](const std::vector<Tensor>& in) { return maximum(in[0], in[1]); }, {a, b});
    expectGradcheck([](const std::vector<Tensor>& in) { return minimum(in[1], in[0]); }, {a, b});
    Tensor cond = gt(randn(sb, 4, DType::kFloat64, false), Tensor::scalar(0.0, DType::kFloat64));
    expectGradcheck([cond](const std::vector<Tensor>& in) { return where(cond, in[0], in[1]); }, {a, b});
  }
}

TEST(ElementwiseGrad, OnlyOneOperandRequiresGrad) {
  Tensor a = randn({2, 3}, 1);
  Tensor b = randn({3}, 2, DType::kFloat64, false);
  expectGradcheck([b](const std::vector<Tensor>& in) { return mul(in[0], b); }, {a});
  expectGradcheck([b](const std::vector<Tensor>& in) { return div(b, in[0] * in[0] + 1.0); }, {a});
}

TEST(ElementwiseGrad, ScalarForms) {
  Tensor a = randn({2, 3}, 1);
  expectGradcheck([](const std::vector<Tensor>& in) { return in[0] + 2.5; }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return 1.0 - in[0]; }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return in[0] * -3.0; }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return in[0] / 4.0; }, {a});
}

TEST(ElementwiseGrad, UnaryOps) {
  Tensor a = randn({2, 3}, 11);
  // Keep inputs away from kinks (abs, relu, clamp bounds) and in the domain (log, sqrt, pow).
  Tensor away = randu({2, 3}, 12, 0.2, 1.5) * Tensor::fromVector<double>({1, -1, 1, -1, -1, 1}, {2, 3});
  away = away.detach();
  away.setRequiresGrad();
  Tensor pos = randu({2, 3}, 13, 0.3, 2.0);
  expectGradcheck([](const std::vector<Tensor>& in) { return neg(in[0]); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return exp(in[0]); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return log(in[0]); }, {pos});
  expectGradcheck([](const std::vector<Tensor>& in) { return sqrt(in[0]); }, {pos});
  expectGradcheck([](const std::vector<Tensor>& in) { return abs(in[0]); }, {away});
  expectGradcheck([](const std::vector<Tensor>& in) { return relu(in[0]); }, {away});
  expectGradcheck([](const std::vector<Tensor>& in) { return gelu(in[0]); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return tanh(in[0]); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return sigmoid(in[0]); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return clamp(in[0], -0.1, 0.1); }, {away});
  expectGradcheck([](const std::vector<Tensor>& in) { return clamp(in[0], -5, 5); }, {a});
  for (double e : {2.0, 3.0, 0.5, -1.0, 1.7, 1.0, 0.0}) {
    SCOPED_TRACE("exponent " + std::to_string(e));
    expectGradcheck([e](const std::vector<Tensor>& in) { return pow(in[0], e); }, {pos});
  }
  expectGradcheck([](const std::vector<Tensor>& in) { return pow(in[0], 3.0); }, {a});
}

// float32 takes the vectorised exp/tanh/sigmoid/normal-CDF paths, float64 libm: forward values and
// backward gradients must agree to float32 accuracy.
TEST(ElementwiseGrad, Float32MatchesFloat64) {
  const std::vector<std::pair<const char*, Tensor (*)(const Tensor&)>> ops = {
      {"exp", [](const Tensor& x) { return exp(x); }},         {"tanh", [](const Tensor& x) { return tanh(x); }},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }}, {"gelu", [](const Tensor& x) { return gelu(x); }},
  };
  Tensor base = randn({257}, 31, DType::kFloat64, false) * 3.0;
  for (const auto& [name, op] : ops) {
    SCOPED_TRACE(name);
    Tensor x64 = base.detach();
    x64.setRequiresGrad();
    Tensor x32 = base.toDType(DType::kFloat32);
    x32.setRequiresGrad();
    Tensor y64 = op(x64);
    Tensor y32 = op(x32);
    backward(sum(y64 * y64));
    backward(sum(y32 * y32));
    auto f64 = y64.toVector<double>(), f32 = y32.toVector<double>();
    auto g64 = x64.grad().toVector<double>(), g32 = x32.grad().toVector<double>();
    for (size_t i = 0; i < f64.size(); ++i) {
      ASSERT_NEAR(f32[i], f64[i], 2e-6 * (1 + std::abs(f64[i]))) << i;
      ASSERT_NEAR(g32[i], g64[i], 2e-5 * (1 + std::abs(g64[i]))) << i;
    }
  }
}

TEST(ElementwiseGrad, NonContiguousInputs) {
  Tensor a = randn({3, 2}, 21);
  Tensor b = randn({2, 3}, 22);
  expectGradcheck([](const std::vector<Tensor>& in) { return mul(transpose(in[0], 0, 1), in[1]); }, {a, b});
  expectGradcheck([](const std::vector<Tensor>& in) { return tanh(transpose(in[0], 0, 1)) + in[1]; }, {a, b});
}

}  // namespace
}  // namespace distgrad
