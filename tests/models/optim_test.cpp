// Optimizers and LR schedules: step values against hand-computed numbers (PyTorch's formulas evaluated in
// double precision by hand / in Python), explicit-gradient steps, validation.
#include <gtest/gtest.h>

#include <cmath>

#include "models/checkpoint.h"
#include "models/optim/adam.h"
#include "models/optim/clip_grad.h"
#include "models/optim/lr_scheduler.h"
#include "models/optim/sgd.h"
#include "test_util.h"

namespace distgrad::models::optim {
namespace {

Tensor param(std::vector<float> values) {
  Tensor p = Tensor::fromVector(values, {static_cast<int64_t>(values.size())});
  p.setRequiresGrad(true);
  return p;
}

// Runs `steps` updates with the same gradient `g` each step, returning the parameter after each step.
template <typename Opt>
std::vector<std::vector<float>> run(Opt& opt, Tensor p, const std::vector<std::vector<float>>& grads) {
  std::vector<std::vector<float>> out;
  for (const auto& g : grads) {
    p.setGrad(Tensor::fromVector(g, p.shape()));
    opt.step();
    out.push_back(p.toVector<float>());
  }
  return out;
}

void expectNear(const std::vector<float>& actual, const std::vector<double>& expected, double tol = 1e-6) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) EXPECT_NEAR(actual[i], expected[i], tol) << "element " << i;
}

TEST(SGD, PlainStep) {
  Tensor p = param({1.0f, -2.0f});
  SGD opt({p}, {.learningRate = 0.1});
  auto r = run(opt, p, {{0.5f, 1.0f}, {0.5f, 1.0f}});
  expectNear(r[0], {0.95, -2.1});
  expectNear(r[1], {0.9, -2.2});
  EXPECT_EQ(opt.stepCount(), 2);
}

TEST(SGD, Momentum) {
  Tensor p = param({1.0f, -2.0f});
  SGD opt({p}, {.learningRate = 0.1, .momentum = 0.9});
  // buf: g, 1.9 g, 2.71 g.
  auto r = run(opt, p, {{0.5f, 1.0f}, {0.5f, 1.0f}, {0.5f, 1.0f}});
  expectNear(r[0], {0.95, -2.1});
  expectNear(r[1], {0.855, -2.29});
  expectNear(r[2], {0.7195, -2.561});
  expectNear(opt.momentumBuffer(0).toVector<float>(), {2.71 * 0.5, 2.71});
}

TEST(SGD, MomentumWithDampening) {
  Tensor p = param({1.0f, -2.0f});
  SGD opt({p}, {.learningRate = 0.1, .momentum = 0.9, .dampening = 0.5});
  // The first step stores the gradient undampened; the second is 0.9 g + 0.5 g.
  auto r = run(opt, p, {{0.5f, 1.0f}, {0.5f, 1.0f}});
  expectNear(r[0], {0.95, -2.1});
  expectNear(r[1], {0.88, -2.24});
}

TEST(SGD, Nesterov) {
  Tensor p = param({1.0f, -2.0f});
  SGD opt({p}, {.learningRate = 0.1, .momentum = 0.9, .nesterov = true});
  // d = g + 0.9 buf: 1.9 g, then 2.71 g.
  auto r = run(opt, p, {{0.5f, 1.0f}, {0.5f, 1.0f}});
  expectNear(r[0], {0.905, -2.19});
  expectNear(r[1], {0.7695, -2.461});
}

TEST(SGD, WeightDecay) {
  Tensor p = param({1.0f, -2.0f});
  SGD opt({p}, {.learningRate = 0.1, .weightDecay = 0.1});
  auto r = run(opt, p, {{0.5f, 1.0f}, {0.5f, 1.0f}});
  expectNear(r[0], {0.94, -2.08});
  expectNear(r[1], {0.8806, -2.1592});
}

TEST(SGD, WeightDecayWithMomentum) {
  Tensor p = param({1.0f});
  SGD opt({p}, {.learningRate = 0.1, .momentum = 0.5, .weightDecay = 0.1});
  // step 1: d = 0.5 + 0.1 = 0.6, buf = 0.6, p = 0.94
  // step 2: d = 0.5 + 0.094 = 0.594, buf = 0.3 + 0.594 = 0.894, p = 0.94 - 0.0894 = 0.8506
  auto r = run(opt, p, {{0.5f}, {0.5f}});
  expectNear(r[0], {0.94});
  expectNear(r[1], {0.8506});
}

TEST(SGD, Float64Parameters) {
  Tensor p = Tensor::fromVector(std::vector<double>{1.0, 2.0}, {2});
  p.setRequiresGrad(true);
  SGD opt({p}, {.learningRate = 0.5, .momentum = 0.9});
  p.setGrad(Tensor::fromVector(std::vector<double>{1.0, -1.0}, {2}));
  opt.step();
  opt.step();  // buf = 1.9 g
  auto v = p.toVector<double>();
  EXPECT_DOUBLE_EQ(v[0], 1.0 - 0.5 - 0.95);
  EXPECT_DOUBLE_EQ(v[1], 2.0 + 0.5 + 0.95);
}

TEST(SGD, ExplicitGradientsAndSkipping) {
  Tensor a = param({1.0f, 1.0f});
  Tensor b = param({5.0f});
  SGD opt({a, b}, {.learningRate = 1.0, .momentum = 0.9});
  // .grad is ignored by step(grads); an undefined gradient leaves its parameter (and state) alone.
  a.setGrad(Tensor::fromVector({100.0f, 100.0f}, {2}));
  opt.step({Tensor::fromVector({0.25f, -0.5f}, {2}), Tensor()});
  expectNear(a.toVector<float>(), {0.75, 1.5});
  expectNear(b.toVector<float>(), {5.0});
  EXPECT_FALSE(opt.momentumBuffer(1).defined());
  // step() with .grad: b has none, so it stays.
  a.setGrad(Tensor::fromVector({0.0f, 0.0f}, {2}));
  opt.step();
  expectNear(a.toVector<float>(), {0.75 - 0.9 * 0.25, 1.5 + 0.9 * 0.5});
  expectNear(b.toVector<float>(), {5.0});
}

TEST(SGD, StepDoesNotRecordAndKeepsIdentity) {
  Tensor p = param({1.0f});
  const void* before = p.rawData();
  SGD opt({p}, {.learningRate = 0.1});
  p.setGrad(Tensor::fromVector({1.0f}, {1}));
  opt.step();
  EXPECT_EQ(p.rawData(), before);  // updated in place
  EXPECT_TRUE(p.isLeaf());
  EXPECT_TRUE(p.requiresGrad());
}

TEST(SGD, NonContiguousGradient) {
  Tensor p = param({1.0f, 2.0f});
  SGD opt({p}, {.learningRate = 1.0});
  // A strided view (every other element of a 4-vector) as the gradient.
  Tensor base = Tensor::fromVector({1.0f, 9.0f, 2.0f, 9.0f}, {4});
  Tensor g = Tensor::fromStorage(base.storage(), {2}, {2}, 0, DType::kFloat32);
  ASSERT_FALSE(g.isContiguous());
  opt.step({g});
  expectNear(p.toVector<float>(), {0.0, 0.0});
}

TEST(SGD, Validation) {
  Tensor p = param({1.0f, 2.0f});
  EXPECT_THROW(SGD({p}, {.learningRate = -1.0}), ValueError);
  EXPECT_THROW(SGD({p}, {.learningRate = 0.1, .momentum = 0.0, .nesterov = true}), ValueError);
  EXPECT_THROW(SGD({p}, {.learningRate = 0.1, .momentum = 0.9, .dampening = 0.1, .nesterov = true}), ValueError);
  EXPECT_THROW(SGD({}, {.learningRate = 0.1}), ValueError);
  EXPECT_THROW(SGD({p, p}, {.learningRate = 0.1}), ValueError);
  Tensor labels = Tensor::zeros({2}, DType::kInt64);
  EXPECT_THROW(SGD({labels}, {.learningRate = 0.1}), ValueError);

  SGD opt({p}, {.learningRate = 0.1});
  try {
    opt.step({Tensor::zeros({3})});
    FAIL() << "expected a shape error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("SGD::step"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[3]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(opt.step({Tensor::zeros({2}), Tensor::zeros({2})}), ValueError);
  EXPECT_THROW(opt.step({Tensor::zeros({2}, DType::kFloat64)}), ValueError);
  expectNear(p.toVector<float>(), {1.0, 2.0});  // nothing applied
}

TEST(Optimizer, ZeroGradAndLearningRate) {
  Tensor p = param({1.0f});
  SGD opt({p}, {.learningRate = 0.1});
  p.setGrad(Tensor::fromVector({1.0f}, {1}));
  opt.zeroGrad();
  EXPECT_FALSE(p.grad().defined());
  opt.setLearningRate(0.5);
  EXPECT_DOUBLE_EQ(opt.learningRate(), 0.5);
  EXPECT_THROW(opt.setLearningRate(-0.1), ValueError);
  EXPECT_THROW(opt.setLearningRate(std::nan("")), ValueError);
}

TEST(Adam, ThreeSteps) {
  Tensor p = param({1.0f, -2.0f});
  Adam opt({p}, {.learningRate = 0.1});
  auto r = run(opt, p, {{0.5f, 1.0f}, {-1.0f, 2.0f}, {0.25f, -0.5f}});
  expectNear(r[0], {0.9000000020, -2.0999999990});
  expectNear(r[1], {0.9366103542, -2.1965182010});
  expectNear(r[2], {0.9502794203, -2.2553788738});
  EXPECT_EQ(opt.parameterStep(0), 3);
  // m after 3 steps for element 0: 0.9^2 * 0.05 + 0.9 * (-0.1) + 0.025
  EXPECT_NEAR(opt.expAvg(0).toVector<float>()[0], 0.81 * 0.05 - 0.09 + 0.025, 1e-7);
}

TEST(Adam, L2WeightDecay) {
  Tensor p = param({1.0f});
  Adam opt({p}, {.learningRate = 0.1, .weightDecay = 0.1});
  auto r = run(opt, p, {{0.5f}, {-1.0f}, {0.25f}});
  expectNear(r[0], {0.9000000017});
  expectNear(r[1], {0.9252635194});
  expectNear(r[2], {0.9247305743});
}

TEST(Adam, Amsgrad) {
  Tensor p = param({1.0f});
  Tensor q = param({1.0f});
  Adam ams({p}, {.learningRate = 0.1, .amsgrad = true});
  Adam plain({q}, {.learningRate = 0.1});
  auto r = run(ams, p, {{1.0f}, {0.0f}, {0.0f}});
  auto s = run(plain, q, {{1.0f}, {0.0f}, {0.0f}});
  expectNear(r[1], {0.8330276878});
  expectNear(r[2], {0.7812837872});
  expectNear(s[1], {0.8329941765});
  expectNear(s[2], {0.7811984802});
}

TEST(AdamW, DecoupledWeightDecay) {
  Tensor p = param({1.0f, -2.0f});
  AdamW opt({p}, {.learningRate = 0.1, .weightDecay = 0.1});
  auto r = run(opt, p, {{0.5f, 1.0f}, {-1.0f, 2.0f}, {0.25f, -0.5f}});
  expectNear(r[0], {0.8900000020, -2.0799999990});
  expectNear(r[1], {0.9177103542, -2.1557182010});
  expectNear(r[2], {0.9222023168, -2.1930216918});
  EXPECT_EQ(opt.name(), "AdamW");
  EXPECT_DOUBLE_EQ(AdamWOptions{}.weightDecay, 1e-2);
}

TEST(Adam, SkippedParameterDoesNotAdvance) {
  Tensor a = param({1.0f});
  Tensor b = param({1.0f});
  Adam opt({a, b}, {.learningRate = 0.1});
  opt.step({Tensor::fromVector({0.5f}, {1}), Tensor()});
  opt.step({Tensor::fromVector({0.5f}, {1}), Tensor::fromVector({0.5f}, {1})});
  EXPECT_EQ(opt.parameterStep(0), 2);
  EXPECT_EQ(opt.parameterStep(1), 1);
  // b's first update is a bias-corrected first step: exactly lr * g / (|g| + eps).
  EXPECT_NEAR(b.toVector<float>()[0], 0.9, 1e-6);
}

TEST(Adam, Validation) {
  Tensor p = param({1.0f});
  EXPECT_THROW(Adam({p}, {.beta1 = 1.0}), ValueError);
  EXPECT_THROW(Adam({p}, {.beta2 = -0.1}), ValueError);
  EXPECT_THROW(Adam({p}, {.eps = -1.0}), ValueError);
  EXPECT_THROW(AdamW({p}, {.weightDecay = -1.0}), ValueError);
}

TEST(LRScheduler, StepLR) {
  Tensor p = param({1.0f});
  SGD opt({p}, {.learningRate = 0.1});
  StepLR sched(opt, 3, 0.5);
  std::vector<double> lrs{opt.learningRate()};
  for (int i = 0; i < 7; ++i) {
    sched.step();
    lrs.push_back(opt.learningRate());
  }
  const std::vector<double> expected{0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025};
  ASSERT_EQ(lrs.size(), expected.size());
  for (size_t i = 0; i < lrs.size(); ++i) EXPECT_NEAR(lrs[i], expected[i], 1e-12) << "epoch " << i;
  EXPECT_EQ(sched.epoch(), 7);
  sched.setEpoch(9);
  EXPECT_NEAR(opt.learningRate(), 0.0125, 1e-12);
  EXPECT_THROW(StepLR(opt, 0), ValueError);
}

TEST(LRScheduler, CosineAnnealing) {
  Tensor p = param({1.0f});
  Adam opt({p}, {.learningRate = 0.1});
  CosineAnnealingLR sched(opt, 4, 0.001);
  const std::vector<double> expected{0.1, 0.0855017856687341, 0.0505, 0.0154982143312659, 0.001,
                                     0.01549821433126589};
  EXPECT_NEAR(opt.learningRate(), expected[0], 1e-12);
  for (size_t e = 1; e < expected.size(); ++e) {
    sched.step();
    EXPECT_NEAR(opt.learningRate(), expected[e], 1e-12) << "epoch " << e;
  }
  EXPECT_DOUBLE_EQ(sched.baseLearningRate(), 0.1);
  EXPECT_THROW(CosineAnnealingLR(opt, 0), ValueError);
}

TEST(ClipGrad, ScalesToMaxNorm) {
  Tensor a = param({3.0f, 0.0f});
  Tensor b = param({4.0f});
  a.setGrad(Tensor::fromVector({3.0f, 0.0f}, {2}));
  b.setGrad(Tensor::fromVector({4.0f}, {1}));
  const double norm = clipGradNorm({a, b}, 1.0);
  EXPECT_NEAR(norm, 5.0, 1e-9);
  expectNear(a.grad().toVector<float>(), {0.6, 0.0}, 1e-5);
  expectNear(b.grad().toVector<float>(), {0.8}, 1e-5);
  // Below the limit: untouched.
  EXPECT_NEAR(clipGradNorm({a, b}, 10.0), 1.0, 1e-5);
  expectNear(b.grad().toVector<float>(), {0.8}, 1e-5);
  EXPECT_THROW(clipGradNorm({a}, 0.0), ValueError);
}

// ---------------------------------------------------------------- optimizer state (resume)

// Trains `a` for two steps, moves its state (through a checkpoint file) into `b`, which optimises a copy of
// the same parameters, then checks a further step keeps both in lockstep.
template <typename Opt, typename Options>
void expectResumable(const Options& options) {
  testing::TempDir dir;
  Tensor pa = param({1.0f, -2.0f, 0.5f});
  Tensor pb = param({0.0f, 0.0f, 0.0f});
  Tensor qa = param({3.0f});
  Tensor qb = param({0.0f});
  Opt a({pa, qa}, options);
  const std::vector<std::vector<float>> gs{{0.5f, 1.0f, -0.25f}, {-1.0f, 2.0f, 0.1f}, {0.3f, -0.2f, 0.7f}};
  a.step({Tensor::fromVector(gs[0], {3}), Tensor()});  // q has no state yet after this step
  a.step({Tensor::fromVector(gs[1], {3}), Tensor::fromVector({1.0f}, {1})});
  a.setLearningRate(0.05);
  writeCheckpoint(a.stateDict(), dir.file("opt.ckpt"));

  Opt b({pb, qb}, options);
  pb.copyFrom(pa);
  qb.copyFrom(qa);
  b.loadStateDict(readCheckpoint(dir.file("opt.ckpt")));
  EXPECT_DOUBLE_EQ(b.learningRate(), 0.05);
  EXPECT_EQ(b.stepCount(), 2);
  a.step({Tensor::fromVector(gs[2], {3}), Tensor::fromVector({-1.0f}, {1})});
  b.step({Tensor::fromVector(gs[2], {3}), Tensor::fromVector({-1.0f}, {1})});
  EXPECT_EQ(pa.toVector<float>(), pb.toVector<float>());
  EXPECT_EQ(qa.toVector<float>(), qb.toVector<float>());
}

TEST(OptimizerState, SgdMomentumResumes) {
  expectResumable<SGD>(SgdOptions{.learningRate = 0.1, .momentum = 0.9, .nesterov = true});
}

TEST(OptimizerState, AdamResumes) { expectResumable<Adam>(AdamOptions{.learningRate = 0.1, .amsgrad = true}); }

TEST(OptimizerState, AdamWResumes) { expectResumable<AdamW>(AdamWOptions{.learningRate = 0.1}); }

TEST(OptimizerState, KeysAndValues) {
  Tensor p = param({1.0f, 2.0f});
  Tensor q = param({1.0f});
  Adam opt({p, q}, {.learningRate = 0.1});
  opt.step({Tensor::fromVector({0.5f, 1.0f}, {2}), Tensor()});
  StateDict s = opt.stateDict();
  EXPECT_EQ(s.keys(), (std::vector<std::string>{"learning_rate", "step_count", "0.step", "0.exp_avg", "0.exp_avg_sq"}));
  EXPECT_EQ(s.at("0.step").item(), 1.0);
  expectNear(s.at("0.exp_avg").toVector<float>(), {0.05, 0.1});
  // The state dict holds copies: stepping again does not change it.
  opt.step({Tensor::fromVector({0.5f, 1.0f}, {2}), Tensor()});
  expectNear(s.at("0.exp_avg").toVector<float>(), {0.05, 0.1});
  SGD plain({p}, {.learningRate = 0.1});
  EXPECT_EQ(plain.stateDict().keys(), (std::vector<std::string>{"learning_rate", "step_count"}));
}

TEST(OptimizerState, LoadErrorsChangeNothing) {
  Tensor p = param({1.0f, 2.0f});
  SGD sgd({p}, {.learningRate = 0.1, .momentum = 0.9});
  Adam adam({p}, {.learningRate = 0.1});
  adam.step({Tensor::fromVector({0.5f, 1.0f}, {2})});
  sgd.step({Tensor::fromVector({0.5f, 1.0f}, {2})});
  const auto before = sgd.momentumBuffer(0).toVector<float>();
  auto errorOf = [&](const StateDict& s) {
    try {
      sgd.loadStateDict(s);
    } catch (const ValueError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  std::string err = errorOf(adam.stateDict());
  EXPECT_NE(err.find("unexpected keys '0.step'"), std::string::npos) << err;
  StateDict wrongShape;
  wrongShape.insert("learning_rate", Tensor::scalar(0.1, DType::kFloat64));
  wrongShape.insert("step_count", Tensor::scalar(1, DType::kInt64));
  wrongShape.insert("0.momentum_buffer", Tensor::zeros({3}));
  err = errorOf(wrongShape);
  EXPECT_NE(err.find("'0.momentum_buffer' is float32 [3] but parameter 0 is float32 [2]"), std::string::npos) << err;
  err = errorOf(StateDict{});
  EXPECT_NE(err.find("missing 'learning_rate'"), std::string::npos) << err;
  StateDict partial = adam.stateDict();
  Adam other({p}, {.learningRate = 0.1});
  StateDict onlySome;
  for (const auto& [k, v] : partial) {
    if (k != "0.exp_avg_sq") onlySome.insert(k, v);
  }
  EXPECT_THROW(other.loadStateDict(onlySome), ValueError);
  EXPECT_EQ(other.parameterStep(0), 0);
  EXPECT_EQ(sgd.momentumBuffer(0).toVector<float>(), before);
  EXPECT_DOUBLE_EQ(sgd.learningRate(), 0.1);
}

}  // namespace
}  // namespace distgrad::models::optim
