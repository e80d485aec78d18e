// softmax, logSoftmax, crossEntropy, nllLoss, mseLoss, dropout and embedding: values against hand-computed
// numbers, numerical stability, reductions, float64 gradchecks and argument errors.
#include <gtest/gtest.h>

#include <cmath>

#include "autograd_test_util.h"
#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "tensor/random.h"

namespace distgrad {
namespace {

using autograd_testing::randn;
using autograd_testing::expectValueError;

void expectNear(const std::vector<double>& actual, const std::vector<double>& expected, double tol) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) EXPECT_NEAR(actual[i], expected[i], tol) << "element " << i;
}

Tensor shaped(const std::vector<double>& values, const Shape& shape, DType dtype = DType::kFloat64) {
  return Tensor::fromVector(values, shape).toDType(dtype);
}

Tensor labels(const std::vector<int64_t>& values) {
  return Tensor::fromVector(values, {static_cast<int64_t>(values.size())});
}

autograd::GradcheckResult check1(const std::function<Tensor(const Tensor&)>& f, Tensor x) {
  x.setRequiresGrad();
  return autograd::gradcheck([&](const std::vector<Tensor>& in) { return f(in[0]); }, {x});
}

// ---------------------------------------------------------------- softmax family

TEST(SoftmaxTest, HandComputedRows) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = shaped({1, 2, 3, 0, 0, 0}, {2, 3}, dt);
    const double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
    expectNear(softmax(x, 1).toVector<double>(),
               {std::exp(1.0) / z, std::exp(2.0) / z, std::exp(3.0) / z, 1.0 / 3, 1.0 / 3, 1.0 / 3}, 1e-6);
    expectNear(logSoftmax(x, -1).toVector<double>(),
               {1 - std::log(z), 2 - std::log(z), 3 - std::log(z), -std::log(3.0), -std::log(3.0), -std::log(3.0)},
               1e-6);
  }
}

TEST(SoftmaxTest, StridedDimMatchesTransposedRows) {
  // Softmax over dim 1 of [2, 3, 4] (inner = 4) equals softmax over rows of the same data laid out with
  // that dim last.
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = randn({2, 3, 4}, 1, dt);
    const auto v = x.toVector<double>();
    std::vector<double> expected(v.size()), expectedLog(v.size());
    for (int64_t o = 0; o < 2; ++o) {
      for (int64_t i = 0; i < 4; ++i) {
        double z = 0;
        for (int64_t k = 0; k < 3; ++k) z += std::exp(v[static_cast<size_t>(o * 12 + k * 4 + i)]);
        for (int64_t k = 0; k < 3; ++k) {
          const size_t at = static_cast<size_t>(o * 12 + k * 4 + i);
          expected[at] = std::exp(v[at]) / z;
          expectedLog[at] = v[at] - std::log(z);
        }
      }
    }
    expectNear(softmax(x, 1).toVector<double>(), expected, 1e-6);
    expectNear(logSoftmax(x, 1).toVector<double>(), expectedLog, 1e-6);
    // Over dim 0 (inner = 12): the two entries of every column sum to 1.
    const auto s0 = softmax(x, 0).toVector<double>();
    for (size_t i = 0; i < 12; ++i) EXPECT_NEAR(s0[i] + s0[i + 12], 1.0, 1e-6);
  }
}

TEST(SoftmaxTest, LargeLogitsDoNotOverflow) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = shaped({1000, 1001, -1000, 10000}, {1, 4}, dt);
    auto p = softmax(x, 1).toVector<double>();
    expectNear(p, {0, 0, 0, 1}, 1e-6);
    auto lp = logSoftmax(x, 1).toVector<double>();
    EXPECT_NEAR(lp[3], 0, 1e-6);
    EXPECT_NEAR(lp[0], -9000, 1e-2);
    Tensor y = shaped({1000, 1001}, {1, 2}, dt);
    auto q = softmax(y, 1).toVector<double>();
    EXPECT_NEAR(q[1], 1 / (1 + std::exp(-1.0)), 1e-6);
  }
}

TEST(SoftmaxTest, Gradchecks) {
  for (int64_t dim : {0, 1, -1}) {
    EXPECT_TRUE(check1([dim](const Tensor& x) { return softmax(x, dim); }, randn({3, 4}, 2)).ok) << dim;
    EXPECT_TRUE(check1([dim](const Tensor& x) { return logSoftmax(x, dim); }, randn({3, 4}, 3)).ok) << dim;
  }
  auto r = check1([](const Tensor& x) { return softmax(x, 1); }, randn({2, 3, 4}, 4));
  EXPECT_TRUE(r.ok) << r.message;
  r = check1([](const Tensor& x) { return logSoftmax(x, 1); }, randn({2, 3, 4}, 5));
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(SoftmaxTest, BackwardFloat32MatchesFloat64) {
  Tensor x64 = randn({5, 7}, 6);
  Tensor x32 = x64.toDType(DType::kFloat32);
  x64.setRequiresGrad();
  x32.setRequiresGrad();
  Tensor gy = randn({5, 7}, 7);
  for (bool log : {false, true}) {
    Tensor y64 = log ? logSoftmax(x64, 1) : softmax(x64, 1);
    Tensor y32 = log ? logSoftmax(x32, 1) : softmax(x32, 1);
    expectNear(autograd::grad({y32}, {x32}, {gy.toDType(DType::kFloat32)})[0].toVector<double>(),
               autograd::grad({y64}, {x64}, {gy})[0].toVector<double>(), 1e-5);
  }
}

// ---------------------------------------------------------------- losses

TEST(LossTest, CrossEntropyEqualsNegativeLogSoftmaxPicked) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor logits = randn({4, 5}, 8, dt);
    Tensor t = labels({3, 0, 4, 1});
    const auto lsm = logSoftmax(logits, 1).toVector<double>();
    std::vector<double> picked;
    for (int64_t i = 0; i < 4; ++i) picked.push_back(-lsm[static_cast<size_t>(i * 5 + t.toVector<int64_t>()[i])]);
    const double sum = picked[0] + picked[1] + picked[2] + picked[3];
    expectNear(crossEntropy(logits, t, Reduction::kNone).toVector<double>(), picked, 1e-5);
    EXPECT_NEAR(crossEntropy(logits, t, Reduction::kSum).item(), sum, 1e-5);
    EXPECT_NEAR(crossEntropy(logits, t).item(), sum / 4, 1e-5);
    EXPECT_EQ(crossEntropy(logits, t).dim(), 0);
    // nllLoss of logSoftmax is the same loss.
    EXPECT_NEAR(nllLoss(logSoftmax(logits, 1), t).item(), sum / 4, 1e-5);
  }
}

TEST(LossTest, CrossEntropyHandComputedAndStable) {
  // Uniform logits: loss = log(C).
  EXPECT_NEAR(crossEntropy(Tensor::zeros({2, 4}, DType::kFloat64), labels({1, 2})).item(), std::log(4.0), 1e-12);
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    // Huge logits: log(1 + e^-1) for the right class with margin 1, no overflow.
    Tensor logits = shaped({5000, 5001, -3000, 4000}, {2, 2}, dt);
    auto l = crossEntropy(logits, labels({1, 0}), Reduction::kNone).toVector<double>();
    EXPECT_NEAR(l[0], std::log1p(std::exp(-1.0)), 1e-5);
    EXPECT_NEAR(l[1], 7000, 1e-2);
    EXPECT_TRUE(std::isfinite(crossEntropy(logits, labels({1, 0})).item()));
  }
}

TEST(LossTest, CrossEntropyBackwardIsSoftmaxMinusOneHot) {
  Tensor logits = randn({3, 4}, 9);
  logits.setRequiresGrad();
  Tensor t = labels({2, 0, 3});
  Tensor g = autograd::grad({crossEntropy(logits, t)}, {logits})[0];
  const auto p = softmax(logits.detach(), 1).toVector<double>();
  std::vector<double> expected(12);
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t c = 0; c < 4; ++c) {
      const size_t k = static_cast<size_t>(i * 4 + c);
      expected[k] = (p[k] - (c == t.toVector<int64_t>()[i] ? 1.0 : 0.0)) / 3.0;
    }
  }
  expectNear(g.toVector<double>(), expected, 1e-12);
}

TEST(LossTest, NllLossHandComputed) {
  Tensor lp = shaped({-1, -2, -3, -4, -5, -6}, {2, 3});
  Tensor t = labels({2, 0});
  expectNear(nllLoss(lp, t, Reduction::kNone).toVector<double>(), {3, 4}, 0);
  EXPECT_DOUBLE_EQ(nllLoss(lp, t, Reduction::kSum).item(), 7);
  EXPECT_DOUBLE_EQ(nllLoss(lp, t).item(), 3.5);
  lp.setRequiresGrad();
  Tensor g = autograd::grad({nllLoss(lp, t, Reduction::kSum)}, {lp})[0];
  expectNear(g.toVector<double>(), {0, 0, -1, -1, 0, 0}, 0);
}

TEST(LossTest, MseLossReductions) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    Tensor x = shaped({1, 2, 3, 4}, {2, 2}, dt), y = shaped({0, 2, 5, 1}, {2, 2}, dt);
    Tensor none = mseLoss(x, y, Reduction::kNone);
    EXPECT_EQ(none.shape(), (Shape{2, 2}));
    expectNear(none.toVector<double>(), {1, 0, 4, 9}, 0);
    EXPECT_DOUBLE_EQ(mseLoss(x, y, Reduction::kSum).item(), 14);
    EXPECT_DOUBLE_EQ(mseLoss(x, y).item(), 3.5);
    x.setRequiresGrad();
    y.setRequiresGrad();
    auto g = autograd::grad({mseLoss(x, y)}, {x, y});
    expectNear(g[0].toVector<double>(), {0.5, 0, -1, 1.5}, 1e-7);  // 2 (x - y) / 4
    expectNear(g[1].toVector<double>(), {-0.5, 0, 1, -1.5}, 1e-7);
  }
}

TEST(LossTest, Gradchecks) {
  Tensor t = labels({1, 0, 2, 2});
  for (Reduction r : {Reduction::kNone, Reduction::kMean, Reduction::kSum}) {
    auto ce = check1([&](const Tensor& x) { return crossEntropy(x, t, r); }, randn({4, 3}, 10));
    EXPECT_TRUE(ce.ok) << ce.message;
    auto nll = check1([&](const Tensor& x) { return nllLoss(x, t, r); }, randn({4, 3}, 11));
    EXPECT_TRUE(nll.ok) << nll.message;
    Tensor x = randn({3, 2}, 12), y = randn({3, 2}, 13);
    x.setRequiresGrad();
    y.setRequiresGrad();
    auto mse = autograd::gradcheck([&](const std::vector<Tensor>& in) { return mseLoss(in[0], in[1], r); }, {x, y});
    EXPECT_TRUE(mse.ok) << mse.message;
  }
}

TEST(LossTest, NonContiguousLogits) {
  // Transposed [3, 2] view of a [2, 3] buffer.
  Tensor base = randn({2, 3}, 14);
  Tensor view = Tensor::fromStorage(base.storage(), {3, 2}, {1, 3}, 0, DType::kFloat64);
  Tensor t = labels({0, 1, 1});
  EXPECT_NEAR(crossEntropy(view, t).item(), crossEntropy(view.cloneData(), t).item(), 1e-12);
}

TEST(LossTest, BadArgumentsThrow) {
  Tensor logits = Tensor::zeros({3, 4});
  expectValueError([&] { crossEntropy(logits, labels({0, 7, 1})); }, "crossEntropy: target 7 at position 1");
  expectValueError([&] { crossEntropy(logits, labels({0, -1, 1})); }, "target -1");
  expectValueError([&] { nllLoss(logits, labels({4, 0, 1})); }, "nllLoss: target 4 at position 0");
  expectValueError([&] { crossEntropy(logits, Tensor::zeros({3})); }, "crossEntropy: targets must be int64");
  expectValueError([&] { nllLoss(logits, Tensor::zeros({3}, DType::kFloat64)); }, "nllLoss: targets must be int64");
  expectValueError([&] { crossEntropy(logits, labels({0, 1})); }, "expected targets of shape [3]");
  expectValueError([&] { crossEntropy(Tensor::zeros({3, 4, 2}), labels({0, 1, 2})); },
                   "crossEntropy: expected logits of rank 2");
  expectValueError([&] { mseLoss(Tensor::zeros({2, 3}), Tensor::zeros({3, 2})); },
                   "mseLoss: input shape [2, 3] does not match target shape [3, 2]");
  expectValueError([&] { mseLoss(Tensor::zeros({2}), Tensor::zeros({2}, DType::kFloat64)); }, "mseLoss: input is");
}

// ---------------------------------------------------------------- dropout

TEST(DropoutTest, IdentityWhenEvalOrZeroP) {
  tensor::Generator gen(1);
  Tensor x = randn({4, 5}, 15);
  EXPECT_TRUE(dropout(x, 0.5, false, gen).sameAs(x));
  EXPECT_TRUE(dropout(x, 0.0, true, gen).sameAs(x));
}

TEST(DropoutTest, DropsAboutPAndScalesSurvivors) {
  for (DType dt : {DType::kFloat32, DType::kFloat64}) {
    tensor::Generator gen(2);
    Tensor x = Tensor::ones({100, 100}, dt);
    auto v = dropout(x, 0.3, true, gen).toVector<double>();
    int64_t dropped = 0;
    for (double e : v) {
      if (e == 0) ++dropped;
      else EXPECT_NEAR(e, 1 / 0.7, 1e-6);
    }
    // 10^4 Bernoulli(0.3) draws: sd ~ 46, so +-300 is a > 6 sigma band.
    EXPECT_NEAR(static_cast<double>(dropped), 3000, 300);
  }
}

TEST(DropoutTest, SameSeedSameMask) {
  Tensor x = randn({50}, 16);
  tensor::Generator a(7), b(7), c(8);
  auto va = dropout(x, 0.5, true, a).toVector<double>();
  EXPECT_EQ(va, dropout(x, 0.5, true, b).toVector<double>());
  EXPECT_NE(va, dropout(x, 0.5, true, c).toVector<double>());
}

TEST(DropoutTest, BackwardIsMaskTimesScale) {
  tensor::Generator gen(3);
  Tensor x = Tensor::ones({200});
  x.setRequiresGrad();
  Tensor y = dropout(x, 0.25, true, gen);
  Tensor gy = randn({200}, 17, DType::kFloat32);
  auto g = autograd::grad({y}, {x}, {gy})[0].toVector<double>();
  auto yv = y.toVector<double>();  // with x = 1, y is exactly the mask times the scale
  auto gv = gy.toVector<double>();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g[i], static_cast<double>(static_cast<float>(gv[i] * yv[i]))) << i;
}

TEST(DropoutTest, GradcheckWithFixedMask) {
  Tensor x = randn({3, 4}, 18);
  x.setRequiresGrad();
  auto r = autograd::gradcheck(
      [](const std::vector<Tensor>& in) {
        tensor::Generator gen(42);  // the same mask on every evaluation
        return dropout(in[0], 0.4, true, gen);
      },
      {x});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(DropoutTest, BadProbabilityThrows) {
  tensor::Generator gen(1);
  Tensor x = Tensor::ones({3});
  expectValueError([&] { dropout(x, 1.0, true, gen); }, "dropout: p must be in [0, 1), got 1");
  expectValueError([&] { dropout(x, -0.1, false, gen); }, "dropout: p must be in [0, 1), got -0.1");
}

// ---------------------------------------------------------------- embedding

TEST(EmbeddingTest, PicksRowsForAnyIndexShape) {
  Tensor w = shaped({0, 1, 10, 11, 20, 21, 30, 31}, {4, 2}, DType::kFloat32);
  Tensor idx = Tensor::fromVector(std::vector<int64_t>{3, 0, 1, 1, 2, 3}, {2, 3});
  Tensor y = embedding(w, idx);
  EXPECT_EQ(y.shape(), (Shape{2, 3, 2}));
  expectNear(y.toVector<double>(), {30, 31, 0, 1, 10, 11, 10, 11, 20, 21, 30, 31}, 0);
  Tensor scalarIdx = Tensor::fromVector(std::vector<int64_t>{2}, {});
  expectNear(embedding(w, scalarIdx).toVector<double>(), {20, 21}, 0);
}

TEST(EmbeddingTest, BackwardScatterAddsRepeatedIndices) {
  Tensor w = Tensor::zeros({4, 2}, DType::kFloat64);
  w.setRequiresGrad();
  Tensor idx = Tensor::fromVector(std::vector<int64_t>{1, 3, 1}, {3});
  Tensor y = embedding(w, idx);
  Tensor gy = shaped({1, 2, 3, 4, 5, 6}, {3, 2});
  Tensor g = autograd::grad({y}, {w}, {gy})[0];
  expectNear(g.toVector<double>(), {0, 0, 6, 8, 0, 0, 3, 4}, 0);
}

TEST(EmbeddingTest, Gradcheck) {
  Tensor idx = Tensor::fromVector(std::vector<int64_t>{0, 2, 2, 4, 1, 0}, {2, 3});
  auto r = check1([&](const Tensor& w) { return embedding(w, idx); }, randn({5, 3}, 19));
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(EmbeddingTest, BadArgumentsThrow) {
  Tensor w = Tensor::zeros({5, 3});
  expectValueError([&] { embedding(w, Tensor::fromVector(std::vector<int64_t>{1, 5}, {2})); },
                   "embedding: index 5 at position 1 is out of range for a weight with 5 rows");
  expectValueError([&] { embedding(w, Tensor::fromVector(std::vector<int64_t>{-1}, {1})); }, "embedding: index -1");
  expectValueError([&] { embedding(w, Tensor::zeros({2})); }, "embedding: indices must be int64");
  expectValueError([&] { embedding(Tensor::zeros({5}), Tensor::fromVector(std::vector<int64_t>{1}, {1})); },
                   "embedding: expected weight of rank 2");
}

// ---------------------------------------------------------------- composition

// A small CNN head built from these ops (and the elementwise/shape ops), so gradients flow through views,
// broadcasts and several of this file's backward formulas in one graph.
TEST(NnCompositionTest, GradcheckThroughAClassifierHead) {
  Tensor x = randn({3, 2, 6, 6}, 40), w = randn({2}, 41), b = randn({2}, 42);
  for (Tensor* t : {&x, &w, &b}) t->setRequiresGrad();
  Tensor targets = labels({1, 0, 3});
  auto head = [&](const std::vector<Tensor>& in) {
    Tensor h = batchNorm(in[0], in[1], in[2], Tensor(), Tensor(), true);
    h = tanh(h);
    h = maxPool2d(h, {{3, 3}, {2, 2}, {1, 1}, false});  // [3, 2, 3, 3]
    h = adaptiveAvgPool2d(h, {2, 2});                    // [3, 2, 2, 2]
    h = flatten(h, 1);                                   // [3, 8]
    h = narrow(h, 1, 0, 5);                              // a non-contiguous [3, 5] view
    return crossEntropy(h, targets) + mseLoss(softmax(h, 1), Tensor::full({3, 5}, 0.2, DType::kFloat64));
  };
  auto r = autograd::gradcheck(head, {x, w, b});
  EXPECT_TRUE(r.ok) << r.message;
}

}  // namespace
}  // namespace distgrad
