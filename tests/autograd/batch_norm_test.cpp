// batchNorm: training output and running-statistics update against hand-computed values, eval mode,
// float32 (oneDNN) against float64 (loops), gradchecks of x, weight and bias, and argument errors.
#include <gtest/gtest.h>

#include <cmath>

#include "autograd_test_util.h"
#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "tensor/cpu/batch_norm.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/random.h"
#include "test_util.h"

namespace distgrad {
namespace {

namespace kernels = tensor::kernels;

using autograd_testing::randn;
using autograd_testing::expectValueError;
using testing::expectNear;
using testing::shaped;

// Batch norm computed the obvious way in double: per channel of x [N, C, S...].
struct Reference {
  std::vector<double> out, mean, var;  // var biased
};
Reference reference(const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& useMean = Tensor(),
                    const Tensor& useVar = Tensor()) {
  const auto v = x.toVector<double>();
  const int64_t n = x.size(0), c = x.size(1), s = x.numel() / (n * c);
  Reference r;
  r.out.resize(v.size());
  for (int64_t ch = 0; ch < c; ++ch) {
    double m = 0, var = 0;
    if (useMean.defined()) {
      m = useMean.toVector<double>()[static_cast<size_t>(ch)];
      var = useVar.toVector<double>()[static_cast<size_t>(ch)];
    } else {
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < s; ++j) m += v[static_cast<size_t>((i * c + ch) * s + j)];
      m /= static_cast<double>(n * s);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < s; ++j) var += std::pow(v[static_cast<size_t>((i * c + ch) * s + j)] - m, 2);
      var /= static_cast<double>(n * s);
    }
    r.mean.push_back(m);
    r.var.push_back(var);
    const double wc = w.defined() ? w.toVector<double>()[static_cast<size_t>(ch)] : 1.0;
    const double bc = b.defined() ? b.toVector<double>()[static_cast<size_t>(ch)] : 0.0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < s; ++j) {
        const size_t k = static_cast<size_t>((i * c + ch) * s + j);
        r.out[k] = (v[k] - m) / std::sqrt(var + eps) * wc + bc;
      }
    }
  }
  return r;
}

TEST(BatchNormTest, TrainingStepHandComputed) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    // x [4, 1]: mean 2.5, biased var 1.25, unbiased 5/3.
    Tensor x = shaped({1, 2, 3, 4}, {4, 1}, dt);
    Tensor rm = Tensor::zeros({1}, dt), rv = Tensor::ones({1}, dt);
    Tensor y = batchNorm(x, Tensor(), Tensor(), rm, rv, true, 0.1, 0.0);
    const double sd = std::sqrt(1.25);
    expectNear(y.toVector<double>(), {-1.5 / sd, -0.5 / sd, 0.5 / sd, 1.5 / sd}, 1e-6);
    EXPECT_NEAR(rm.item(), 0.25, 1e-6);                     // 0.9 * 0 + 0.1 * 2.5
    EXPECT_NEAR(rv.item(), 0.9 + 0.1 * 5.0 / 3.0, 1e-6);  // unbiased variance, as PyTorch
    // A second step blends again from the updated values.
    batchNorm(x, Tensor(), Tensor(), rm, rv, true, 0.5, 0.0);
    EXPECT_NEAR(rm.item(), 0.5 * 0.25 + 0.5 * 2.5, 1e-6);
    EXPECT_NEAR(rv.item(), 0.5 * (0.9 + 0.1 * 5.0 / 3.0) + 0.5 * 5.0 / 3.0, 1e-6);
  }
}

TEST(BatchNormTest, TrainingMatchesReference4dAnd2d) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    for (const Shape& shape : {Shape{4, 3, 5, 6}, Shape{8, 5}, Shape{3, 2, 7}}) {
      const int64_t c = shape[1];
      Tensor x = randn(shape, 1, dt, 0.5, 2.0);
      Tensor w = randn({c}, 2, dt), b = randn({c}, 3, dt);
      Tensor rm = randn({c}, 4, dt), rv = Tensor::full({c}, 2.0, dt);
      const auto rm0 = rm.toVector<double>(), rv0 = rv.toVector<double>();
      Tensor y = batchNorm(x, w, b, rm, rv, true, 0.2, 1e-5);
      Reference ref = reference(x, w, b, 1e-5);
      expectNear(y.toVector<double>(), ref.out, dt == DType::kFloat32 ? 1e-4 : 1e-10);
      const double count = static_cast<double>(x.numel() / c);
      for (int64_t ch = 0; ch < c; ++ch) {
        const size_t k = static_cast<size_t>(ch);
        EXPECT_NEAR(rm.toVector<double>()[k], 0.8 * rm0[k] + 0.2 * ref.mean[k], 1e-5);
        EXPECT_NEAR(rv.toVector<double>()[k], 0.8 * rv0[k] + 0.2 * ref.var[k] * count / (count - 1), 1e-5);
      }
    }
  }
}

TEST(BatchNormTest, EvalUsesRunningStatistics) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = randn({3, 4, 2, 5}, 5, dt);
    Tensor w = randn({4}, 6, dt), b = randn({4}, 7, dt);
    Tensor rm = randn({4}, 8, dt), rv = Tensor::fromVector(std::vector<double>{0.5, 1, 2, 4}, {4}).toDType(dt);
    const auto rm0 = rm.toVector<double>();
    Tensor y = batchNorm(x, w, b, rm, rv, false, 0.1, 1e-3);
    expectNear(y.toVector<double>(), reference(x, w, b, 1e-3, rm, rv).out, 1e-5);
    expectNear(rm.toVector<double>(), rm0, 0);  // eval never updates the running statistics
    // Undefined weight/bias: plain normalisation.
    Tensor z = batchNorm(x, Tensor(), Tensor(), rm, rv, false, 0.1, 1e-3);
    expectNear(z.toVector<double>(), reference(x, Tensor(), Tensor(), 1e-3, rm, rv).out, 1e-5);
  }
}

TEST(BatchNormTest, TrainingWithoutRunningStatsOrAffine) {
  Tensor x = randn({5, 3, 2, 2}, 9);
  Tensor y = batchNorm(x, Tensor(), Tensor(), Tensor(), Tensor(), true);
  expectNear(y.toVector<double>(), reference(x, Tensor(), Tensor(), 1e-5).out, 1e-10);
}

// Gradients of all three inputs, float32 (oneDNN for training) against float64 (loops).
TEST(BatchNormTest, Float32MatchesFloat64Backward) {
  for (bool training : {true, false}) {
    for (const Shape& shape : {Shape{4, 3, 5, 6}, Shape{6, 4}}) {
      const int64_t c = shape[1];
      Tensor x64 = randn(shape, 10, DType::kFloat64, 1.0, 3.0), w64 = randn({c}, 11), b64 = randn({c}, 12);
      Tensor rm = randn({c}, 13), rv = Tensor::full({c}, 1.5, DType::kFloat64);
      Tensor x32 = x64.toDType(DType::kFloat32), w32 = w64.toDType(DType::kFloat32), b32 = b64.toDType(DType::kFloat32);
      for (Tensor* t : {&x64, &w64, &b64, &x32, &w32, &b32}) t->setRequiresGrad();
      Tensor y64 = batchNorm(x64, w64, b64, rm, rv, training);
      Tensor y32 = batchNorm(x32, w32, b32, rm.toDType(DType::kFloat32), rv.toDType(DType::kFloat32), training);
      expectNear(y32.toVector<double>(), y64.toVector<double>(), 1e-4);
      Tensor gy = randn(shape, 14);
      auto g64 = autograd::grad({y64}, {x64, w64, b64}, {gy});
      auto g32 = autograd::grad({y32}, {x32, w32, b32}, {gy.toDType(DType::kFloat32)});
      for (size_t i = 0; i < 3; ++i) {
        expectNear(g32[i].toVector<double>(), g64[i].toVector<double>(), 2e-4);
      }
    }
  }
}

TEST(BatchNormTest, OneDnnAndLoopsAgreeOnFloat32) {
  Tensor x = randn({8, 6, 7, 7}, 15, DType::kFloat32, 2.0, 0.5);
  Tensor w = randn({6}, 16, DType::kFloat32), b = randn({6}, 17, DType::kFloat32);
  auto a = kernels::batchNormTrain(x, w, b, 1e-5, kernels::CpuImpl::kOneDnn);
  auto l = kernels::batchNormTrain(x, w, b, 1e-5, kernels::CpuImpl::kLoops);
  expectNear(a.output.toVector<double>(), l.output.toVector<double>(), 1e-4);
  expectNear(a.mean.toVector<double>(), l.mean.toVector<double>(), 1e-5);
  expectNear(a.var.toVector<double>(), l.var.toVector<double>(), 1e-5);
  Tensor gy = randn(x.shape(), 18, DType::kFloat32);
  for (std::array<bool, 3> need : {std::array<bool, 3>{true, true, true}, std::array<bool, 3>{true, false, false},
                                   std::array<bool, 3>{false, true, true}}) {
    auto ga = kernels::batchNormBackward(gy, x, w, a.mean, a.var, 1e-5, true, need, kernels::CpuImpl::kOneDnn);
    auto gl = kernels::batchNormBackward(gy, x, w, a.mean, a.var, 1e-5, true, need, kernels::CpuImpl::kLoops);
    for (auto [p, q] : {std::pair{ga.x, gl.x}, std::pair{ga.weight, gl.weight}, std::pair{ga.bias, gl.bias}}) {
      ASSERT_EQ(p.defined(), q.defined());
      if (p.defined()) expectNear(p.toVector<double>(), q.toVector<double>(), 1e-3);
    }
    EXPECT_EQ(ga.x.defined(), need[0]);
    EXPECT_EQ(ga.weight.defined(), need[1]);
    EXPECT_EQ(ga.bias.defined(), need[2]);
  }
  Tensor rm = randn({6}, 19, DType::kFloat32), rv = Tensor::full({6}, 0.7, DType::kFloat32);
  expectNear(kernels::batchNormEval(x, w, b, rm, rv, 1e-5, kernels::CpuImpl::kOneDnn).toVector<double>(),
             kernels::batchNormEval(x, w, b, rm, rv, 1e-5, kernels::CpuImpl::kLoops).toVector<double>(), 1e-4);
}

TEST(BatchNormTest, GradcheckTrainingXWeightBias) {
  for (const Shape& shape : {Shape{3, 2, 3, 2}, Shape{5, 3}}) {
    const int64_t c = shape[1];
    Tensor x = randn(shape, 20), w = randn({c}, 21), b = randn({c}, 22);
    Tensor rm = Tensor::zeros({c}, DType::kFloat64), rv = Tensor::ones({c}, DType::kFloat64);
    for (Tensor* t : {&x, &w, &b}) t->setRequiresGrad();
    auto r = autograd::gradcheck(
        [&](const std::vector<Tensor>& in) { return batchNorm(in[0], in[1], in[2], rm, rv, true); }, {x, w, b});
    EXPECT_TRUE(r.ok) << r.message;
  }
}

TEST(BatchNormTest, GradcheckTrainingWithoutAffine) {
  Tensor x = randn({4, 2, 2, 2}, 23);
  x.setRequiresGrad();
  auto r = autograd::gradcheck(
      [&](const std::vector<Tensor>& in) { return batchNorm(in[0], Tensor(), Tensor(), Tensor(), Tensor(), true); },
      {x});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(BatchNormTest, GradcheckEval) {
  Tensor x = randn({3, 2, 2, 3}, 24), w = randn({2}, 25), b = randn({2}, 26);
  Tensor rm = randn({2}, 27), rv = Tensor::full({2}, 0.8, DType::kFloat64);
  for (Tensor* t : {&x, &w, &b}) t->setRequiresGrad();
  auto r = autograd::gradcheck(
      [&](const std::vector<Tensor>& in) { return batchNorm(in[0], in[1], in[2], rm, rv, false); }, {x, w, b});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(BatchNormTest, OnlyWeightRequiresGrad) {
  Tensor x = randn({4, 3}, 28), w = randn({3}, 29), b = randn({3}, 30);
  w.setRequiresGrad();
  Tensor y = batchNorm(x, w, b, Tensor(), Tensor(), true);
  Tensor gy = randn({4, 3}, 31);
  Tensor gw = autograd::grad({y}, {w}, {gy})[0];
  // d/dw_c = sum_n gy[n,c] * xhat[n,c]
  Reference ref = reference(x, Tensor(), Tensor(), 1e-5);
  const auto g = gy.toVector<double>();
  for (int64_t c = 0; c < 3; ++c) {
    double expected = 0;
    for (int64_t n = 0; n < 4; ++n) expected += g[static_cast<size_t>(n * 3 + c)] * ref.out[static_cast<size_t>(n * 3 + c)];
    EXPECT_NEAR(gw.toVector<double>()[static_cast<size_t>(c)], expected, 1e-10);
  }
}

TEST(BatchNormTest, ThreadedLoopsMatchSingleThreaded) {
  Tensor x = randn({4, 6, 5, 5}, 32, DType::kFloat32), w = randn({6}, 33, DType::kFloat32),
         b = randn({6}, 34, DType::kFloat32);
  for (Tensor* t : {&x, &w, &b}) t->setRequiresGrad();
  Tensor gy = randn(x.shape(), 35, DType::kFloat32);
  auto run = [&] {
    Tensor y = batchNorm(x, w, b, Tensor(), Tensor(), true);
    std::vector<std::vector<double>> r{y.toVector<double>()};
    for (const Tensor& g : autograd::grad({y}, {x, w, b}, {gy})) r.push_back(g.toVector<double>());
    return r;
  };
  auto single = run();
  tensor::setNumThreads(2);
  auto threaded = run();
  tensor::setNumThreads(1);
  EXPECT_EQ(single, threaded);  // channels are independent: threads change nothing, not even rounding
}

TEST(BatchNormTest, EvalOnEmptyBatch) {
  Tensor y = batchNorm(Tensor::zeros({0, 3}), Tensor(), Tensor(), Tensor::zeros({3}), Tensor::ones({3}), false);
  EXPECT_EQ(y.shape(), (Shape{0, 3}));
}

TEST(BatchNormTest, BadArgumentsThrow) {
  Tensor x = Tensor::zeros({4, 3, 2, 2});
  Tensor c3 = Tensor::ones({3});
  expectValueError([&] { batchNorm(Tensor::zeros({5}), Tensor(), Tensor(), Tensor(), Tensor(), true); },
                   "batchNorm: expected x of shape");
  expectValueError([&] { batchNorm(x, Tensor::ones({4}), Tensor(), Tensor(), Tensor(), true); },
                   "batchNorm: weight must have shape [3]");
  expectValueError([&] { batchNorm(x, c3, Tensor::ones({3, 1}), Tensor(), Tensor(), true); },
                   "batchNorm: bias must have shape [3]");
  expectValueError([&] { batchNorm(x, Tensor::ones({3}, DType::kFloat64), Tensor(), Tensor(), Tensor(), true); },
                   "batchNorm: weight is float64 but x is float32");
  expectValueError([&] { batchNorm(x, c3, c3, Tensor(), Tensor(), false); }, "eval mode");
  expectValueError([&] { batchNorm(Tensor::zeros({1, 3}), c3, c3, Tensor(), Tensor(), true); },
                   "more than one value per channel");
  expectValueError([&] { batchNorm(x, c3, c3, c3, c3, true, 1.5); }, "momentum must be in [0, 1]");
  expectValueError([&] { batchNorm(Tensor::zeros({4, 3}, DType::kInt64), Tensor(), Tensor(), Tensor(), Tensor(), true); },
                   "float32 or float64");
}

}  // namespace
}  // namespace distgrad
