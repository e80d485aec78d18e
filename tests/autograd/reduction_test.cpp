// Reductions: values against hand-computed numbers and reference loops (both reduction patterns,
// non-contiguous inputs, keepDim), accuracy of long float32 sums, errors, and float64 gradchecks.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "tensor/random.h"
#include "test_util.h"

namespace distgrad {
namespace {

using namespace distgrad::testing;

// m = [[1,2,3],[4,5,6]]
Tensor m23() { return Tensor::fromVector({1, 2, 3, 4, 5, 6}, {2, 3}); }

TEST(Reduction, SumValues) {
  Tensor m = m23();
  expectValues(sum(m), {}, {21});
  expectValues(sum(m, {0}), {3}, {5, 7, 9});
  expectValues(sum(m, {1}), {2}, {6, 15});
  expectValues(sum(m, {-1}), {2}, {6, 15});
  expectValues(sum(m, {0}, true), {1, 3}, {5, 7, 9});
  expectValues(sum(m, {1}, true), {2, 1}, {6, 15});
  expectValues(sum(m, {0, 1}), {}, {21});
  expectValues(sum(m, {1, 0}, true), {1, 1}, {21});
  // NumPy semantics: an empty dims list reduces nothing
  expectValues(sum(m, {}), {2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(sum(m).dtype(), DType::kFloat32);
  // 0-d input, empty input
  expectValues(sum(Tensor::scalar(3.5)), {}, {3.5});
  expectValues(sum(Tensor::zeros({0, 3})), {}, {0});
  expectValues(sum(Tensor::zeros({0, 3}), {0}), {3}, {0, 0, 0});
}

TEST(Reduction, SumInt64AndFloat64) {
  Tensor i = Tensor::fromVector<int64_t>({1, 2, 3, 4}, {2, 2});
  EXPECT_EQ(sum(i).dtype(), DType::kInt64);
  EXPECT_EQ(sum(i).toVector<int64_t>(), (std::vector<int64_t>{10}));
  EXPECT_EQ(sum(i, {0}).toVector<int64_t>(), (std::vector<int64_t>{4, 6}));
  Tensor d = Tensor::fromVector<double>({0.1, 0.2, 0.3}, {3});
  EXPECT_EQ(sum(d).dtype(), DType::kFloat64);
  EXPECT_NEAR(sum(d).item(), 0.6, 1e-15);
}

// Reference sum over a mask of dims of a 4-d tensor, by explicit loops.
std::vector<double> referenceSum4d(const Tensor& t, const std::vector<bool>& mask) {
  const Shape& s = t.shape();
  Shape outShape;
  for (int d = 0; d < 4; ++d) outShape.push_back(mask[d] ? 1 : s[d]);
  std::vector<double> out(static_cast<size_t>(tensor::numelOf(outShape)), 0.0);
  for (int64_t a = 0; a < s[0]; ++a)
    for (int64_t b = 0; b < s[1]; ++b)
      for (int64_t c = 0; c < s[2]; ++c)
        for (int64_t e = 0; e < s[3]; ++e) {
          int64_t i[4] = {a, b, c, e};
          int64_t o = 0;
          for (int d = 0; d < 4; ++d) o = o * outShape[d] + (mask[d] ? 0 : i[d]);
          out[o] += t.at({a, b, c, e});
        }
  return out;
}

TEST(Reduction, SumPatternsMatchReference) {
  // Every subset of dims, on a contiguous NCHW tensor and on a permuted (non-contiguous) view.
  Tensor x = randn({3, 4, 5, 6}, 7, DType::kFloat32, false);
  Tensor p = permute(randn({5, 3, 6, 4}, 8, DType::kFloat32, false), {1, 3, 0, 2});  // [3,4,5,6]
  ASSERT_FALSE(p.isContiguous());
  for (const Tensor& t : {x, p}) {
    for (int maskBits = 1; maskBits < 16; ++maskBits) {
      std::vector<int64_t> dims;
      std::vector<bool> mask(4, false);
      for (int d = 0; d < 4; ++d) {
        if (maskBits & (1 << d)) {
          dims.push_back(d);
          mask[d] = true;
        }
      }
      SCOPED_TRACE("mask " + std::to_string(maskBits));
      Tensor r = sum(t, dims, true);
      auto expected = referenceSum4d(t, mask);
      auto got = r.toVector<double>();
      ASSERT_EQ(got.size(), expected.size());
      for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], expected[i], 1e-4) << i;
    }
  }
}

TEST(Reduction, LongFloat32SumIsAccurate) {
  // 2^22 copies of 0.1f: naive float accumulation drifts by percents; the blocked/double scheme must not.
  const int64_t n = int64_t{1} << 22;
  Tensor x = Tensor::full({n}, 0.1);
  const double exact = static_cast<double>(0.1f) * static_cast<double>(n);
  EXPECT_NEAR(sum(x).item(), exact, exact * 1e-6);
  // the same along leading rows (outer-reduction pattern)
  Tensor rows = Tensor::full({n / 4, 4}, 0.1);
  auto cols = sum(rows, {0}).toVector<double>();
  for (double c : cols) EXPECT_NEAR(c, exact / 4, exact / 4 * 1e-6);
}

TEST(Reduction, MeanAndVarValues) {
  Tensor m = m23();
  expectValues(mean(m), {}, {3.5});
  expectValues(mean(m, {0}), {3}, {2.5, 3.5, 4.5});
  expectValues(mean(m, {1}, true), {2, 1}, {2, 5});
  // var of [1,2,3] = 1 (unbiased), 2/3 (biased); of columns [1,4] = 4.5 (unbiased), 2.25 (biased)
  expectValues(var(m, {1}), {2}, {1, 1});
  expectValues(var(m, {1}, false), {2}, {2.0 / 3, 2.0 / 3});
  expectValues(var(m, {0}, true, true), {1, 3}, {4.5, 4.5, 4.5});
  expectValues(var(m, {0, 1}), {}, {3.5});  // var of 1..6 = 17.5/5
  // large offset: the two-pass formula stays accurate
  Tensor big = Tensor::fromVector<double>({1e8 + 1, 1e8 + 2, 1e8 + 3}, {3});
  expectValues(var(big, {0}), {}, {1.0}, 1e-6);
  expectThrowsWith([] { mean(Tensor::fromVector<int64_t>({1, 2}, {2})); }, {"mean", "int64"});
  expectThrowsWith([] { var(Tensor::fromVector<int64_t>({1, 2}, {2}), {0}); }, {"var", "int64"});
  EXPECT_TRUE(std::isnan(mean(Tensor::zeros({0})).item()));
}

TEST(Reduction, MaxAndArgmax) {
  Tensor m = Tensor::fromVector({3, 9, 2, 7, 1, 9}, {2, 3});
  expectValues(max(m), {}, {9});
  expectValues(max(m, 1), {2}, {9, 9});
  expectValues(max(m, 0), {3}, {7, 9, 9});
  expectValues(max(m, 0, true), {1, 3}, {7, 9, 9});
  EXPECT_EQ(argmax(m, 1).toVector<int64_t>(), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(argmax(m, 0).toVector<int64_t>(), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(argmax(m, -1, true).shape(), (Shape{2, 1}));
  EXPECT_EQ(argmax(m, 1).dtype(), DType::kInt64);
  // first occurrence wins on ties
  Tensor ties = Tensor::fromVector({5, 5, 5}, {3});
  EXPECT_EQ(argmax(ties, 0).toVector<int64_t>(), (std::vector<int64_t>{0}));
  // non-contiguous input: the transpose of m
  Tensor t = transpose(m, 0, 1);  // [[3,7],[9,1],[2,9]]
  expectValues(max(t, 1), {3}, {7, 9, 9});
  EXPECT_EQ(argmax(t, 1).toVector<int64_t>(), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(argmax(t, 0).toVector<int64_t>(), (std::vector<int64_t>{1, 2}));
  // NaN propagates
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor n = Tensor::fromVector({1, nan, 3}, {3});
  EXPECT_TRUE(std::isnan(max(n).item()));
  EXPECT_EQ(argmax(n, 0).toVector<int64_t>(), (std::vector<int64_t>{1}));
  // NaN inside the first vector block of a long row (the vectorised path) propagates too
  for (int64_t at = 1; at < 8; ++at) {
    std::vector<float> row(32, 0.f);
    row[20] = 5.f;
    row[static_cast<size_t>(at)] = nan;
    Tensor r = Tensor::fromVector(row, {1, 32});
    EXPECT_TRUE(std::isnan(max(r).item())) << "NaN at " << at;
    EXPECT_EQ(argmax(r, 1).toVector<int64_t>(), (std::vector<int64_t>{at})) << "NaN at " << at;
    std::vector<double> row64(row.begin(), row.end());
    EXPECT_EQ(argmax(Tensor::fromVector(row64, {1, 32}), 1).toVector<int64_t>(), (std::vector<int64_t>{at}));
  }
  // int64 and 0-d
  EXPECT_EQ(max(Tensor::fromVector<int64_t>({4, -2, 8}, {3})).toVector<int64_t>(), (std::vector<int64_t>{8}));
  expectValues(max(Tensor::scalar(2.0), 0), {}, {2});
}

TEST(Reduction, Errors) {
  Tensor m = m23();
  expectThrowsWith([&] { sum(m, {2}); }, {"sum", "dim 2"});
  expectThrowsWith([&] { sum(m, {-3}); }, {"sum", "dim -3"});
  expectThrowsWith([&] { sum(m, {0, -2}); }, {"sum", "more than once"});
  expectThrowsWith([&] { mean(m, {5}); }, {"mean", "dim 5"});
  expectThrowsWith([&] { var(m, {3}); }, {"var", "dim 3"});
  expectThrowsWith([&] { max(m, 2); }, {"max", "dim 2"});
  expectThrowsWith([&] { argmax(m, -3); }, {"argmax", "dim -3"});
  expectThrowsWith([] { max(Tensor::zeros({0})); }, {"max", "empty"});
  expectThrowsWith([] { max(Tensor::zeros({2, 0}), 1); }, {"max", "size 0"});
  expectThrowsWith([] { sum(Tensor::zeros({2}).toDType(DType::kFloat16)); }, {"sum", "float16"});
}

// ---------------------------------------------------------------- autograd

TEST(ReductionGrad, HandComputed) {
  Tensor x = Tensor::fromVector<double>({1, 2, 3, 4, 5, 6}, {2, 3});
  x.setRequiresGrad();
  backward(mean(x));
  expectValues(x.grad(), {2, 3}, {1.0 / 6, 1.0 / 6, 1.0 / 6, 1.0 / 6, 1.0 / 6, 1.0 / 6});
  Tensor y = Tensor::fromVector<double>({3, 9, 2, 7, 1, 9}, {2, 3});
  y.setRequiresGrad();
  backward(sum(max(y, 1)));  // gradient to the (first) argmax in each row
  expectValues(y.grad(), {2, 3}, {0, 1, 0, 0, 0, 1});
  Tensor z = Tensor::fromVector<double>({3, 9, 2, 9}, {2, 2});
  z.setRequiresGrad();
  backward(max(z) * 2.0);
  expectValues(z.grad(), {2, 2}, {0, 2, 0, 0});
}

TEST(ReductionGrad, SumAndMean) {
  Tensor a = randn({2, 3, 4}, 1);
  expectGradcheck([](const std::vector<Tensor>& in) { return sum(in[0]); }, {a});
  expectGradcheck([](const std::vector<Tensor>& in) { return mean(in[0]); }, {a});
  for (bool keep : {false, true}) {
    SCOPED_TRACE(keep ? "keepDim" : "no keepDim");
    for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{{0}, {1}, {-1}, {0, 2}, {0, 1, 2}}) {
      expectGradcheck([dims, keep](const std::vector<Tensor>& in) { return sum(in[0], dims, keep); }, {a});
      expectGradcheck([dims, keep](const std::vector<Tensor>& in) { return mean(in[0], dims, keep); }, {a});
    }
  }
  // non-contiguous input
  expectGradcheck([](const std::vector<Tensor>& in) { return sum(transpose(in[0], 0, 2), {1}); }, {a});
}

TEST(ReductionGrad, Var) {
  Tensor a = randn({3, 4}, 2);
  for (bool unbiased : {true, false}) {
    for (bool keep : {false, true}) {
      SCOPED_TRACE(std::string(unbiased ? "unbiased" : "biased") + (keep ? " keepDim" : ""));
      expectGradcheck([=](const std::vector<Tensor>& in) { return var(in[0], {1}, unbiased, keep); }, {a});
      expectGradcheck([=](const std::vector<Tensor>& in) { return var(in[0], {0}, unbiased, keep); }, {a});
      expectGradcheck([=](const std::vector<Tensor>& in) { return var(in[0], {0, 1}, unbiased, keep); }, {a});
    }
  }
}

TEST(ReductionGrad, Max) {
  Tensor a = randn({3, 4}, 3);  // distinct values almost surely
  expectGradcheck([](const std::vector<Tensor>& in) { return max(in[0]); }, {a});
  for (bool keep : {false, true}) {
    SCOPED_TRACE(keep ? "keepDim" : "no keepDim");
    expectGradcheck([keep](const std::vector<Tensor>& in) { return max(in[0], 0, keep); }, {a});
    expectGradcheck([keep](const std::vector<Tensor>& in) { return max(in[0], -1, keep); }, {a});
  }
  expectGradcheck([](const std::vector<Tensor>& in) { return max(transpose(in[0], 0, 1), 1); }, {a});
  // argmax is not differentiable
  EXPECT_FALSE(argmax(a, 0).requiresGrad());
}

}  // namespace
}  // namespace distgrad
