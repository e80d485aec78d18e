// LocalPipeline: a pipelined step is the full-batch step (every schedule, threaded or not, any number of
// micro-batches, an uneven last one), the schedules keep their in-flight bounds, BatchNorm models train,
// and failures in any stage come back to step() naming the stage, without hanging.
#include "models/pipeline/local_pipeline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "models/data/synthetic.h"
#include "models/nn/sequential.h"
#include "models/pipeline/model_spec.h"
#include "models/pipeline/partition.h"
#include "rpc/trace.h"
#include "tensor/random.h"
#include "test_util.h"
#include "tests/pipeline/pipeline_trace_util.h"

namespace distgrad::models::pipeline {
namespace {

using testing::expectThrowsWith;

ModelSpec mlpSpec() {
  ModelSpec s;
  s.name = "mlp";
  s.hidden = {24, 16};
  s.seed = 12;
  return s;
}

// An MLP of `units` units (Linear + ReLU each, the last Linear alone).
ModelSpec mlpWithUnits(int64_t units) {
  ModelSpec s = mlpSpec();
  s.hidden.clear();
  for (int64_t i = 1; i < units; ++i) s.hidden.push_back(24 - 4 * i);
  return s;
}

ModelSpec resnetSpec() {
  ModelSpec s;
  s.name = "resnet18";
  s.baseWidth = 4;
  s.seed = 2;
  return s;
}

struct Batch {
  Tensor inputs, labels;
};

Batch randomBatch(int64_t n, uint64_t seed) {
  tensor::Generator gen(seed);
  data::TensorDataset set = data::makeRandomImages(n, {1, 28, 28}, 10, gen);
  return {set.inputs(), set.labels()};
}

std::vector<std::shared_ptr<Module>> stagesOf(const ModelSpec& spec, int64_t stages,
                                              std::shared_ptr<Module>* model = nullptr) {
  auto built = buildModel(spec);
  if (model) *model = built;
  auto units = modelUnits(spec, built);
  return stageModules(units, uniformPartition(static_cast<int64_t>(units.size()), stages));
}

std::vector<Tensor> parametersOf(const std::vector<std::shared_ptr<Module>>& stages) {
  std::vector<Tensor> out;
  for (const auto& s : stages) {
    for (const Tensor& p : s->parameters()) out.push_back(p);
  }
  return out;
}

void expectBitwise(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].shape(), b[i].shape());
    EXPECT_EQ(0, std::memcmp(a[i].rawData(), b[i].rawData(), a[i].nbytes())) << "tensor " << i;
  }
}

PipelineOptions optionsFor(Schedule schedule, int64_t micro, const optim::OptimizerSpec& optimizer) {
  PipelineOptions o;
  o.schedule = schedule;
  o.microBatches = micro;
  o.optimizer = optimizer;
  return o;
}

optim::OptimizerSpec sgd() { return optim::OptimizerSpec::sgd({.learningRate = 0.1, .momentum = 0.9}); }
optim::OptimizerSpec adam() { return optim::OptimizerSpec::adam({.learningRate = 0.01}); }

struct ParityCase {
  Schedule schedule;
  bool threaded;
  int64_t micro;
  int64_t stages;
  bool useAdam;
};
void PrintTo(const ParityCase& c, std::ostream* os) {
  *os << scheduleName(c.schedule) << (c.threaded ? " threaded" : " sequential") << " M=" << c.micro << " S=" << c.stages
      << (c.useAdam ? " adam" : " sgd");
}

class PipelineParity : public ::testing::TestWithParam<ParityCase> {};

// Two pipelined steps give the parameters (and losses) of two plain full-batch steps on the whole model.
// Batches of 10 split into M = 3 or 4 micro-batches have an uneven last one.
TEST_P(PipelineParity, SameParametersAsFullBatchTraining) {
  const ParityCase c = GetParam();
  const optim::OptimizerSpec opt = c.useAdam ? adam() : sgd();
  const std::vector<Batch> batches{randomBatch(10, 100), randomBatch(10, 101)};

  const ModelSpec spec = mlpWithUnits(std::max<int64_t>(c.stages, 3));
  auto reference = buildModel(spec);
  auto refOptimizer = opt.make(reference->parameters());
  std::vector<double> refLoss;
  std::vector<int64_t> refCorrect;
  for (const Batch& b : batches) {
    Tensor logits = reference->forward(b.inputs);
    Tensor loss = crossEntropy(logits, b.labels);
    refLoss.push_back(loss.item());
    {
      autograd::NoGradGuard noGrad;
      refCorrect.push_back(static_cast<int64_t>(sum(eq(argmax(logits, 1), b.labels)).item()));
    }
    backward(loss);
    refOptimizer->step();
    refOptimizer->zeroGrad();
  }

  auto stages = stagesOf(spec, c.stages);
  LocalPipeline pipe(stages, optionsFor(c.schedule, c.micro, opt), c.threaded);
  ASSERT_EQ(pipe.numStages(), c.stages);
  for (size_t i = 0; i < batches.size(); ++i) {
    const StepResult r = pipe.step(batches[i].inputs, batches[i].labels);
    EXPECT_NEAR(r.loss, refLoss[i], 1e-5) << "step " << i;
    EXPECT_EQ(r.correct, refCorrect[i]) << "step " << i;
    EXPECT_EQ(r.samples, 10);
    EXPECT_EQ(r.microBatches, c.micro);
    ASSERT_EQ(r.stats.numStages(), c.stages);
    EXPECT_EQ(r.stats.steps, 1);
    for (int64_t s = 0; s < c.stages; ++s) EXPECT_GT(r.stats.busySeconds[static_cast<size_t>(s)], 0);
    EXPECT_NEAR(r.stats.computeShare() + r.stats.bubbleShare() + r.stats.overheadShare(), 1.0, 1e-9);
    if (!c.threaded) {
      // One op at a time: the ideal is all the compute, and the wall time holds it all.
      double busy = 0;
      for (double b : r.stats.busySeconds) busy += b;
      EXPECT_DOUBLE_EQ(r.stats.idealSeconds, busy);
      EXPECT_GE(r.stats.wallSeconds, busy);
    }
  }
  const auto got = parametersOf(stages);
  const auto want = reference->parameters();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const auto g = got[i].toVector<float>();
    const auto w = want[i].toVector<float>();
    ASSERT_EQ(g.size(), w.size());
    for (size_t k = 0; k < w.size(); ++k) ASSERT_NEAR(g[k], w[k], 1e-5) << "parameter " << i << " element " << k;
  }
}

std::vector<ParityCase> parityCases() {
  std::vector<ParityCase> cases;
  for (Schedule s : {Schedule::kGPipe, Schedule::k1F1B}) {
    for (bool threaded : {true, false}) {
      for (int64_t m = 1; m <= 4; ++m) cases.push_back({s, threaded, m, m == 1 ? 2 : 3, false});
      cases.push_back({s, threaded, 8, 4, false});  // a batch of 10 in 8: sizes 2 2 1 1 1 1 1 1
    }
  }
  cases.push_back({Schedule::k1F1B, true, 3, 2, true});
  cases.push_back({Schedule::kGPipe, false, 4, 3, true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Mlp, PipelineParity, ::testing::ValuesIn(parityCases()));

// Threads change when ops run, not what each stage computes or in which order: threaded and sequential
// pipelines end bit for bit equal, BatchNorm running statistics included.
TEST(LocalPipelineTest, ThreadedEqualsSequentialBitwise) {
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    auto threadedStages = stagesOf(resnetSpec(), 3);
    auto sequentialStages = stagesOf(resnetSpec(), 3);
    LocalPipeline threaded(threadedStages, optionsFor(schedule, 3, sgd()), true);
    LocalPipeline sequential(sequentialStages, optionsFor(schedule, 3, sgd()), false);
    for (uint64_t step = 0; step < 2; ++step) {
      const Batch b = randomBatch(8, 300 + step);
      const StepResult a = threaded.step(b.inputs, b.labels);
      const StepResult c = sequential.step(b.inputs, b.labels);
      EXPECT_EQ(a.loss, c.loss);
    }
    expectBitwise(parametersOf(threadedStages), parametersOf(sequentialStages));
    std::vector<Tensor> bt, bs;
    for (const auto& s : threadedStages)
      for (const Tensor& b : s->buffers()) bt.push_back(b);
    for (const auto& s : sequentialStages)
      for (const Tensor& b : s->buffers()) bs.push_back(b);
    expectBitwise(bt, bs);
  }
}

// A ResNet (BatchNorm in every stage) trains through the pipeline: the loss on a fixed batch falls.
TEST(LocalPipelineTest, ResNetLossDecreases) {
  std::shared_ptr<Module> model;
  auto stages = stagesOf(resnetSpec(), 2, &model);
  LocalPipeline pipe(stages, optionsFor(Schedule::k1F1B, 4, optim::OptimizerSpec::adam({.learningRate = 0.01})));
  const Batch b = randomBatch(32, 7);
  double first = 0;
  double last = 0;
  for (int step = 0; step < 8; ++step) {
    const StepResult r = pipe.step(b.inputs, b.labels);
    ASSERT_TRUE(std::isfinite(r.loss));
    if (step == 0) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, 0.7 * first) << "first " << first << ", last " << last;
  // predict() is the model's eval-mode forward, and leaves the stages training.
  const Tensor logits = pipe.predict(b.inputs);
  for (const auto& s : stages) EXPECT_TRUE(s->isTraining());
  autograd::NoGradGuard noGrad;
  model->eval();
  expectBitwise({logits}, {model->forward(b.inputs)});
}

// 1F1B keeps at most S - s micro-batches in flight on stage s; GPipe holds all M.
TEST(LocalPipelineTest, InFlightBounds) {
  const Batch b = randomBatch(12, 5);
  for (bool threaded : {true, false}) {
    LocalPipeline onef(stagesOf(mlpSpec(), 3), optionsFor(Schedule::k1F1B, 6, sgd()), threaded);
    EXPECT_EQ(onef.step(b.inputs, b.labels).stats.maxInFlight, (std::vector<int64_t>{3, 2, 1}));
    LocalPipeline gpipe(stagesOf(mlpSpec(), 3), optionsFor(Schedule::kGPipe, 6, sgd()), threaded);
    const StepResult r = gpipe.step(b.inputs, b.labels);
    EXPECT_EQ(r.stats.maxInFlight, (std::vector<int64_t>{6, 6, 6}));
    EXPECT_EQ(r.stats.peakActivationBytes, (std::vector<int64_t>{-1, -1, -1}));
  }
  // A batch smaller than M: one micro-batch per sample.
  LocalPipeline small(stagesOf(mlpSpec(), 2), optionsFor(Schedule::kGPipe, 8, sgd()));
  const Batch three = randomBatch(3, 6);
  const StepResult r = small.step(three.inputs, three.labels);
  EXPECT_EQ(r.microBatches, 3);
  EXPECT_EQ(r.stats.maxInFlight, (std::vector<int64_t>{3, 3}));
}

// Traced (docs/tracing.md, "Pipeline events"), in a process without an agent: registered as a trace worker,
// the process gets every pipeline event in its file. Each step records one pipeline.step on the caller's
// thread and, per stage and micro-batch, exactly one pipeline.forward and one pipeline.backward (on the
// stage's own thread when threaded, named dg-stage-S) inside the step's span, and each stage's
// pipeline.optimizer; predict() records none.
TEST(LocalPipelineTest, TracedStepsRecordEveryStageAndMicroBatch) {
  constexpr int64_t kStages = 3;
  constexpr int64_t kMicro = 4;
  constexpr int64_t kSteps = 2;
  const Batch b = randomBatch(8, 9);
  for (bool threaded : {true, false}) {
    SCOPED_TRACE(threaded ? "threaded" : "sequential");
    trace::testing::TempDir dir;
    const trace::WorkerSlot slot = trace::registerWorker("local", 0, dir.path());
    ASSERT_TRUE(trace::enabled());
    {
      LocalPipeline pipe(stagesOf(mlpSpec(), kStages), optionsFor(Schedule::k1F1B, kMicro, sgd()), threaded);
      for (int64_t k = 0; k < kSteps; ++k) (void)pipe.step(b.inputs, b.labels);
      (void)pipe.predict(b.inputs);
    }
    trace::unregisterWorker(slot);
    const trace::testing::TraceFile file = trace::testing::readTrace(dir.path() + "/local.trace.jsonl");
    ASSERT_TRUE(file.end.has_value());

    const auto steps = tracecheck::expectStepEvents(file, kMicro, kStages, kSteps, "1f1b");
    tracecheck::expectStageEvents(file, 0, kStages, kMicro, kSteps, "local");
    const auto optimizers = tracecheck::pipelineEvents(file, "pipeline.optimizer", "");
    EXPECT_EQ(static_cast<int64_t>(optimizers.size()), kStages * kSteps);
    std::map<int64_t, int64_t> stageTid;  // every event of a stage on one thread
    const int64_t driverTid = steps.empty() ? -1 : steps.begin()->second->integer("tid").value_or(-1);
    for (const char* name : {"pipeline.forward", "pipeline.backward", "pipeline.optimizer"}) {
      for (const auto& [key, e] : tracecheck::pipelineEvents(file, name, "")) {
        const int64_t stage = std::get<0>(key);
        const int64_t step = std::get<2>(key);
        // Inside its step's span (one clock: the same process).
        const auto it = steps.find(tracecheck::Key{step, kMicro, kStages});
        ASSERT_NE(it, steps.end()) << name << " of step " << step;
        EXPECT_GE(e->integer("b"), it->second->integer("b")) << name;
        EXPECT_LE(e->integer("e"), it->second->integer("e")) << name;
        const int64_t tid = e->integer("tid").value_or(-1);
        EXPECT_EQ(stageTid.emplace(stage, tid).first->second, tid) << name << " of stage " << stage;
        if (threaded) {
          EXPECT_NE(tid, driverTid) << name;
        } else {
          EXPECT_EQ(tid, driverTid) << name;
        }
      }
    }
    if (threaded) {
      for (const auto& [stage, tid] : stageTid) {
        bool named = false;
        for (const auto& t : file.threads) {
          named = named || (t.integer("tid") == tid && t.string("name") == "dg-stage-" + std::to_string(stage));
        }
        EXPECT_TRUE(named) << "stage " << stage << "'s thread";
      }
    }
  }
  EXPECT_FALSE(trace::enabled());
}

TEST(LocalPipelineTest, Describe) {
  LocalPipeline a(stagesOf(mlpSpec(), 2), optionsFor(Schedule::k1F1B, 4, sgd()));
  EXPECT_EQ(a.describe(), "local pipeline, 2 stages, 1f1b, 4 micro-batches");
  LocalPipeline b(stagesOf(mlpSpec(), 3), optionsFor(Schedule::kGPipe, 1, sgd()), false);
  EXPECT_EQ(b.describe(), "local model parallel (sequential), 3 stages, gpipe order, 1 micro-batch");
}

TEST(LocalPipelineTest, ConstructorRejectsBadInput) {
  expectThrowsWith([] { LocalPipeline({}, PipelineOptions{}); }, {"no stages"});
  expectThrowsWith([] { LocalPipeline({nullptr}, PipelineOptions{}); }, {"stage 0 is null"});
  auto stages = stagesOf(mlpSpec(), 2);
  expectThrowsWith(
      [&] {
        LocalPipeline({stages[0], stages[1], stages[0]}, PipelineOptions{});
      },
      {"stage 2", "earlier stage"});
  expectThrowsWith([&] { LocalPipeline(stages, optionsFor(Schedule::kGPipe, 0, sgd())); }, {"microBatches", "0"});
  optim::OptimizerSpec bad = sgd();
  bad.learningRate = -1;
  EXPECT_THROW(LocalPipeline(stages, optionsFor(Schedule::kGPipe, 2, bad)), ValueError);
}

// A module that fails on demand, in its forward or in its backward (an identity op whose backward throws).
class Faulty : public Module {
 public:
  Faulty() : Module("Faulty") {}
  Tensor forward(const Tensor& input) override {
    if (failForward) throw std::runtime_error("injected forward failure");
    Tensor y = mul(input, 1.0);
    if (!failBackward || !autograd::anyRequiresGrad({input})) return y;
    return autograd::recordOp("FailingBackward", {input}, y.detach(),
                              [](const std::vector<Tensor>&, const autograd::Node&) -> std::vector<Tensor> {
                                throw std::runtime_error("injected backward failure");
                              });
  }
  bool failForward = false;
  bool failBackward = false;
};

struct FaultCase {
  Schedule schedule;
  bool threaded;
};

class PipelineFaults : public ::testing::TestWithParam<FaultCase> {};

// Errors come back naming the stage, never hang; the pipeline works again afterwards, and a failed
// forward leaves the weights alone.
TEST_P(PipelineFaults, ErrorsNameTheStageAndThePipelineRecovers) {
  const FaultCase c = GetParam();
  auto units = modelUnits(mlpSpec(), buildModel(mlpSpec()));  // 3 units
  auto faulty = std::make_shared<Faulty>();
  std::vector<std::shared_ptr<Module>> stages{
      units[0], std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{faulty, units[1]}), units[2]};
  LocalPipeline pipe(stages, optionsFor(c.schedule, 4, sgd()), c.threaded);
  const Batch b = randomBatch(8, 9);
  std::vector<Tensor> before;
  for (const Tensor& p : parametersOf(stages)) before.push_back(p.cloneData());

  // Wrong input shape (20x20 images): the first Linear refuses them (a ValueError, kept as one).
  const Tensor small = narrow(narrow(b.inputs, 2, 0, 20), 3, 0, 20);
  expectThrowsWith([&] { pipe.step(small, b.labels); }, {"local pipeline stage 0: "});
  // A label the last stage's loss cannot take.
  Tensor badLabels = b.labels.cloneData();
  badLabels.data<int64_t>()[5] = 42;
  expectThrowsWith([&] { pipe.step(b.inputs, badLabels); }, {"local pipeline stage 2: ", "42"});
  // A failure that is not a ValueError, in a middle stage.
  faulty->failForward = true;
  try {
    pipe.step(b.inputs, b.labels);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("local pipeline stage 1: injected forward failure"), std::string::npos)
        << e.what();
  }
  faulty->failForward = false;
  expectBitwise(parametersOf(stages), before);  // no failed step changed a weight

  faulty->failBackward = true;
  try {
    pipe.step(b.inputs, b.labels);
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("local pipeline stage 1: injected backward failure"), std::string::npos)
        << e.what();
  }
  faulty->failBackward = false;

  // Usable again.
  const StepResult r = pipe.step(b.inputs, b.labels);
  EXPECT_TRUE(std::isfinite(r.loss));
  EXPECT_EQ(r.samples, 8);
  // Bad arguments are refused before any stage runs.
  expectThrowsWith([&] { pipe.step(b.inputs, narrow(b.labels, 0, 0, 7)); }, {"8 inputs but 7 labels"});
  expectThrowsWith([&] { pipe.step(b.inputs, b.labels.toDType(DType::kFloat32)); }, {"int64"});
  expectThrowsWith([&] { pipe.step(narrow(b.inputs, 0, 0, 0), narrow(b.labels, 0, 0, 0)); },
                   {"batch size must be >= 1"});
}

INSTANTIATE_TEST_SUITE_P(Faults, PipelineFaults,
                         ::testing::Values(FaultCase{Schedule::kGPipe, true}, FaultCase{Schedule::k1F1B, true},
                                           FaultCase{Schedule::kGPipe, false}, FaultCase{Schedule::k1F1B, false}),
                         [](const auto& info) {
                           return std::string(scheduleName(info.param.schedule)) +
                                  (info.param.threaded ? "_threaded" : "_sequential");
                         });

// Threads start in the constructor and stop in the destructor, with or without a step in between.
TEST(LocalPipelineTest, ConstructAndDestroyWithoutSteps) {
  for (int i = 0; i < 20; ++i) LocalPipeline pipe(stagesOf(mlpSpec(), 3), optionsFor(Schedule::k1F1B, 2, sgd()));
}

}  // namespace
}  // namespace distgrad::models::pipeline
