// nn modules: registration and naming, modes, dtype conversion, state dicts, each layer's output against a
// reference computed directly (loops or the ops), and float64 gradchecks through the modules' parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "autograd/engine.h"
#include "autograd/gradcheck.h"
#include "autograd/ops.h"
#include "models/nn/nn.h"
#include "tensor/random.h"

namespace distgrad::models {
namespace {

std::string errorOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "";
}

void expectClose(const Tensor& actual, const std::vector<double>& expected, double tol) {
  auto a = actual.toVector<double>();
  ASSERT_EQ(a.size(), expected.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], expected[i], tol) << "element " << i;
}

void expectClose(const Tensor& actual, const Tensor& expected, double tol) {
  ASSERT_EQ(actual.shape(), expected.shape());
  expectClose(actual, expected.toVector<double>(), tol);
}

std::vector<std::string> namesOf(const std::vector<std::pair<std::string, Tensor>>& named) {
  std::vector<std::string> out;
  for (const auto& [n, t] : named) out.push_back(n);
  return out;
}

// A module with its own parameter and buffer plus nested children, to exercise the base class.
class Block : public Module {
 public:
  explicit Block(tensor::Generator& gen) : Module("Block") {
    scale_ = Tensor::ones({2});
    registerParameter("scale", scale_);
    count_ = Tensor::zeros({1});
    registerBuffer("count", count_);
    inner_ = registerModule("inner", std::make_shared<Linear>(2, 2, gen));
    norm_ = registerModule("norm", std::make_shared<BatchNorm2d>(2));
  }
  Tensor forward(const Tensor& x) override { return norm_->forward(inner_->forward(x * scale_)); }
  void registerBadName(const std::string& name) { registerParameter(name, scale_); }

  Tensor scale_, count_;
  std::shared_ptr<Linear> inner_;
  std::shared_ptr<BatchNorm2d> norm_;
};

TEST(Module, NamesOrderAndEnumeration) {
  tensor::Generator gen(1);
  Sequential model;
  model.add(std::make_shared<Block>(gen));
  model.add("head", std::make_shared<Linear>(2, 3, gen, /*bias=*/false));
  EXPECT_EQ(namesOf(model.namedParameters()),
            (std::vector<std::string>{"0.scale", "0.inner.weight", "0.inner.bias", "0.norm.weight", "0.norm.bias",
                                      "head.weight"}));
  EXPECT_EQ(namesOf(model.namedBuffers()), (std::vector<std::string>{"0.count", "0.norm.running_mean",
                                                                     "0.norm.running_var",
                                                                     "0.norm.num_batches_tracked"}));
  EXPECT_EQ(model.stateDict().keys(),
            (std::vector<std::string>{"0.scale", "0.count", "0.inner.weight", "0.inner.bias", "0.norm.weight",
                                      "0.norm.bias", "0.norm.running_mean", "0.norm.running_var",
                                      "0.norm.num_batches_tracked", "head.weight"}));
  EXPECT_EQ(model.numParameters(), 2 + 4 + 2 + 2 + 2 + 6);
  for (const auto& p : model.parameters()) EXPECT_TRUE(p.requiresGrad());
  EXPECT_EQ(model.size(), 2u);
  EXPECT_EQ(model[1]->typeName(), "Linear");
  EXPECT_THROW(model[2], ValueError);
  ASSERT_EQ(model.namedChildren().size(), 2u);
  EXPECT_EQ(model.namedChildren()[1].first, "head");
  std::vector<std::string> modules;
  for (const auto& [name, m] : model.namedModules()) modules.push_back(name + ":" + m->typeName());
  EXPECT_EQ(modules, (std::vector<std::string>{"0:Block", "0.inner:Linear", "0.norm:BatchNorm2d", "head:Linear"}));
}

TEST(Module, SharedModuleParametersListedOnce) {
  tensor::Generator gen(1);
  auto shared = std::make_shared<Linear>(2, 2, gen);
  Sequential model({shared, std::make_shared<ReLU>(), shared});
  EXPECT_EQ(model.parameters().size(), 2u);
  EXPECT_EQ(model.stateDict().size(), 4u);  // the state dict keeps both names, like PyTorch
}

TEST(Module, RegistrationErrors) {
  tensor::Generator gen(1);
  Block b(gen);
  EXPECT_NE(errorOf([&] { b.registerBadName("scale"); }).find("already a parameter"), std::string::npos);
  EXPECT_NE(errorOf([&] { b.registerBadName("inner"); }).find("already a submodule"), std::string::npos);
  EXPECT_NE(errorOf([&] { b.registerBadName("a.b"); }).find("must not contain '.'"), std::string::npos);
  EXPECT_NE(errorOf([&] { b.registerBadName(""); }).find("empty"), std::string::npos);
  Sequential s;
  EXPECT_THROW(s.add(nullptr), ValueError);
  // cycles of any length are refused (they would make every recursive walk loop forever)
  auto outer = std::make_shared<Sequential>();
  auto middle = std::make_shared<Sequential>();
  auto inner = std::make_shared<Sequential>();
  outer->add(middle);
  middle->add(inner);
  EXPECT_NE(errorOf([&] { inner->add(outer); }).find("cycle"), std::string::npos);
  EXPECT_NE(errorOf([&] { middle->add(outer); }).find("cycle"), std::string::npos);
}

TEST(Module, TrainEvalRecursesAndZeroGrad) {
  tensor::Generator gen(1);
  auto block = std::make_shared<Block>(gen);
  Sequential model({block});
  EXPECT_TRUE(block->norm_->isTraining());
  model.eval();
  EXPECT_FALSE(model.isTraining());
  EXPECT_FALSE(block->isTraining());
  EXPECT_FALSE(block->norm_->isTraining());
  model.train();
  EXPECT_TRUE(block->inner_->isTraining());

  Tensor x = tensor::normal({4, 2}, 0, 1, gen);
  backward(sum(model.forward(x)));
  for (const auto& p : model.parameters()) EXPECT_TRUE(p.grad().defined());
  model.zeroGrad();
  for (const auto& p : model.parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(Module, ToDTypeConvertsParametersAndFloatBuffers) {
  tensor::Generator gen(1);
  Block b(gen);
  const auto before = b.inner_->weight().toVector<double>();
  backward(sum(b.forward(tensor::normal({3, 2}, 0, 1, gen))));
  b.toDType(DType::kFloat64);
  for (const auto& [name, p] : b.namedParameters()) {
    EXPECT_EQ(p.dtype(), DType::kFloat64) << name;
    EXPECT_TRUE(p.requiresGrad()) << name;
    EXPECT_TRUE(p.isLeaf()) << name;
    EXPECT_FALSE(p.grad().defined()) << name;
  }
  const auto buffers = b.stateDict();
  EXPECT_EQ(buffers.at("norm.running_var").dtype(), DType::kFloat64);
  EXPECT_EQ(buffers.at("count").dtype(), DType::kFloat64);
  EXPECT_EQ(buffers.at("norm.num_batches_tracked").dtype(), DType::kInt64);
  // The subclass's own handles see the converted tensors, and values are preserved.
  EXPECT_EQ(b.inner_->weight().dtype(), DType::kFloat64);
  EXPECT_EQ(b.scale_.dtype(), DType::kFloat64);
  expectClose(b.inner_->weight(), before, 0.0);
  Tensor y = b.forward(tensor::normal({3, 2}, 0, 1, gen, DType::kFloat64));
  EXPECT_EQ(y.dtype(), DType::kFloat64);
  EXPECT_THROW(b.toDType(DType::kInt64), ValueError);
}

TEST(Module, LoadStateDictCopiesInPlace) {
  tensor::Generator gen(1);
  Linear a(3, 2, gen), b(3, 2, gen);
  const void* storage = b.weight().rawData();
  b.loadStateDict(a.stateDict());
  EXPECT_EQ(b.weight().rawData(), storage);
  EXPECT_EQ(b.weight().toVector<float>(), a.weight().toVector<float>());
  EXPECT_EQ(b.bias().toVector<float>(), a.bias().toVector<float>());
  EXPECT_TRUE(b.weight().requiresGrad());
}

TEST(Module, LoadStateDictStrictErrors) {
  tensor::Generator gen(1);
  Linear target(3, 2, gen);
  const auto original = target.weight().toVector<float>();

  StateDict missing;
  missing.insert("weight", Tensor::zeros({2, 3}));
  std::string err = errorOf([&] { target.loadStateDict(missing); });
  EXPECT_NE(err.find("missing keys: 'bias'"), std::string::npos) << err;
  EXPECT_EQ(target.weight().toVector<float>(), original);  // nothing copied on failure
  target.loadStateDict(missing, /*strict=*/false);          // non-strict loads what is there
  EXPECT_EQ(target.weight().toVector<float>(), std::vector<float>(6, 0.0f));

  StateDict extra = Linear(3, 2, gen).stateDict();
  extra.insert("running_mean", Tensor::zeros({2}));
  err = errorOf([&] { target.loadStateDict(extra); });
  EXPECT_NE(err.find("unexpected keys: 'running_mean'"), std::string::npos) << err;
  EXPECT_NO_THROW(target.loadStateDict(extra, false));

  StateDict wrongShape;
  wrongShape.insert("weight", Tensor::zeros({3, 2}));
  wrongShape.insert("bias", Tensor::zeros({2}));
  err = errorOf([&] { target.loadStateDict(wrongShape, false); });  // shape errors even when not strict
  EXPECT_NE(err.find("'weight': checkpoint shape [3, 2], module shape [2, 3]"), std::string::npos) << err;

  StateDict wrongDType;
  wrongDType.insert("weight", Tensor::zeros({2, 3}, DType::kFloat64));
  wrongDType.insert("bias", Tensor::zeros({2}));
  err = errorOf([&] { target.loadStateDict(wrongDType); });
  EXPECT_NE(err.find("'weight': checkpoint dtype float64, module dtype float32"), std::string::npos) << err;
  EXPECT_NE(err.find("Linear::loadStateDict"), std::string::npos) << err;
}

// ---------------------------------------------------------------- layers vs references

TEST(Linear, MatchesReferenceLoops) {
  tensor::Generator gen(2);
  Linear lin(3, 2, gen);
  Tensor x = tensor::normal({2, 2, 3}, 0, 1, gen);  // extra leading dim
  Tensor y = lin.forward(x);
  ASSERT_EQ(y.shape(), (Shape{2, 2, 2}));
  auto w = lin.weight().toVector<double>();
  auto b = lin.bias().toVector<double>();
  auto xv = x.toVector<double>();
  std::vector<double> expected;
  for (int r = 0; r < 4; ++r) {
    for (int o = 0; o < 2; ++o) {
      double s = b[o];
      for (int i = 0; i < 3; ++i) s += xv[r * 3 + i] * w[o * 3 + i];
      expected.push_back(s);
    }
  }
  expectClose(y, expected, 1e-5);
  EXPECT_NE(errorOf([&] { lin.forward(Tensor::zeros({2, 4})); }).find("Linear(3 -> 2)"), std::string::npos);
  Linear noBias(3, 2, gen, false);
  EXPECT_FALSE(noBias.bias().defined());
  EXPECT_EQ(noBias.parameters().size(), 1u);
}

TEST(Linear, InitBounds) {
  tensor::Generator gen(3);
  Linear lin(400, 50, gen);
  const double bound = 1.0 / std::sqrt(400.0);
  double maxW = 0, maxB = 0, sumSq = 0;
  for (float v : lin.weight().toVector<float>()) {
    maxW = std::max(maxW, std::abs(static_cast<double>(v)));
    sumSq += v * v;
  }
  for (float v : lin.bias().toVector<float>()) maxB = std::max(maxB, std::abs(static_cast<double>(v)));
  EXPECT_LE(maxW, bound);
  EXPECT_GT(maxW, 0.95 * bound);
  EXPECT_LE(maxB, bound);
  // U(-b, b) has variance b^2 / 3.
  EXPECT_NEAR(sumSq / (400 * 50), bound * bound / 3, 0.05 * bound * bound / 3);
}

TEST(Conv2d, MatchesNaiveConvolution) {
  tensor::Generator gen(4);
  Conv2d conv(2, 3, Pair{3, 2}, gen, Conv2dOptions{.stride = {2, 1}, .padding = {1, 0}});
  Tensor x = tensor::normal({2, 2, 5, 4}, 0, 1, gen);
  Tensor y = conv.forward(x);
  const int64_t oh = (5 + 2 - 3) / 2 + 1, ow = (4 - 2) / 1 + 1;
  ASSERT_EQ(y.shape(), (Shape{2, 3, oh, ow}));
  std::vector<double> expected;
  for (int64_t n = 0; n < 2; ++n) {
    for (int64_t o = 0; o < 3; ++o) {
      for (int64_t i = 0; i < oh; ++i) {
        for (int64_t j = 0; j < ow; ++j) {
          double s = conv.bias().at({o});
          for (int64_t c = 0; c < 2; ++c) {
            for (int64_t ki = 0; ki < 3; ++ki) {
              for (int64_t kj = 0; kj < 2; ++kj) {
                const int64_t r = i * 2 - 1 + ki, q = j + kj;
                if (r < 0 || r >= 5) continue;
                s += x.at({n, c, r, q}) * conv.weight().at({o, c, ki, kj});
              }
            }
          }
          expected.push_back(s);
        }
      }
    }
  }
  expectClose(y, expected, 1e-4);
  EXPECT_NE(errorOf([&] { conv.forward(Tensor::zeros({1, 3, 5, 5})); }).find("Conv2d(2 -> 3)"), std::string::npos);
  EXPECT_THROW(Conv2d(3, 4, 3, gen, 1, 0, true).forward(Tensor::zeros({3, 5, 5})), ValueError);
  EXPECT_THROW(Conv2d(3, 4, Pair{3, 3}, gen, Conv2dOptions{.groups = 2}), ValueError);
}

TEST(Conv2d, KaimingNormalFanOutInit) {
  tensor::Generator gen(5);
  Conv2d conv(64, 128, Pair{3, 3}, gen, {}, false, ConvInit::kKaimingNormalFanOut);
  auto w = conv.weight().toVector<double>();
  double sumSq = 0;
  for (double v : w) sumSq += v * v;
  const double expectedVar = 2.0 / (128 * 9);
  EXPECT_NEAR(sumSq / static_cast<double>(w.size()), expectedVar, 0.03 * expectedVar);
  EXPECT_FALSE(conv.bias().defined());
}

TEST(BatchNorm2d, TrainingNormalisesAndUpdatesRunningStats) {
  tensor::Generator gen(6);
  BatchNorm2d bn(2, /*momentum=*/0.2);
  Tensor gamma = bn.weight(), beta = bn.bias();
  gamma.copyFrom(Tensor::fromVector({2.0f, 0.5f}, {2}));
  beta.copyFrom(Tensor::fromVector({1.0f, -1.0f}, {2}));
  Tensor x = tensor::normal({3, 2, 2, 2}, 1.5, 2.0, gen);
  Tensor y = bn.forward(x);
  // Reference: per-channel statistics over N, H, W (biased variance for normalising, unbiased for running).
  std::vector<double> expected(24);
  for (int64_t c = 0; c < 2; ++c) {
    double mean = 0, sq = 0;
    for (int64_t n = 0; n < 3; ++n)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t w = 0; w < 2; ++w) mean += x.at({n, c, h, w});
    mean /= 12;
    for (int64_t n = 0; n < 3; ++n)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t w = 0; w < 2; ++w) sq += std::pow(x.at({n, c, h, w}) - mean, 2);
    const double var = sq / 12;
    for (int64_t n = 0; n < 3; ++n)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t w = 0; w < 2; ++w)
          expected[static_cast<size_t>(((n * 2 + c) * 2 + h) * 2 + w)] =
              gamma.at({c}) * (x.at({n, c, h, w}) - mean) / std::sqrt(var + 1e-5) + beta.at({c});
    EXPECT_NEAR(bn.runningMean().at({c}), 0.8 * 0 + 0.2 * mean, 1e-5);
    EXPECT_NEAR(bn.runningVar().at({c}), 0.8 * 1 + 0.2 * sq / 11, 1e-5);
  }
  expectClose(y, expected, 1e-4);
  EXPECT_EQ(bn.numBatchesTracked(), 1);

  // Eval uses the running statistics and does not update them.
  bn.eval();
  const auto rm = bn.runningMean().toVector<double>();
  const auto rv = bn.runningVar().toVector<double>();
  Tensor ye = bn.forward(x);
  std::vector<double> expectedEval;
  auto xv = x.toVector<double>();
  for (size_t i = 0; i < xv.size(); ++i) {
    const size_t c = (i / 4) % 2;
    expectedEval.push_back(gamma.at({static_cast<int64_t>(c)}) * (xv[i] - rm[c]) / std::sqrt(rv[c] + 1e-5) +
                           beta.at({static_cast<int64_t>(c)}));
  }
  expectClose(ye, expectedEval, 1e-4);
  EXPECT_EQ(bn.runningMean().toVector<double>(), rm);
  EXPECT_EQ(bn.numBatchesTracked(), 1);
}

TEST(BatchNorm2d, AcceptsTwoDimensionalInput) {
  BatchNorm2d bn(3);
  Tensor x = Tensor::fromVector({1.0f, 2.0f, 3.0f, 3.0f, 6.0f, 9.0f}, {2, 3});
  Tensor y = bn.forward(x);
  // Each column has two values a < b: normalised to -1, +1 (up to eps).
  const double s = 1.0 / std::sqrt(1.0 + 1e-5 / 1.0);
  const double s2 = 1.0 / std::sqrt(1.0 + 1e-5 / 4.0);
  const double s3 = 1.0 / std::sqrt(1.0 + 1e-5 / 9.0);
  expectClose(y, {-s, -s2, -s3, s, s2, s3}, 1e-5);
  EXPECT_THROW(bn.forward(Tensor::zeros({2, 4})), ValueError);
}

TEST(Activations, MatchReferences) {
  Tensor x = Tensor::fromVector({-2.0f, -0.5f, 0.0f, 0.5f, 2.0f}, {5});
  expectClose(ReLU().forward(x), {0, 0, 0, 0.5, 2}, 0);
  std::vector<double> th, sg, ge;
  for (double v : {-2.0, -0.5, 0.0, 0.5, 2.0}) {
    th.push_back(std::tanh(v));
    sg.push_back(1 / (1 + std::exp(-v)));
    ge.push_back(0.5 * v * (1 + std::erf(v / std::sqrt(2.0))));
  }
  expectClose(Tanh().forward(x), th, 1e-6);
  expectClose(Sigmoid().forward(x), sg, 1e-6);
  expectClose(GELU().forward(x), ge, 1e-6);
  EXPECT_EQ(makeActivation(Activation::kTanh)->typeName(), "Tanh");
}

TEST(Pooling, MaxAvgAdaptiveAndFlatten) {
  // 1x1x4x4 with values 0..15.
  Tensor x = Tensor::arange(16).toDType(DType::kFloat32);
  x = Tensor::fromStorage(x.storage(), {1, 1, 4, 4}, {16, 16, 4, 1}, 0, DType::kFloat32);
  expectClose(MaxPool2d(2).forward(x), {5, 7, 13, 15}, 0);
  expectClose(AvgPool2d(2).forward(x), {2.5, 4.5, 10.5, 12.5}, 1e-6);
  // 3x3 stride 2 pad 1 max pool (the ResNet stem's): windows clipped at the border.
  expectClose(MaxPool2d(3, 2, 1).forward(x), {5, 7, 13, 15}, 0);
  // Average pooling counts padding in the divisor: the corner window sees 0,1,4,5 of 9 cells.
  expectClose(AvgPool2d(3, 2, 1).forward(x), {10.0 / 9, 24.0 / 9, 51.0 / 9, 90.0 / 9}, 1e-5);
  expectClose(AdaptiveAvgPool2d({1, 1}).forward(x), {7.5}, 1e-6);
  expectClose(AdaptiveAvgPool2d({2, 2}).forward(x), {2.5, 4.5, 10.5, 12.5}, 1e-6);
  Tensor f = Flatten().forward(Tensor::zeros({2, 3, 4, 5}));
  EXPECT_EQ(f.shape(), (Shape{2, 60}));
  EXPECT_EQ(Flatten(0).forward(Tensor::zeros({2, 3})).shape(), (Shape{6}));
  EXPECT_THROW(MaxPool2d(2).forward(Tensor::zeros({4, 4})), ValueError);
  EXPECT_THROW(MaxPool2d(2, 1, 2), ValueError);
}

TEST(Dropout, TrainMasksEvalIsIdentity) {
  Dropout drop(0.25, 99);
  Tensor x = Tensor::full({4000}, 2.0);
  auto y = drop.forward(x).toVector<float>();
  int zeros = 0;
  for (float v : y) {
    if (v == 0.0f) ++zeros;
    else EXPECT_FLOAT_EQ(v, 2.0f / 0.75f);
  }
  EXPECT_NEAR(zeros / 4000.0, 0.25, 0.03);
  // Reproducible from the seed; the generator advances between calls.
  Dropout same(0.25, 99);
  EXPECT_EQ(same.forward(x).toVector<float>(), y);
  EXPECT_NE(same.forward(x).toVector<float>(), y);
  drop.eval();
  EXPECT_EQ(drop.forward(x).toVector<float>(), x.toVector<float>());
  EXPECT_THROW(Dropout(1.0), ValueError);
}

TEST(Embedding, PicksRows) {
  tensor::Generator gen(7);
  Embedding emb(5, 3, gen);
  Tensor idx = Tensor::fromVector(std::vector<int64_t>{4, 0, 4, 2}, {2, 2});
  Tensor y = emb.forward(idx);
  ASSERT_EQ(y.shape(), (Shape{2, 2, 3}));
  for (int64_t r = 0; r < 4; ++r) {
    const int64_t row = idx.toVector<int64_t>()[static_cast<size_t>(r)];
    for (int64_t d = 0; d < 3; ++d) EXPECT_EQ(y.at({r / 2, r % 2, d}), emb.weight().at({row, d}));
  }
  EXPECT_THROW(emb.forward(Tensor::zeros({2})), ValueError);
}

TEST(Sequential, ComposesInOrder) {
  tensor::Generator gen(8);
  auto l1 = std::make_shared<Linear>(4, 3, gen);
  auto l2 = std::make_shared<Linear>(3, 2, gen);
  Sequential seq({l1, std::make_shared<ReLU>(), l2});
  Tensor x = tensor::normal({5, 4}, 0, 1, gen);
  expectClose(seq.forward(x), l2->forward(relu(l1->forward(x))), 0);
}

// ---------------------------------------------------------------- LSTM

double sigmoidRef(double v) { return 1 / (1 + std::exp(-v)); }

// Scalar reference LSTM over [T, N, I] in double, reading the module's parameters by name.
std::vector<double> lstmReference(const LSTM& lstm, const Tensor& x, std::vector<double> h, std::vector<double> c,
                                  std::vector<double>* hN, std::vector<double>* cN) {
  const int64_t T = x.size(0), N = x.size(1), H = lstm.hiddenSize(), L = lstm.numLayers();
  StateDict params = lstm.stateDict();
  std::vector<double> input = x.toVector<double>();
  int64_t inSize = x.size(2);
  for (int64_t l = 0; l < L; ++l) {
    const std::string s = "_l" + std::to_string(l);
    auto wih = params.at("weight_ih" + s).toVector<double>();
    auto whh = params.at("weight_hh" + s).toVector<double>();
    auto bih = params.at("bias_ih" + s).toVector<double>();
    auto bhh = params.at("bias_hh" + s).toVector<double>();
    std::vector<double> out(static_cast<size_t>(T * N * H));
    std::vector<double> hl(h.begin() + l * N * H, h.begin() + (l + 1) * N * H);
    std::vector<double> cl(c.begin() + l * N * H, c.begin() + (l + 1) * N * H);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> hNext(hl.size()), cNext(cl.size());
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t j = 0; j < H; ++j) {
          double gates[4];
          for (int k = 0; k < 4; ++k) {
            const int64_t row = k * H + j;
            double g = bih[row] + bhh[row];
            for (int64_t i = 0; i < inSize; ++i) g += wih[row * inSize + i] * input[(t * N + n) * inSize + i];
            for (int64_t i = 0; i < H; ++i) g += whh[row * H + i] * hl[n * H + i];
            gates[k] = g;
          }
          const double cv = sigmoidRef(gates[1]) * cl[n * H + j] + sigmoidRef(gates[0]) * std::tanh(gates[2]);
          cNext[n * H + j] = cv;
          hNext[n * H + j] = sigmoidRef(gates[3]) * std::tanh(cv);
        }
      }
      hl = hNext;
      cl = cNext;
      std::copy(hl.begin(), hl.end(), out.begin() + t * N * H);
    }
    hN->insert(hN->end(), hl.begin(), hl.end());
    cN->insert(cN->end(), cl.begin(), cl.end());
    input = out;
    inSize = H;
  }
  return input;
}

TEST(LSTM, MatchesScalarReference) {
  tensor::Generator gen(9);
  LSTM lstm(3, 4, gen, /*numLayers=*/2);
  EXPECT_EQ(namesOf(lstm.namedParameters()),
            (std::vector<std::string>{"weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0", "weight_ih_l1",
                                      "weight_hh_l1", "bias_ih_l1", "bias_hh_l1"}));
  Tensor x = tensor::normal({5, 2, 3}, 0, 1, gen);
  Tensor h0 = tensor::normal({2, 2, 4}, 0, 0.5, gen);
  Tensor c0 = tensor::normal({2, 2, 4}, 0, 0.5, gen);
  LstmOutput out = lstm.forwardWithState(x, LstmState{h0, c0});
  std::vector<double> hN, cN;
  auto expected = lstmReference(lstm, x, h0.toVector<double>(), c0.toVector<double>(), &hN, &cN);
  ASSERT_EQ(out.output.shape(), (Shape{5, 2, 4}));
  expectClose(out.output, expected, 1e-5);
  expectClose(out.state.h, hN, 1e-5);
  expectClose(out.state.c, cN, 1e-5);

  // Zero initial state by default; forward() returns the output sequence.
  std::vector<double> h2, c2;
  auto expectedZero = lstmReference(lstm, x, std::vector<double>(16, 0.0), std::vector<double>(16, 0.0), &h2, &c2);
  expectClose(lstm.forward(x), expectedZero, 1e-5);
}

TEST(LSTM, BatchFirstMatchesSequenceFirst) {
  tensor::Generator g1(10), g2(10);
  LSTM seqFirst(3, 2, g1);
  LSTM batchFirst(3, 2, g2, 1, true, /*batchFirst=*/true);
  tensor::Generator gen(11);
  Tensor x = tensor::normal({4, 3, 3}, 0, 1, gen);  // [T, N, I]
  LstmOutput a = seqFirst.forwardWithState(x);
  LstmOutput b = batchFirst.forwardWithState(contiguous(transpose(x, 0, 1)));
  ASSERT_EQ(b.output.shape(), (Shape{3, 4, 2}));
  expectClose(contiguous(transpose(b.output, 0, 1)), a.output, 1e-6);
  expectClose(b.state.h, a.state.h, 1e-6);
  EXPECT_NE(errorOf([&] { seqFirst.forward(Tensor::zeros({4, 3, 5})); }).find("LSTM(3 -> 2)"), std::string::npos);
  EXPECT_THROW(seqFirst.forwardWithState(x, LstmState{Tensor::zeros({1, 2, 2}), Tensor::zeros({1, 2, 2})}), ValueError);
}

// ---------------------------------------------------------------- gradchecks (float64)

std::vector<Tensor> withParameters(const Module& m, std::vector<Tensor> inputs) {
  for (const auto& p : m.parameters()) inputs.push_back(p);
  return inputs;
}

TEST(Gradcheck, Linear) {
  tensor::Generator gen(12);
  Linear lin(3, 2, gen);
  lin.toDType(DType::kFloat64);
  Tensor x = tensor::normal({4, 3}, 0, 1, gen, DType::kFloat64);
  x.setRequiresGrad(true);
  auto r = autograd::gradcheck([&](const std::vector<Tensor>& in) { return lin.forward(in[0]); },
                               withParameters(lin, {x}));
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Gradcheck, Conv2d) {
  tensor::Generator gen(13);
  Conv2d conv(2, 3, Pair{3, 3}, gen, Conv2dOptions{.stride = {2, 2}, .padding = {1, 1}});
  conv.toDType(DType::kFloat64);
  Tensor x = tensor::normal({2, 2, 5, 5}, 0, 1, gen, DType::kFloat64);
  x.setRequiresGrad(true);
  auto r = autograd::gradcheck([&](const std::vector<Tensor>& in) { return conv.forward(in[0]); },
                               withParameters(conv, {x}));
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Gradcheck, BatchNorm2dTraining) {
  tensor::Generator gen(14);
  BatchNorm2d bn(3);
  bn.toDType(DType::kFloat64);
  Tensor gamma = bn.weight(), beta = bn.bias();
  gamma.copyFrom(tensor::normal({3}, 1, 0.3, gen, DType::kFloat64));
  beta.copyFrom(tensor::normal({3}, 0, 0.3, gen, DType::kFloat64));
  Tensor x = tensor::normal({4, 3, 2, 2}, 0.5, 1.5, gen, DType::kFloat64);
  x.setRequiresGrad(true);
  auto r = autograd::gradcheck([&](const std::vector<Tensor>& in) { return bn.forward(in[0]); },
                               withParameters(bn, {x}));
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Gradcheck, LSTM) {
  tensor::Generator gen(15);
  LSTM lstm(2, 3, gen, /*numLayers=*/2);
  lstm.toDType(DType::kFloat64);
  Tensor x = tensor::normal({3, 2, 2}, 0, 1, gen, DType::kFloat64);
  Tensor h0 = tensor::normal({2, 2, 3}, 0, 0.5, gen, DType::kFloat64);
  Tensor c0 = tensor::normal({2, 2, 3}, 0, 0.5, gen, DType::kFloat64);
  x.setRequiresGrad(true);
  h0.setRequiresGrad(true);
  c0.setRequiresGrad(true);
  // Output sequence and final cell state together, so every path is checked.
  auto r = autograd::gradcheck(
      [&](const std::vector<Tensor>& in) {
        LstmOutput o = lstm.forwardWithState(in[0], LstmState{in[1], in[2]});
        return cat({flatten(o.output), flatten(o.state.c)}, 0);
      },
      withParameters(lstm, {x, h0, c0}));
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(Gradcheck, SequentialThroughPoolingAndFlatten) {
  tensor::Generator gen(16);
  Sequential seq({std::make_shared<Conv2d>(1, 2, 3, gen, 1, 1), std::make_shared<ReLU>(),
                  std::make_shared<AvgPool2d>(2), std::make_shared<Flatten>(), std::make_shared<Linear>(8, 3, gen)});
  seq.toDType(DType::kFloat64);
  Tensor x = tensor::normal({2, 1, 4, 4}, 0, 1, gen, DType::kFloat64);
  x.setRequiresGrad(true);
  auto r = autograd::gradcheck([&](const std::vector<Tensor>& in) { return seq.forward(in[0]); },
                               withParameters(seq, {x}));
  EXPECT_TRUE(r.ok) << r.message;
}

}  // namespace
}  // namespace distgrad::models
