// Pipeline building blocks: model units compose to the model exactly, stages built on separate "workers"
// hold the model's weights, balance() is optimal (checked by brute force), schedules follow their
// definitions, and the time accounting adds up.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/pipeline/model_spec.h"
#include "models/pipeline/partition.h"
#include "models/pipeline/pipeline.h"
#include "models/pipeline/schedule.h"
#include "rpc/codec.h"
#include "rpc/message.h"
#include "tensor/random.h"
#include "test_util.h"

namespace distgrad::models::pipeline {
namespace {

using testing::expectThrowsWith;

void expectBitwise(const Tensor& a, const Tensor& b, const std::string& what) {
  ASSERT_EQ(a.shape(), b.shape()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  const Tensor ca = contiguous(a.detach());
  const Tensor cb = contiguous(b.detach());
  EXPECT_EQ(0, std::memcmp(ca.rawData(), cb.rawData(), ca.nbytes())) << what << " differs";
}

Tensor compose(const std::vector<std::shared_ptr<Module>>& units, const Tensor& x) {
  Tensor y = x;
  for (const auto& u : units) y = u->forward(y);
  return y;
}

Tensor images(int64_t n, uint64_t seed, int64_t channels = 1, int64_t side = 28) {
  tensor::Generator gen(seed);
  return tensor::normal({n, channels, side, side}, 0, 1, gen);
}

struct UnitCase {
  const char* label;
  ModelSpec spec;
  int64_t units;
};
void PrintTo(const UnitCase& c, std::ostream* os) { *os << c.label; }

ModelSpec resnetSpec(const std::string& name, const std::string& stem, int64_t width) {
  ModelSpec s;
  s.name = name;
  s.stem = stem;
  s.baseWidth = width;
  s.seed = 3;
  return s;
}
ModelSpec mlpSpec() {
  ModelSpec s;
  s.name = "mlp";
  s.hidden = {32, 16};
  s.seed = 5;
  return s;
}
ModelSpec lenetSpec() {
  ModelSpec s;
  s.name = "lenet5";
  s.seed = 9;
  return s;
}

class ModelUnits : public ::testing::TestWithParam<UnitCase> {};

// The units' composition is model.forward, bit for bit: outputs in training (batch statistics) and eval
// mode, and every parameter's gradient.
TEST_P(ModelUnits, ComposeToTheModelBitwise) {
  const UnitCase c = GetParam();
  auto model = buildModel(c.spec);
  auto units = modelUnits(c.spec, model);
  ASSERT_EQ(static_cast<int64_t>(units.size()), c.units);
  EXPECT_EQ(numUnits(c.spec), c.units);
  // The units share the model's parameters: together they hold each one exactly once.
  int64_t unitParams = 0;
  for (const auto& u : units) unitParams += u->numParameters();
  EXPECT_EQ(unitParams, model->numParameters());

  const Tensor x = images(3, 11);
  model->train();
  Tensor direct = model->forward(x);
  backward(sum(mul(direct, direct)));
  std::vector<Tensor> directGrads;
  for (const Tensor& p : model->parameters()) directGrads.push_back(p.grad().cloneData());
  model->zeroGrad();
  Tensor composed = compose(units, x);
  expectBitwise(direct, composed, "training-mode output");
  backward(sum(mul(composed, composed)));
  const auto params = model->namedParameters();
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(params[i].second.grad().defined()) << params[i].first;
    expectBitwise(directGrads[i], params[i].second.grad(), "gradient of " + params[i].first);
  }

  autograd::NoGradGuard noGrad;
  model->eval();
  expectBitwise(model->forward(x), compose(units, x), "eval-mode output");
}

INSTANTIATE_TEST_SUITE_P(Zoo, ModelUnits,
                         ::testing::Values(UnitCase{"resnet18_cifar", resnetSpec("resnet18", "cifar", 4), 10},
                                           UnitCase{"resnet18_imagenet", resnetSpec("resnet18", "imagenet", 4), 10},
                                           UnitCase{"resnet50_cifar", resnetSpec("resnet50", "cifar", 2), 18},
                                           UnitCase{"mlp", mlpSpec(), 3}, UnitCase{"lenet5", lenetSpec(), 5}),
                         [](const auto& info) { return std::string(info.param.label); });

TEST(ModelSpecTest, MlpTakesFlatInputsToo) {
  ModelSpec spec = mlpSpec();
  auto model = buildModel(spec);
  auto units = modelUnits(spec, model);
  autograd::NoGradGuard noGrad;
  const Tensor flat = reshape(images(2, 4), {2, 784});
  expectBitwise(model->forward(flat), compose(units, flat), "flat-input output");
}

TEST(ModelSpecTest, ValidateNamesTheField) {
  ModelSpec s;
  s.name = "vgg";
  expectThrowsWith([&] { s.validate(); }, {"ModelSpec.name", "vgg"});
  s = ModelSpec{};
  s.numClasses = 0;
  expectThrowsWith([&] { buildModel(s); }, {"ModelSpec.numClasses", "0"});
  s = ModelSpec{};
  s.baseWidth = -2;
  expectThrowsWith([&] { s.validate(); }, {"ModelSpec.baseWidth", "-2"});
  s = ModelSpec{};
  s.stem = "tiny";
  expectThrowsWith([&] { s.validate(); }, {"ModelSpec.stem", "tiny"});
  s = mlpSpec();
  s.hidden = {8, 0};
  expectThrowsWith([&] { s.validate(); }, {"ModelSpec.hidden[1]", "0"});
  s = lenetSpec();
  s.imageSize = 32;
  expectThrowsWith([&] { s.validate(); }, {"ModelSpec.imageSize", "28", "32"});
  // A model that is not what the spec describes.
  expectThrowsWith([&] { modelUnits(mlpSpec(), buildModel(lenetSpec())); }, {"needs an MLP", "LeNet5"});
  ModelSpec wide = mlpSpec();
  wide.hidden = {64};
  expectThrowsWith([&] { modelUnits(wide, buildModel(mlpSpec())); }, {"layer sizes"});
}

TEST(ModelSpecTest, Describe) {
  EXPECT_EQ(resnetSpec("resnet18", "cifar", 16).describe(), "resnet18(width 16, cifar stem, 10 classes)");
  EXPECT_EQ(mlpSpec().describe(), "mlp(784-32-16-10)");
  EXPECT_EQ(lenetSpec().describe(), "lenet5(10 classes)");
}

TEST(ModelSpecTest, SameSeedSameWeightsOtherSeedOthers) {
  ModelSpec spec = resnetSpec("resnet18", "cifar", 4);
  auto a = buildModel(spec);
  auto b = buildModel(spec);
  spec.seed = 4;
  auto c = buildModel(spec);
  const auto pa = a->parameters(), pb = b->parameters(), pc = c->parameters();
  bool anyDiffers = false;
  for (size_t i = 0; i < pa.size(); ++i) {
    expectBitwise(pa[i], pb[i], "parameter " + std::to_string(i));
    anyDiffers = anyDiffers || pa[i].toVector<float>() != pc[i].toVector<float>();
  }
  EXPECT_TRUE(anyDiffers);
}

// `spec` as a worker receives it: encoded with the RPC codec, then decoded.
StageSpec wireRoundTrip(const StageSpec& spec) {
  rpc::EnvelopeFields fields;
  fields.kind = rpc::MessageKind::kResponse;
  auto frame = rpc::encodeMessageWith(fields, spec);
  if (!frame.ok()) throw std::runtime_error(frame.error().describe());
  auto message = rpc::decodeLoopback(std::move(frame).value());
  if (!message.ok()) throw std::runtime_error(message.error().describe());
  auto decoded = message.value().decodeValue<StageSpec>();
  if (!decoded.ok()) throw std::runtime_error(decoded.error().describe());
  return std::move(decoded).value();
}

// Two "workers" each build their stage from a StageSpec (after it went through the RPC codec): together
// they hold exactly buildModel's weights and buffers, and compute its forward.
void checkStagesRebuildModel(const ModelSpec& spec, int64_t stages) {
  SCOPED_TRACE(spec.describe() + " in " + std::to_string(stages) + " stages");
  auto model = buildModel(spec);
  const Partition partition = balance(modelUnits(spec, model), stages, BalanceBy::kParameters);
  std::vector<std::shared_ptr<Module>> built;
  for (const StageSpec& s : stageSpecs(spec, partition)) {
    built.push_back(buildStage(wireRoundTrip(s)));
  }
  std::vector<Tensor> stageParams, stageBuffers;
  for (const auto& m : built) {
    for (const Tensor& p : m->parameters()) stageParams.push_back(p);
    for (const Tensor& b : m->buffers()) stageBuffers.push_back(b);
  }
  const auto modelParams = model->parameters();
  const auto modelBuffers = model->buffers();
  ASSERT_EQ(stageParams.size(), modelParams.size());
  ASSERT_EQ(stageBuffers.size(), modelBuffers.size());
  for (size_t i = 0; i < modelParams.size(); ++i) expectBitwise(stageParams[i], modelParams[i], "parameter");
  for (size_t i = 0; i < modelBuffers.size(); ++i) expectBitwise(stageBuffers[i], modelBuffers[i], "buffer");
  autograd::NoGradGuard noGrad;
  const Tensor x = images(2, 21);
  expectBitwise(compose(built, x), model->forward(x), "forward through the built stages");
}

TEST(StageSpecTest, StagesBuiltApartHoldTheModelsWeights) {
  checkStagesRebuildModel(resnetSpec("resnet18", "cifar", 4), 2);
  checkStagesRebuildModel(resnetSpec("resnet18", "cifar", 4), 4);
  checkStagesRebuildModel(resnetSpec("resnet50", "imagenet", 2), 3);
  checkStagesRebuildModel(mlpSpec(), 3);
  checkStagesRebuildModel(lenetSpec(), 2);
}

TEST(StageSpecTest, ValidateAndDescribe) {
  StageSpec s{.model = mlpSpec(), .firstUnit = 1, .endUnit = 3};
  EXPECT_NO_THROW(s.validate());
  EXPECT_EQ(s.describe(), "mlp(784-32-16-10) units 1-2");
  s.endUnit = 4;
  expectThrowsWith([&] { buildStage(s); }, {"[1, 4)", "3 units"});
  s.endUnit = 1;
  expectThrowsWith([&] { s.validate(); }, {"non-empty"});
  Partition p = uniformPartition(3, 2);
  p.bounds = {0, 2, 2, 3};
  expectThrowsWith([&] { stageSpecs(mlpSpec(), p); }, {"stage 1", "empty"});
  p.bounds = {0, 2};
  expectThrowsWith([&] { stageSpecs(mlpSpec(), p); }, {"0 to 3"});
}

// ---- balance ----

double largest(const std::vector<double>& costs, const std::vector<int64_t>& bounds) {
  double worst = 0;
  for (size_t s = 0; s + 1 < bounds.size(); ++s) {
    double c = 0;
    for (int64_t i = bounds[s]; i < bounds[s + 1]; ++i) c += costs[static_cast<size_t>(i)];
    worst = std::max(worst, c);
  }
  return worst;
}

// The best largest-stage cost over every way of cutting `costs` into `stages` non-empty stages.
double bruteForce(const std::vector<double>& costs, int64_t stages) {
  const auto n = static_cast<int64_t>(costs.size());
  double best = std::numeric_limits<double>::infinity();
  std::vector<int64_t> bounds{0};
  std::function<void()> place = [&] {
    const auto placed = static_cast<int64_t>(bounds.size()) - 1;
    if (placed == stages - 1) {
      bounds.push_back(n);
      best = std::min(best, largest(costs, bounds));
      bounds.pop_back();
      return;
    }
    for (int64_t cut = bounds.back() + 1; cut <= n - (stages - 1 - placed); ++cut) {
      bounds.push_back(cut);
      place();
      bounds.pop_back();
    }
  };
  place();
  return best;
}

TEST(BalanceTest, OptimalAgainstBruteForce) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<double> cost(0.0, 10.0);
  std::uniform_int_distribution<int> small(0, 4);
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + trial % 9;
    std::vector<double> costs;
    // Integers make ties common (several optimal splits), reals exercise the general case.
    for (int i = 0; i < n; ++i) costs.push_back(trial % 2 ? cost(rng) : static_cast<double>(small(rng)));
    for (int64_t stages = 1; stages <= n; ++stages) {
      const Partition p = balanceCosts(costs, stages);
      ASSERT_EQ(p.numStages(), stages);
      ASSERT_EQ(p.bounds.front(), 0);
      ASSERT_EQ(p.bounds.back(), n);
      double total = 0;
      for (int64_t s = 0; s < stages; ++s) {
        ASSERT_LT(p.bounds[static_cast<size_t>(s)], p.bounds[static_cast<size_t>(s + 1)]);
        total += p.cost[static_cast<size_t>(s)];
      }
      EXPECT_NEAR(total, std::accumulate(costs.begin(), costs.end(), 0.0), 1e-9);
      EXPECT_DOUBLE_EQ(largest(costs, p.bounds), bruteForce(costs, stages))
          << "trial " << trial << ", " << stages << " stages: " << p.describe();
    }
  }
}

TEST(BalanceTest, HandMadeCases) {
  EXPECT_EQ(balanceCosts({1, 2, 3, 4, 5}, 2).bounds, (std::vector<int64_t>{0, 3, 5}));
  EXPECT_EQ(balanceCosts({1, 2, 3, 4, 5}, 3).bounds, (std::vector<int64_t>{0, 3, 4, 5}));
  // One heavy unit dominates: everything else shares the other stage.
  EXPECT_EQ(balanceCosts({1, 1, 1, 1, 20}, 2).bounds, (std::vector<int64_t>{0, 4, 5}));
  EXPECT_EQ(balanceCosts({20, 1, 1, 1, 1}, 2).bounds, (std::vector<int64_t>{0, 1, 5}));
  // Ties: the later stage gets fewer units.
  EXPECT_EQ(balanceCosts({1, 1, 1}, 2).bounds, (std::vector<int64_t>{0, 2, 3}));
  EXPECT_EQ(balanceCosts({0, 0, 0, 0}, 4).bounds, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  const Partition p = balanceCosts({1500, 2500000, 3}, 2);
  EXPECT_EQ(p.bounds, (std::vector<int64_t>{0, 1, 3}));
  EXPECT_EQ(p.describe(), "stage 0: unit 0 (1.5k params), stage 1: units 1-2 (2.5M params)");
}

TEST(BalanceTest, BadInputIsAnError) {
  expectThrowsWith([] { balanceCosts({1, 2}, 0); }, {"stages must be >= 1", "0"});
  expectThrowsWith([] { balanceCosts({1, 2}, 3); }, {"<= the number of units (2)", "3"});
  expectThrowsWith([] { balanceCosts({}, 1); }, {"units (0)"});
  expectThrowsWith([] { balanceCosts({1, -2}, 1); }, {"unit 1", "-2"});
  expectThrowsWith([] { balanceCosts({1, std::nan("")}, 1); }, {"unit 1", "nan"});
  ModelSpec spec = mlpSpec();
  auto units = modelUnits(spec, buildModel(spec));
  expectThrowsWith([&] { balance(units, 2, BalanceBy::kTime); }, {"sample batch"});
  expectThrowsWith([&] { balance(units, 4, BalanceBy::kParameters); }, {"units (3)", "4"});
  expectThrowsWith([] { parseBalanceBy("flops"); }, {"params", "time", "flops"});
  EXPECT_EQ(parseBalanceBy("time"), BalanceBy::kTime);
  EXPECT_STREQ(balanceByName(BalanceBy::kParameters), "params");
}

TEST(BalanceTest, ByParametersOnAModel) {
  ModelSpec spec = resnetSpec("resnet18", "cifar", 4);
  auto model = buildModel(spec);
  auto units = modelUnits(spec, model);
  const Partition p = balance(units, 3, BalanceBy::kParameters);
  std::vector<double> costs;
  for (const auto& u : units) costs.push_back(static_cast<double>(u->numParameters()));
  EXPECT_DOUBLE_EQ(largest(costs, p.bounds), bruteForce(costs, 3));
  EXPECT_DOUBLE_EQ(p.cost[0] + p.cost[1] + p.cost[2], static_cast<double>(model->numParameters()));
}

// Timing runs forwards and backwards; the model must come out as it went in (BatchNorm running stats,
// no gradients left behind), since workers building the same stage from a seed must agree.
TEST(BalanceTest, ByTimeMeasuresAndLeavesTheModelAlone) {
  ModelSpec spec = resnetSpec("resnet18", "cifar", 4);
  auto model = buildModel(spec);
  auto units = modelUnits(spec, model);
  std::vector<Tensor> before;
  for (const Tensor& b : model->buffers()) before.push_back(b.cloneData());
  const std::vector<double> costs = unitCosts(units, BalanceBy::kTime, images(4, 2), 2);
  ASSERT_EQ(costs.size(), units.size());
  for (double c : costs) EXPECT_GT(c, 0);
  const auto after = model->buffers();
  for (size_t i = 0; i < before.size(); ++i) expectBitwise(before[i], after[i], "buffer " + std::to_string(i));
  for (const auto& [name, p] : model->namedParameters()) EXPECT_FALSE(p.grad().defined()) << name;
  const Partition p = balance(units, 2, BalanceBy::kTime, images(4, 2));
  EXPECT_EQ(p.by, BalanceBy::kTime);
  EXPECT_NE(p.describe().find(" ms)"), std::string::npos) << p.describe();
}

// ---- schedules ----

std::string order(Schedule s, int64_t stage, int64_t stages, int64_t micro) {
  return describeOrder(stageOrder(s, stage, stages, micro));
}

TEST(ScheduleTest, HandWrittenOrders) {
  EXPECT_EQ(order(Schedule::kGPipe, 0, 2, 3), "F0 F1 F2 B0 B1 B2");
  EXPECT_EQ(order(Schedule::kGPipe, 1, 2, 3), "F0 F1 F2 B0 B1 B2");
  EXPECT_EQ(order(Schedule::k1F1B, 0, 2, 4), "F0 F1 B0 F2 B1 F3 B2 B3");
  EXPECT_EQ(order(Schedule::k1F1B, 1, 2, 4), "F0 B0 F1 B1 F2 B2 F3 B3");
  EXPECT_EQ(order(Schedule::k1F1B, 0, 4, 8), "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  EXPECT_EQ(order(Schedule::k1F1B, 2, 4, 8), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  // Fewer micro-batches than the warm-up wants: all forwards, then all backwards.
  EXPECT_EQ(order(Schedule::k1F1B, 0, 4, 2), "F0 F1 B0 B1");
  EXPECT_EQ(order(Schedule::k1F1B, 0, 1, 2), "F0 B0 F1 B1");
}

TEST(ScheduleTest, EveryOpOnceAndInFlightBounds) {
  for (int64_t stages = 1; stages <= 5; ++stages) {
    for (int64_t micro = 1; micro <= 9; ++micro) {
      for (int64_t stage = 0; stage < stages; ++stage) {
        for (Schedule sch : {Schedule::kGPipe, Schedule::k1F1B}) {
          const auto ops = stageOrder(sch, stage, stages, micro);
          ASSERT_EQ(static_cast<int64_t>(ops.size()), 2 * micro);
          std::vector<int> forwarded(static_cast<size_t>(micro), 0), backwarded(static_cast<size_t>(micro), 0);
          for (const Op& op : ops) {
            const auto m = static_cast<size_t>(op.microBatch);
            if (op.forward) {
              ++forwarded[m];
            } else {
              ASSERT_EQ(forwarded[m], 1) << "B" << m << " before F" << m;
              ++backwarded[m];
            }
          }
          for (int64_t m = 0; m < micro; ++m) ASSERT_EQ(backwarded[static_cast<size_t>(m)], 1);
          const int64_t expected = sch == Schedule::kGPipe ? micro : std::min(stages - stage, micro);
          EXPECT_EQ(maxInFlight(ops), expected)
              << scheduleName(sch) << " stage " << stage << "/" << stages << " M=" << micro;
        }
      }
    }
  }
}

TEST(ScheduleTest, BadInputIsAnError) {
  expectThrowsWith([] { stageOrder(Schedule::kGPipe, 2, 2, 4); }, {"stage must be in [0, 2)", "2"});
  expectThrowsWith([] { stageOrder(Schedule::k1F1B, -1, 2, 4); }, {"stage must be in", "-1"});
  expectThrowsWith([] { stageOrder(Schedule::k1F1B, 0, 0, 4); }, {"stages must be >= 1"});
  expectThrowsWith([] { stageOrder(Schedule::k1F1B, 0, 2, 0); }, {"micro-batches must be >= 1"});
  expectThrowsWith([] { parseSchedule("pipedream"); }, {"gpipe", "1f1b", "pipedream"});
  EXPECT_EQ(parseSchedule("1f1b"), Schedule::k1F1B);
  EXPECT_STREQ(scheduleName(Schedule::kGPipe), "gpipe");
}

StageTimes uniformTimes(int64_t stages, int64_t micro, double f, double b) {
  StageTimes t;
  t.forward.assign(static_cast<size_t>(stages), std::vector<double>(static_cast<size_t>(micro), f));
  t.backward.assign(static_cast<size_t>(stages), std::vector<double>(static_cast<size_t>(micro), b));
  return t;
}

TEST(ScheduleTest, IdealMakespanEqualTimes) {
  // With equal times both schedules take (M + S - 1)(f + b): M micro-batches plus the fill and drain.
  for (int64_t stages = 1; stages <= 5; ++stages) {
    for (int64_t micro = 1; micro <= 8; ++micro) {
      for (Schedule sch : {Schedule::kGPipe, Schedule::k1F1B}) {
        EXPECT_DOUBLE_EQ(idealMakespan(sch, uniformTimes(stages, micro, 1.0, 2.0)),
                         static_cast<double>(micro + stages - 1) * 3.0)
            << scheduleName(sch) << " S=" << stages << " M=" << micro;
      }
    }
  }
}

TEST(ScheduleTest, IdealMakespanHandComputed) {
  // One stage: everything in a row.
  StageTimes one{{{1, 2, 3}}, {{4, 5, 6}}};
  EXPECT_DOUBLE_EQ(idealMakespan(Schedule::kGPipe, one), 21);
  EXPECT_DOUBLE_EQ(idealMakespan(Schedule::k1F1B, one), 21);
  // Two stages, one micro-batch: F0 on stage 0 [0,1], F0 on stage 1 [1,3], B0 on stage 1 [3,7], B0 on
  // stage 0 [7,10].
  StageTimes two{{{1}, {2}}, {{3}, {4}}};
  EXPECT_DOUBLE_EQ(idealMakespan(Schedule::kGPipe, two), 10);
  // Two stages, two micro-batches, a slow second stage. GPipe: stage 1 runs F0 [1,3] F1 [3,5] B0 [5,7]
  // B1 [7,9]; stage 0 runs B0 [7,8] and B1 [9,10].
  StageTimes slow{{{1, 1}, {2, 2}}, {{1, 1}, {2, 2}}};
  EXPECT_DOUBLE_EQ(idealMakespan(Schedule::kGPipe, slow), 10);
  // 1F1B: stage 1 runs F0 [1,3] B0 [3,5] F1 [5,7] B1 [7,9]; stage 0 runs F0 F1 [0,2], B0 [5,6], B1 [9,10].
  EXPECT_DOUBLE_EQ(idealMakespan(Schedule::k1F1B, slow), 10);
  // A slow first forward delays everything behind it: stage 0 F0 [0,5], F1 [5,6]; stage 1 F0 [5,6]
  // B0 [6,7] (1F1B) F1 [7,8] B1 [8,9]; stage 0 B0 [7,8], B1 [9,10].
  StageTimes late{{{5, 1}, {1, 1}}, {{1, 1}, {1, 1}}};
  EXPECT_DOUBLE_EQ(idealMakespan(Schedule::k1F1B, late), 10);
  // GPipe: stage 1 F0 [5,6] F1 [6,7] B0 [7,8] B1 [8,9]; stage 0 B0 [8,9] B1 [9,10].
  EXPECT_DOUBLE_EQ(idealMakespan(Schedule::kGPipe, late), 10);
}

TEST(ScheduleTest, IdealMakespanBadTimes) {
  StageTimes ragged{{{1, 1}, {1}}, {{1, 1}, {1, 1}}};
  expectThrowsWith([&] { idealMakespan(Schedule::kGPipe, ragged); }, {"stage 1 has 1 micro-batch times"});
  StageTimes negative{{{1}}, {{-1}}};
  expectThrowsWith([&] { idealMakespan(Schedule::kGPipe, negative); }, {"stage 0 has time -1"});
  StageTimes mismatched{{{1}}, {}};
  expectThrowsWith([&] { idealMakespan(Schedule::kGPipe, mismatched); }, {"same number"});
}

TEST(StepStatsTest, SharesSumToOne) {
  StepStats s;
  s.wallSeconds = 2.0;
  s.idealSeconds = 1.5;
  s.busySeconds = {1.0, 0.8, 1.1};
  s.maxInFlight = {3, 2, 1};
  s.peakActivationBytes = {-1, -1, -1};
  s.steps = 1;
  EXPECT_NEAR(s.computeShare(), 2.9 / 6.0, 1e-12);
  EXPECT_NEAR(s.bubbleShare(), (4.5 - 2.9) / 6.0, 1e-12);
  EXPECT_NEAR(s.overheadShare(), 0.25, 1e-12);
  EXPECT_NEAR(s.computeShare() + s.bubbleShare() + s.overheadShare(), 1.0, 1e-12);

  StepStats total;
  total.accumulate(s);
  StepStats other = s;
  other.wallSeconds = 1.0;
  other.idealSeconds = 1.0;
  other.maxInFlight = {1, 4, 1};
  other.peakActivationBytes = {100, -1, 5};
  total.accumulate(other);
  EXPECT_EQ(total.steps, 2);
  EXPECT_DOUBLE_EQ(total.wallSeconds, 3.0);
  EXPECT_DOUBLE_EQ(total.idealSeconds, 2.5);
  EXPECT_EQ(total.busySeconds, (std::vector<double>{2.0, 1.6, 2.2}));
  EXPECT_EQ(total.maxInFlight, (std::vector<int64_t>{3, 4, 1}));
  EXPECT_EQ(total.peakActivationBytes, (std::vector<int64_t>{100, -1, 5}));
  EXPECT_NEAR(total.computeShare() + total.bubbleShare() + total.overheadShare(), 1.0, 1e-12);

  StepStats twoStages;
  twoStages.busySeconds = {1, 1};
  twoStages.maxInFlight = {1, 1};
  twoStages.peakActivationBytes = {-1, -1};
  expectThrowsWith([&] { total.accumulate(twoStages); }, {"2 stages added to stats of 3"});
  EXPECT_EQ(StepStats{}.computeShare(), 0);  // no wall time: no shares, not NaN
}

TEST(MicroBatchTest, Sizes) {
  EXPECT_EQ(microBatchSizes(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(microBatchSizes(10, 3), (std::vector<int64_t>{4, 3, 3}));
  EXPECT_EQ(microBatchSizes(8, 4), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(microBatchSizes(3, 8), (std::vector<int64_t>{1, 1, 1}));
  EXPECT_EQ(microBatchSizes(5, 1), (std::vector<int64_t>{5}));
  expectThrowsWith([] { microBatchSizes(0, 2); }, {"batch size must be >= 1", "0"});
  expectThrowsWith([] { microBatchSizes(4, 0); }, {"micro-batches must be >= 1", "0"});
  PipelineOptions o;
  o.microBatches = 0;
  expectThrowsWith([&] { o.validate(); }, {"PipelineOptions.microBatches", "0"});
  o.microBatches = 2;
  o.optimizer.kind = "rmsprop";
  EXPECT_THROW(o.validate(), ValueError);
}

}  // namespace
}  // namespace distgrad::models::pipeline
