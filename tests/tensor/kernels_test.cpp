// Raw CPU kernels (tensor/cpu/{elementwise,reduce,shape_kernels}.h): every fast path is checked against
// a straightforward reference loop, so a vectorised path can never silently disagree with the generic one.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "tensor/cpu/elementwise.h"
#include "tensor/cpu/elementwise_math.h"
#include "tensor/cpu/reduce.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/random.h"

namespace distgrad::tensor::kernels {
namespace {

Tensor randn(const Shape& shape, uint64_t seed, DType dtype = DType::kFloat32) {
  Generator gen(seed);
  return normal(shape, 0.0, 1.0, gen, dtype);
}

// Element of t at the broadcast of multi-index `idx` (idx has outShape's rank).
double broadcastAt(const Tensor& t, const std::vector<int64_t>& idx) {
  const size_t lead = idx.size() - static_cast<size_t>(t.dim());
  int64_t off = t.offset();
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.shape()[d] != 1) off += idx[lead + d] * t.strides()[d];
  }
  Tensor one = Tensor::fromStorage(t.storage(), {}, {}, off, t.dtype());
  return one.item();
}

// Reference binary op over a broadcast: visits every output index with an odometer.
std::vector<double> referenceBinary(const Tensor& a, const Tensor& b, const std::function<double(double, double)>& f) {
  Shape out = broadcastShapes(a.shape(), b.shape(), "ref");
  std::vector<double> r;
  std::vector<int64_t> idx(out.size(), 0);
  for (int64_t n = 0, total = numelOf(out); n < total; ++n) {
    r.push_back(f(broadcastAt(a, idx), broadcastAt(b, idx)));
    for (int64_t d = static_cast<int64_t>(out.size()) - 1; d >= 0; --d) {
      if (++idx[d] < out[d]) break;
      idx[d] = 0;
    }
  }
  return r;
}

void expectNear(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], tol * (1 + std::abs(want[i]))) << "element " << i;
  }
}

TEST(ElementwiseKernels, EveryPathMatchesReference) {
  // Shapes chosen to hit: same-shape contiguous, one-element operand on either side, row broadcast,
  // per-channel broadcast (inner scalar run), column broadcast, both sides broadcast, and odd lengths that
  // leave a vector remainder.
  const std::vector<std::pair<Shape, Shape>> cases = {
      {{67}, {67}},          {{5, 13}, {}},       {{1}, {5, 13}},     {{9, 37}, {37}},
      {{3, 4, 5, 7}, {1, 4, 1, 1}}, {{9, 37}, {9, 1}}, {{9, 1}, {1, 37}}, {{2, 3, 1}, {3, 17}},
  };
  const std::vector<std::pair<BinaryOp, std::function<double(double, double)>>> ops = {
      {BinaryOp::kAdd, [](double x, double y) { return x + y; }},
      {BinaryOp::kSub, [](double x, double y) { return x - y; }},
      {BinaryOp::kMul, [](double x, double y) { return x * y; }},
      {BinaryOp::kDiv, [](double x, double y) { return x / y; }},
      {BinaryOp::kMaximum, [](double x, double y) { return std::max(x, y); }},
      {BinaryOp::kMinimum, [](double x, double y) { return std::min(x, y); }},
      {BinaryOp::kLt, [](double x, double y) { return x < y ? 1.0 : 0.0; }},
      {BinaryOp::kGe, [](double x, double y) { return x >= y ? 1.0 : 0.0; }},
  };
  for (const auto& [sa, sb] : cases) {
    Tensor a = randn(sa, 1);
    Tensor b = randn(sb, 2);
    for (const auto& [op, f] : ops) {
      SCOPED_TRACE(std::string(binaryOpName(op)) + " " + shapeStr(sa) + " " + shapeStr(sb));
      expectNear(binary(op, a, b).toVector<double>(), referenceBinary(a, b, f), 1e-5);
      expectNear(binary(op, b, a).toVector<double>(), referenceBinary(b, a, f), 1e-5);
    }
  }
}

TEST(ElementwiseKernels, NonContiguousOperands) {
  Tensor base = randn({6, 10}, 3, DType::kFloat64);
  Tensor t = asStrided(base, {10, 6}, {1, 10}, 0);   // transpose
  Tensor s = asStrided(base, {6, 5}, {10, 2}, 1);    // every other column, offset 1
  Tensor r = randn({6}, 4, DType::kFloat64);
  auto add = [](double x, double y) { return x + y; };
  auto mul = [](double x, double y) { return x * y; };
  expectNear(binary(BinaryOp::kAdd, t, r).toVector<double>(), referenceBinary(t, r, add), 1e-12);
  expectNear(binary(BinaryOp::kMul, s, asStrided(r, {6, 1}, {1, 1}, 0)).toVector<double>(),
             referenceBinary(s, asStrided(r, {6, 1}, {1, 1}, 0), mul), 1e-12);
  Tensor u = unary(UnaryOp::kTanh, s);
  auto sv = s.toVector<double>();
  auto uv = u.toVector<double>();
  for (size_t i = 0; i < sv.size(); ++i) EXPECT_NEAR(uv[i], std::tanh(sv[i]), 1e-15);
  EXPECT_TRUE(u.isContiguous());
}

TEST(ElementwiseKernels, BackwardPieces) {
  Tensor g = Tensor::fromVector<double>({1, 2, 3, 4}, {4});
  Tensor y = Tensor::fromVector<double>({-1, 0, 0.5, 2}, {4});
  EXPECT_EQ(reluBackward(g, y).toVector<double>(), (std::vector<double>{0, 0, 3, 4}));
  EXPECT_EQ(absBackward(g, y).toVector<double>(), (std::vector<double>{-1, 0, 3, 4}));
  EXPECT_EQ(sigmoidBackward(g, y).toVector<double>(), (std::vector<double>{-2, 0, 0.75, -8}));
  EXPECT_EQ(tanhBackward(g, y).toVector<double>(), (std::vector<double>{0, 2, 2.25, -12}));
  EXPECT_EQ(clampBackward(g, y, 0, 1).toVector<double>(), (std::vector<double>{0, 2, 3, 0}));
  EXPECT_EQ(powBackward(g, y, 2).toVector<double>(), (std::vector<double>{-2, 0, 3, 16}));
  EXPECT_EQ(powBackward(g, y, 0).toVector<double>(), (std::vector<double>{0, 0, 0, 0}));
  // gelu'(0) = 0.5
  EXPECT_NEAR(geluBackward(g, y).toVector<double>()[1], 1.0, 1e-15);
  EXPECT_THROW(reluBackward(g, Tensor::zeros({3}, DType::kFloat64)), ValueError);
  Tensor ga, gb;
  maxMinBackward(Tensor::ones({2, 2}, DType::kFloat64), Tensor::fromVector<double>({1, 5}, {2}),
                 Tensor::fromVector<double>({2, 5, 0, 7}, {2, 2}), true, &ga, &gb);
  EXPECT_EQ(ga.toVector<double>(), (std::vector<double>{0, 0.5, 1, 0}));
  EXPECT_EQ(gb.toVector<double>(), (std::vector<double>{1, 0.5, 0, 1}));
}

TEST(VecMath, ExpTanhSigmoidAccuracyAndSpecialValues) {
  double worstExp = 0, worstTanh = 0, worstSigmoid = 0;
  const int kSamples = 1 << 18;
  for (int i = 0; i <= kSamples; ++i) {
    const float x = -87.0f + 175.5f * static_cast<float>(i) / kSamples;
    const double e = std::exp(static_cast<double>(x));
    worstExp = std::max(worstExp, std::abs(vecmath::expf(x) - e) / e);
    const float t = x / 8;  // tanh and sigmoid saturate quickly: sample [-11, 11] densely
    const double th = std::tanh(static_cast<double>(t));
    worstTanh = std::max(worstTanh, std::abs(vecmath::tanhf(t) - th) / std::max(std::abs(th), 1e-30));
    const double sg = 1 / (1 + std::exp(-static_cast<double>(t)));
    worstSigmoid = std::max(worstSigmoid, std::abs(vecmath::sigmoidf(t) - sg) / sg);
  }
  EXPECT_LT(worstExp, 2e-7);
  EXPECT_LT(worstTanh, 4e-7);
  EXPECT_LT(worstSigmoid, 4e-7);
  // tiny arguments keep full relative accuracy (no cancellation)
  EXPECT_FLOAT_EQ(vecmath::tanhf(1e-6f), 1e-6f);
  EXPECT_FLOAT_EQ(vecmath::tanhf(-3e-20f), -3e-20f);
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(vecmath::expf(0.0f), 1.0f);
  EXPECT_EQ(vecmath::expf(89.0f), inf);
  EXPECT_EQ(vecmath::expf(inf), inf);
  EXPECT_EQ(vecmath::expf(-100.0f), 0.0f);
  EXPECT_EQ(vecmath::expf(-inf), 0.0f);
  EXPECT_TRUE(std::isnan(vecmath::expf(nan)));
  EXPECT_NEAR(vecmath::expf(88.7f) / std::exp(static_cast<double>(88.7f)), 1.0, 2e-7);  // n = 128 path
  EXPECT_EQ(vecmath::tanhf(50.0f), 1.0f);
  EXPECT_EQ(vecmath::tanhf(-inf), -1.0f);
  EXPECT_TRUE(std::isnan(vecmath::tanhf(nan)));
  EXPECT_EQ(vecmath::sigmoidf(-200.0f), 0.0f);
  EXPECT_EQ(vecmath::sigmoidf(200.0f), 1.0f);
  EXPECT_TRUE(std::isnan(vecmath::sigmoidf(nan)));
  // normal CDF (GELU): relative accuracy across the lower tail, absolute near 1
  double worstCdf = 0;
  for (int i = 0; i <= kSamples; ++i) {
    const float x = -9.0f + 17.0f * static_cast<float>(i) / kSamples;
    const double ref = 0.5 * std::erfc(-static_cast<double>(x) / std::sqrt(2.0));
    worstCdf = std::max(worstCdf, std::abs(vecmath::normalCdf(x) - ref) / ref);
  }
  EXPECT_LT(worstCdf, 1e-5);
  for (float x : {-12.0f, -11.0f, -10.0f}) {
    const double ref = 0.5 * std::erfc(-static_cast<double>(x) / std::sqrt(2.0));
    EXPECT_NEAR(vecmath::normalCdf(x) / ref, 1.0, 2e-5) << x;
  }
  EXPECT_EQ(vecmath::normalCdf(0.0f), 0.5f);
  EXPECT_EQ(vecmath::normalCdf(inf), 1.0f);
  EXPECT_EQ(vecmath::normalCdf(-inf), 0.0f);
  EXPECT_EQ(vecmath::normalCdf(-20.0f), 0.0f);
  EXPECT_TRUE(std::isnan(vecmath::normalCdf(nan)));
  // the tensor kernels use them for float32
  Tensor x = Tensor::fromVector({-1.0f, 0.5f, 3.0f}, {3});
  auto ex = unary(UnaryOp::kExp, x).toVector<double>();
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(ex[i], std::exp(x.toVector<double>()[i]), 1e-6 * ex[i]);
}

TEST(ReduceKernels, MaxDimMatchesReferenceOnEveryDim) {
  Tensor x = randn({4, 5, 6}, 9, DType::kFloat64);
  for (int64_t dim = 0; dim < 3; ++dim) {
    Tensor v, idx;
    maxDim(x, dim, false, &v, &idx);
    auto vv = v.toVector<double>();
    auto iv = idx.toVector<int64_t>();
    size_t k = 0;
    const Shape& s = x.shape();
    for (int64_t a = 0; a < (dim == 0 ? 1 : s[0]); ++a)
      for (int64_t b = 0; b < (dim == 1 ? 1 : s[1]); ++b)
        for (int64_t c = 0; c < (dim == 2 ? 1 : s[2]); ++c, ++k) {
          double best = -INFINITY;
          int64_t bestI = -1;
          for (int64_t r = 0; r < s[dim]; ++r) {
            const double e = dim == 0 ? x.at({r, b, c}) : dim == 1 ? x.at({a, r, c}) : x.at({a, b, r});
            if (e > best) {
              best = e;
              bestI = r;
            }
          }
          ASSERT_EQ(vv[k], best);
          ASSERT_EQ(iv[k], bestI);
        }
    Tensor back = maxDimBackward(v, idx, x.shape(), dim);
    EXPECT_NEAR(sumAll(back).item(), sumAll(v).item(), 1e-12);
  }
}

TEST(ReduceKernels, MaxBackwardRejectsABadGeometry) {
  Tensor grad = Tensor::zeros({2, 4});
  Tensor idx = Tensor::zeros({2, 4}, DType::kInt64);
  EXPECT_THROW(maxDimBackward(grad, idx, {2, 3, 4}, 3), ValueError);   // no dim 3
  EXPECT_THROW(maxDimBackward(grad, idx, {2, 3, 4}, -1), ValueError);  // wrapped by the caller, never here
  EXPECT_THROW(maxDimBackward(grad, idx, {2, 5, 4}, 2), ValueError);   // gradient is not [2, 5]
  EXPECT_THROW(maxDimBackward(grad, Tensor::zeros({2, 4}), {2, 3, 4}, 1), ValueError);  // float indices
  EXPECT_EQ(maxDimBackward(grad, idx, {2, 3, 4}, 1).shape(), (Shape{2, 3, 4}));
}

TEST(ReduceKernels, ArgmaxRunsWithTiesNaNAndInfinity) {
  // Long rows take the two-pass vectorised path; NaN/inf anywhere (also in the tail) fall back exactly.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t n : {5, 16, 37, 64}) {
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      SCOPED_TRACE("n=" + std::to_string(n) + " at=" + std::to_string(at));
      std::vector<float> v(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 7) % 11) - 20.0f;
      auto run = [&](const std::vector<float>& vals) {
        Tensor t = Tensor::fromVector(vals, {1, n});
        Tensor value, index;
        maxDim(t, 1, false, &value, &index);
        return std::make_pair(value.item(), index.toVector<int64_t>()[0]);
      };
      auto w = v;
      w[at] = 5;  // unique maximum
      EXPECT_EQ(run(w), std::make_pair(5.0, at));
      w[(at + n / 3 + 1) % n] = 5;  // tie: first occurrence
      EXPECT_EQ(run(w).second, std::min(at, (at + n / 3 + 1) % n));
      w = v;
      w[at] = inf;
      EXPECT_EQ(run(w), std::make_pair(static_cast<double>(inf), at));
      w = v;
      w[at] = nan;
      if (n - 1 - at != at) w[n - 1 - at] = 100;
      auto r = run(w);
      EXPECT_TRUE(std::isnan(r.first));
      EXPECT_EQ(r.second, at);
    }
  }
  // all equal
  Tensor same = Tensor::full({2, 40}, 3.0);
  Tensor value, index;
  maxDim(same, 1, false, &value, &index);
  EXPECT_EQ(index.toVector<int64_t>(), (std::vector<int64_t>{0, 0}));
  // int64 rows
  std::vector<int64_t> iv(50);
  for (int64_t i = 0; i < 50; ++i) iv[i] = (i * 13) % 50;
  maxDim(Tensor::fromVector(iv, {50}), 0, false, &value, &index);
  EXPECT_EQ(value.toVector<int64_t>()[0], 49);
  EXPECT_EQ(iv[static_cast<size_t>(index.toVector<int64_t>()[0])], 49);
}

TEST(ReduceKernels, SumDimsInt64AndMask) {
  Tensor i = asStrided(Tensor::arange(12, DType::kInt64), {3, 4}, {4, 1}, 0);
  EXPECT_EQ(sumDims(i, {true, false}, false).toVector<int64_t>(), (std::vector<int64_t>{12, 15, 18, 21}));
  EXPECT_EQ(sumDims(i, {false, true}, true).shape(), (Shape{3, 1}));
  EXPECT_EQ(sumDims(i, {false, false}, false).toVector<int64_t>(), i.toVector<int64_t>());
  EXPECT_EQ(reductionMask({-1, 0}, 3, "op"), (std::vector<bool>{true, false, true}));
  EXPECT_THROW(reductionMask({1, 1}, 3, "op"), ValueError);
  EXPECT_EQ(reducedShape({2, 3, 4}, {true, false, true}, false), (Shape{3}));
}

TEST(ShapeKernels, ViewStrides) {
  // contiguous: any reshape is a view
  EXPECT_EQ(viewStrides({2, 3, 4}, {12, 4, 1}, {6, 4}), (Shape{4, 1}));
  EXPECT_EQ(viewStrides({2, 3, 4}, {12, 4, 1}, {24}), (Shape{1}));
  // transposed [3,2] of a [2,3]: merging is impossible, splitting/adding unit dims works
  EXPECT_FALSE(viewStrides({3, 2}, {1, 3}, {6}).has_value());
  // (the stride of a size-1 dim is arbitrary; this is the value PyTorch's algorithm picks too)
  EXPECT_EQ(viewStrides({3, 2}, {1, 3}, {3, 1, 2}), (Shape{1, 6, 3}));
  // a [4,2] column slice of a [4,6]
  EXPECT_EQ(viewStrides({4, 2}, {6, 1}, {2, 2, 2}), (Shape{12, 6, 1}));
  EXPECT_FALSE(viewStrides({4, 2}, {6, 1}, {8}).has_value());
  // expanded (stride 0) dims can be split but not merged with others
  EXPECT_EQ(viewStrides({4, 3}, {0, 1}, {2, 2, 3}), (Shape{0, 0, 1}));
  EXPECT_FALSE(viewStrides({4, 3}, {0, 1}, {12}).has_value());
  // 0-d and empty
  EXPECT_EQ(viewStrides({}, {}, {1, 1}), (Shape{1, 1}));
  EXPECT_EQ(viewStrides({1, 1}, {5, 5}, {}), Shape{});
  EXPECT_TRUE(viewStrides({0, 3}, {3, 1}, {3, 0}).has_value());
}

TEST(ShapeKernels, CopyIntoBroadcastAndErrors) {
  Tensor dst = Tensor::zeros({2, 3});
  copyInto(dst, Tensor::fromVector({1, 2, 3}, {3}));
  EXPECT_EQ(dst.toVector<float>(), (std::vector<float>{1, 2, 3, 1, 2, 3}));
  copyInto(asStrided(dst, {2}, {3}, 0), Tensor::scalar(9));  // write a column through a strided view
  EXPECT_EQ(dst.toVector<float>(), (std::vector<float>{9, 2, 3, 9, 2, 3}));
  EXPECT_THROW(copyInto(dst, Tensor::zeros({3}, DType::kFloat64)), ValueError);
  EXPECT_THROW(copyInto(dst, Tensor::zeros({2})), ValueError);
  Tensor b = broadcastTo(Tensor::fromVector<int64_t>({4, 5}, {2, 1}), {2, 2});
  EXPECT_EQ(b.toVector<int64_t>(), (std::vector<int64_t>{4, 4, 5, 5}));
  Tensor h = broadcastTo(Tensor::fromVector({0.5f}, {1}).toDType(DType::kFloat16), {3});
  EXPECT_EQ(h.dtype(), DType::kFloat16);
  EXPECT_EQ(h.toVector<float>(), (std::vector<float>{0.5f, 0.5f, 0.5f}));
}

TEST(ShapeKernels, TransposedCopiesMatchElementwiseReference) {
  // Shapes around the 32-wide tiles (odd remainders), with and without leading batch dims, every dtype size.
  const std::vector<std::pair<Shape, std::vector<int64_t>>> cases = {
      {{37, 70}, {1, 0}},           {{8, 8}, {1, 0}},         {{3, 33, 65}, {0, 2, 1}},
      {{2, 5, 9, 40}, {0, 2, 3, 1}},  // NCHW -> NHWC
      {{2, 40, 5, 9}, {0, 3, 1, 2}},  // NHWC -> NCHW
      {{4, 50, 3}, {2, 1, 0}},
  };
  for (const auto& [shape, perm] : cases) {
    for (DType dt : {DType::kFloat32, DType::kFloat64, DType::kFloat16}) {
      SCOPED_TRACE(shapeStr(shape) + " " + dtypeName(dt));
      Tensor base = Tensor::arange(numelOf(shape), DType::kFloat64);
      base = asStrided(base, shape, contiguousStrides(shape), 0).toDType(dt);
      Shape pShape(perm.size()), pStrides(perm.size());
      for (size_t i = 0; i < perm.size(); ++i) {
        pShape[i] = shape[perm[i]];
        pStrides[i] = base.strides()[perm[i]];
      }
      Tensor view = asStrided(base, pShape, pStrides, 0);
      Tensor c = contiguous(view);
      ASSERT_TRUE(c.isContiguous());
      // reference: Tensor::copyFrom's per-element conversion path (float64 destination)
      Tensor ref = Tensor::empty(pShape, DType::kFloat64);
      ref.copyFrom(view);
      ASSERT_EQ(c.toVector<double>(), ref.toVector<double>());
    }
  }
}

TEST(ShapeKernels, CatMixedLayouts) {
  Tensor a = Tensor::fromVector({1, 2, 3, 4}, {2, 2});
  Tensor t = asStrided(a, {2, 2}, {1, 2}, 0);  // transpose of a
  Tensor c = cat({a, t, Tensor::zeros({2, 0})}, 1);
  EXPECT_EQ(c.shape(), (Shape{2, 4}));
  EXPECT_EQ(c.toVector<float>(), (std::vector<float>{1, 2, 1, 3, 3, 4, 2, 4}));
  EXPECT_EQ(cat({a, t}, 0).toVector<float>(), (std::vector<float>{1, 2, 3, 4, 1, 3, 2, 4}));
}

}  // namespace
}  // namespace distgrad::tensor::kernels
