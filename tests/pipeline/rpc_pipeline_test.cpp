// RpcPipeline over inproc and tcp: a driver (worker0) and three stage workers (worker1..3) in this
// process. An MLP pipeline with GPipe and 1F1B and 1..4 micro-batches (uneven ones included) ends where
// plain full-batch training of the same ModelSpec ends; with 1, 2 and 3 stages it computes what the
// LocalPipeline computes on the same stages (losses, correct counts, parameters after SGD and Adam steps); the activations travel stage to stage, never through
// the driver, and neither do the logits: the last stage computes the loss (the driver's byte counters and
// the stages' own record of where their inputs came from); GPipe holds all
// micro-batches in flight at every stage, 1F1B exactly stages - s at stage s; with 8 micro-batches the stages
// hold one copy of their gradients, not 8 (folded contexts); a small ResNet trains; a stage
// error (a wrong input shape) comes back from step() naming the stage's worker under both schedules, a 1F1B
// step failing mid-way returns at once, and the pipeline works again afterwards; predict() equals the local
// model; every context, RRef and optimizer is released. Then, across processes: a killed stage worker fails
// step() with an error naming it, within the heartbeat bound. Traced: every stage and micro-batch's events
// in its worker's file, and under GPipe the last stage's drain one micro-batch at a time, in order.
#include "models/pipeline/rpc_pipeline.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/optim/distributed_optimizer.h"
#include "models/pipeline/local_pipeline.h"
#include "models/pipeline/model_spec.h"
#include "models/pipeline/partition.h"
#include "models/pipeline/schedule.h"
#include "rpc/trace.h"
#include "rref/context.h"
#include "tensor/cuda/runtime.h"
#include "tensor/random.h"
#include "tests/pipeline/pipeline_trace_util.h"
#include "tests/rpc/agent_test_util.h"
#include "tests/rref/rref_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::models::pipeline {
namespace {

using namespace std::chrono_literals;
using autograd::distributed::liveContexts;
using optim::DistributedOptimizer;
using optim::LocalOptimizer;
using optim::OptimizerSpec;
using rpc::testing::eventually;

void bindPipelineWorker(rpc::Registry& reg) {
  rref::RRefContext::install(reg);
  autograd::distributed::install(reg);
  DistributedOptimizer::install(reg);
  installPipeline(reg);
}

// An MLP on 1x6x6 "images": 36 -> 48 -> 40 -> 5, cut into [Linear+ReLU, Linear+ReLU] and [Linear].
ModelSpec mlpSpec() {
  ModelSpec spec;
  spec.name = "mlp";
  spec.inChannels = 1;
  spec.imageSize = 6;
  spec.hidden = {48, 40};
  spec.numClasses = 5;
  spec.seed = 17;
  return spec;
}

std::vector<RemoteStage> twoStages(const ModelSpec& model, int64_t cut) {
  const int64_t units = numUnits(model);
  return {RemoteStage{"worker1", StageSpec{model, 0, cut}}, RemoteStage{"worker2/cpu", StageSpec{model, cut, units}}};
}

Tensor images(int64_t n, const ModelSpec& spec, uint64_t seed) {
  tensor::Generator gen(seed);
  return tensor::uniform({n, spec.inChannels, spec.imageSize, spec.imageSize}, -1.0, 1.0, gen);
}

Tensor classes(int64_t n, int64_t numClasses, uint64_t seed) {
  tensor::Generator gen(seed);
  std::vector<int64_t> values;
  for (int64_t i = 0; i < n; ++i) values.push_back(static_cast<int64_t>(gen.below(static_cast<uint64_t>(numClasses))));
  return Tensor::fromVector(values, {n});
}

double maxAbsDiff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const auto x = a.toVector<float>();
  const auto y = b.toVector<float>();
  double out = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) out = std::max(out, std::abs(double(x[i]) - double(y[i])));
  return out;
}

class RpcPipelineTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    bindPipelineWorker(registry_);
    rpc::testing::ClusterSpec spec;
    spec.transport = GetParam();
    spec.size = 4;  // a driver and up to three stage workers
    spec.executorThreads = executorThreads_;
    spec.traceDir = traceDir_;
    rpc::testing::startCluster(cluster_, spec, world_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) ASSERT_FALSE(cluster_.errors[i]) << "rank " << i;
  }

  void TearDown() override {
    // Every context, RRef and LocalOptimizer released on every worker once the pipelines are gone.
    for (auto& a : cluster_.agents) {
      EXPECT_TRUE(eventually([&] { return liveContexts(*a) == 0; })) << a->name() << ": " << liveContexts(*a);
      EXPECT_TRUE(eventually([&] { return LocalOptimizer::liveCount(*a) == 0; })) << a->name();
    }
    EXPECT_TRUE(rrefsSettled()) << rrefTables();
  }

  rpc::Agent& agent(int rank) { return *cluster_.agents.at(rank); }

  bool rrefsSettled() { return rref::testing::rrefsSettled(cluster_.agents); }
  std::string rrefTables() { return rref::testing::rrefTables(cluster_.agents); }

  std::string traceDir_;  // Options::traceDir of every worker (a derived fixture's)
  size_t executorThreads_ = 3;  // every worker's (a derived fixture's)
  rpc::testing::World world_;
  rpc::Registry registry_;
  rpc::testing::Cluster cluster_;
};

// ---------------------------------------------------------------- equivalence with local training

TEST_P(RpcPipelineTest, MlpMatchesLocalFullBatchTrainingForEverySchedule) {
  const ModelSpec model = mlpSpec();
  const OptimizerSpec optimizer = OptimizerSpec::sgd({.learningRate = 0.1, .momentum = 0.9, .weightDecay = 1e-3});
  constexpr int64_t kBatch = 10;  // 3 micro-batches: 4, 3, 3; 4: 3, 3, 2, 2
  constexpr int kSteps = 2;

  // The reference: the whole model in this process, full batches.
  auto reference = buildModel(model);
  const std::vector<Tensor> initial = [&] {
    std::vector<Tensor> out;
    for (const Tensor& p : reference->parameters()) out.push_back(p.cloneData());
    return out;
  }();
  auto referenceOptimizer = optimizer.make(reference->parameters());
  std::vector<double> referenceLosses;
  for (int step = 0; step < kSteps; ++step) {
    referenceOptimizer->zeroGrad();
    Tensor loss = crossEntropy(reference->forward(images(kBatch, model, 100 + step)), classes(kBatch, 5, 200 + step));
    referenceLosses.push_back(loss.item());
    distgrad::backward(loss);
    referenceOptimizer->step();
  }

  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    for (int64_t microBatches : {1, 2, 3, 4}) {
      SCOPED_TRACE(std::string(scheduleName(schedule)) + ", " + std::to_string(microBatches) + " micro-batches");
      RpcPipeline pipe(agent(0), twoStages(model, 2),
                       {.microBatches = microBatches, .schedule = schedule, .optimizer = optimizer});
      EXPECT_EQ(pipe.numStages(), 2);
      EXPECT_EQ(pipe.workers(), (std::vector<std::string>{"worker1", "worker2"}));
      const std::vector<Tensor> start = pipe.fetchParameters();
      ASSERT_EQ(start.size(), initial.size());
      for (size_t i = 0; i < start.size(); ++i) ASSERT_EQ(maxAbsDiff(start[i], initial[i]), 0.0) << "parameter " << i;
      for (int step = 0; step < kSteps; ++step) {
        StepResult r = pipe.step(images(kBatch, model, 100 + step), classes(kBatch, 5, 200 + step));
        EXPECT_NEAR(r.loss, referenceLosses[step], 1e-5) << "step " << step;
        EXPECT_EQ(r.samples, kBatch);
        EXPECT_EQ(r.microBatches, microBatches);
        EXPECT_GE(r.correct, 0);
        EXPECT_LE(r.correct, kBatch);
        // The stats of a step: both stages measured every micro-batch.
        ASSERT_EQ(r.stats.busySeconds.size(), 2u);
        EXPECT_EQ(r.stats.steps, 1);
        EXPECT_GT(r.stats.wallSeconds, 0.0);
        EXPECT_GT(r.stats.idealSeconds, 0.0);
        EXPECT_LE(r.stats.idealSeconds, r.stats.wallSeconds * 1.05);
        for (const StageStats& st : pipe.lastStageStats()) {
          EXPECT_EQ(st.forwards, microBatches) << st.worker;
          EXPECT_EQ(st.backwards, microBatches) << st.worker;
          // CPU: the compute's share of the process's (one process here: all three agents).
          EXPECT_GT(st.computeCpuSeconds, 0.0) << st.worker;
          EXPECT_GE(st.cpuSeconds + 0.01, st.computeCpuSeconds) << st.worker;  // (clock granularities)
          for (int64_t m = 0; m < microBatches; ++m) {
            EXPECT_GT(st.forwardSeconds[m], 0.0) << st.worker << " micro-batch " << m;
            EXPECT_GT(st.backwardSeconds[m], 0.0) << st.worker << " micro-batch " << m;
          }
        }
      }
      const std::vector<Tensor> trained = pipe.fetchParameters();
      for (size_t i = 0; i < trained.size(); ++i) {
        EXPECT_LE(maxAbsDiff(trained[i], reference->parameters()[i]), 1e-5) << "parameter " << i;
        EXPECT_GT(maxAbsDiff(trained[i], initial[i]), 1e-3) << "parameter " << i << " did not move";
      }
    }
  }
}

// The RPC pipeline computes what the local pipeline computes on the same stages: the last stage's loss
// (Note [Loss on the last stage]) is the local pipeline's last stage's, the same ops on the same logits, so
// losses, correct counts and every parameter after two steps agree, for both schedules, with 1 (the
// one-stage call, forwardFirstLoss), 2 and 3 stages, SGD with momentum and Adam. Each stage sums its
// micro-batches' gradients in the order their backwards reach it, which a stage's threads may change, so
// parameters agree to float rounding of that sum (1e-6), not necessarily bit for bit.
TEST_P(RpcPipelineTest, SameLossesAndParametersAsTheLocalPipeline) {
  const ModelSpec model = mlpSpec();  // 3 units
  const int64_t units = numUnits(model);
  struct Case {
    Schedule schedule;
    int64_t stages;
    int64_t microBatches;
    bool adam;
  };
  const std::vector<Case> cases{
      {Schedule::kGPipe, 2, 4, false}, {Schedule::k1F1B, 2, 4, false}, {Schedule::kGPipe, 3, 3, false},
      {Schedule::k1F1B, 3, 4, true},   {Schedule::k1F1B, 3, 2, false}, {Schedule::kGPipe, 1, 2, true},
      {Schedule::k1F1B, 1, 3, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(scheduleName(c.schedule)) + ", " + std::to_string(c.stages) + " stages, " +
                 std::to_string(c.microBatches) + " micro-batches" + (c.adam ? ", adam" : ", sgd"));
    const OptimizerSpec optimizer = c.adam ? OptimizerSpec::adam({.learningRate = 0.01})
                                           : OptimizerSpec::sgd({.learningRate = 0.1, .momentum = 0.9});
    const Partition partition = uniformPartition(units, c.stages);
    const std::vector<StageSpec> specs = stageSpecs(model, partition);
    std::vector<RemoteStage> remote;
    std::vector<std::shared_ptr<Module>> local;
    for (size_t s = 0; s < specs.size(); ++s) {
      remote.push_back({"worker" + std::to_string(s + 1), specs[s]});
      local.push_back(buildStage(specs[s]));
    }
    const PipelineOptions options{.microBatches = c.microBatches, .schedule = c.schedule, .optimizer = optimizer};
    RpcPipeline rpcPipe(agent(0), remote, options);
    LocalPipeline localPipe(local, options);
    for (int step = 0; step < 2; ++step) {
      const Tensor x = images(10, model, 300 + step);  // 10 in 3 or 4: uneven micro-batches
      const Tensor y = classes(10, 5, 400 + step);
      const StepResult got = rpcPipe.step(x, y);
      const StepResult want = localPipe.step(x, y);
      EXPECT_NEAR(got.loss, want.loss, 1e-6) << "step " << step;
      EXPECT_EQ(got.correct, want.correct) << "step " << step;
      EXPECT_EQ(got.microBatches, want.microBatches);
    }
    const std::vector<Tensor> got = rpcPipe.fetchParameters();
    std::vector<Tensor> want;
    for (const auto& stage : local) {
      for (const Tensor& p : stage->parameters()) want.push_back(p);
    }
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_LE(maxAbsDiff(got[i], want[i]), 1e-6) << "parameter " << i;
  }
}

TEST_P(RpcPipelineTest, ActivationsGoStageToStageNeverThroughTheDriver) {
  ModelSpec model = mlpSpec();
  model.hidden = {64, 2048};  // wide activations between the stages, small inputs and logits
  constexpr int64_t kBatch = 16;
  constexpr int64_t kMicroBatches = 4;
  RpcPipeline pipe(agent(0), twoStages(model, 2),
                   {.microBatches = kMicroBatches, .schedule = Schedule::k1F1B, .optimizer = OptimizerSpec::sgd({})});
  (void)pipe.step(images(kBatch, model, 1), classes(kBatch, 5, 2));  // warm: connections, forks settled
  const rpc::PeerMetrics to1 = agent(0).metrics("worker1");
  const rpc::PeerMetrics to2 = agent(0).metrics("worker2");
  (void)pipe.step(images(kBatch, model, 3), classes(kBatch, 5, 4));
  const rpc::PeerMetrics after1 = agent(0).metrics("worker1");
  const rpc::PeerMetrics after2 = agent(0).metrics("worker2");

  // What stage 0 hands to stage 1 in one step, forward (and as much again backward).
  const uint64_t activationBytes = kBatch * 2048 * sizeof(float);
  const uint64_t inputBytes = kBatch * 36 * sizeof(float);
  const uint64_t labelBytes = kBatch * sizeof(int64_t);
  const uint64_t received1 = after1.bytesReceived - to1.bytesReceived;
  const uint64_t sent1 = after1.bytesSent - to1.bytesSent;
  const uint64_t received2 = after2.bytesReceived - to2.bytesReceived;
  const uint64_t sent2 = after2.bytesSent - to2.bytesSent;
  SCOPED_TRACE("driver <-> worker1: sent " + std::to_string(sent1) + ", received " + std::to_string(received1) +
               "; driver <-> worker2: sent " + std::to_string(sent2) + ", received " + std::to_string(received2) +
               "; activations per step " + std::to_string(activationBytes));
  // To stage 0: the inputs plus control (calls, RRef forks, autograd plans, the optimizer step, stats); from
  // it: control only. To stage 1: the labels plus control; from it: the losses (scalars) plus control (the
  // logits stay there: Note [Loss on the last stage]). None of it carries the activations (each direction's
  // total stays well below them).
  EXPECT_GE(sent1, inputBytes);
  EXPECT_LT(sent1, inputBytes + activationBytes / 4);
  EXPECT_LT(received1, activationBytes / 4);
  EXPECT_GE(sent2, labelBytes);
  EXPECT_LT(received2, activationBytes / 4);
  EXPECT_LT(sent2, activationBytes / 4);
  // The stages' own record: stage 0's inputs came from the driver, stage 1's from stage 0's worker.
  ASSERT_EQ(pipe.lastStageStats().size(), 2u);
  EXPECT_EQ(pipe.lastStageStats()[0].inputFrom, std::vector<std::string>(kMicroBatches, "worker0"));
  EXPECT_EQ(pipe.lastStageStats()[1].inputFrom, std::vector<std::string>(kMicroBatches, "worker1"));
}

// GPipe: every stage holds all micro-batches (the last stage keeps every loss until its last forward).
// 1F1B: stage s never holds more than S - s, and reaches it: the driver issues every call at once, so a stage
// finds its next forward waiting unless the whole micro-batch went through before the driver's next call
// arrived, which a loaded machine can make happen in a step of this tiny model, not in all five.
TEST_P(RpcPipelineTest, GPipeHoldsEveryMicroBatchAnd1F1BAtMostStagesMinusStageIndex) {
  ModelSpec model = mlpSpec();
  const int64_t units = numUnits(model);
  constexpr int64_t kMicroBatches = 6;
  constexpr int kSteps = 5;
  for (int64_t stages : {2, 3}) {
    for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
      SCOPED_TRACE(std::string(scheduleName(schedule)) + ", " + std::to_string(stages) + " stages");
      std::vector<RemoteStage> remote;
      for (const StageSpec& spec : stageSpecs(model, uniformPartition(units, stages))) {
        remote.push_back({"worker" + std::to_string(remote.size() + 1), spec});
      }
      RpcPipeline pipe(agent(0), remote,
                       {.microBatches = kMicroBatches, .schedule = schedule, .optimizer = OptimizerSpec::sgd({})});
      std::vector<int64_t> most(static_cast<size_t>(stages), 0);
      for (int step = 0; step < kSteps; ++step) {
        StepResult r = pipe.step(images(12, model, 10 + step), classes(12, 5, 20 + step));
        ASSERT_EQ(r.stats.maxInFlight.size(), static_cast<size_t>(stages));
        for (int64_t s = 0; s < stages; ++s) {
          const int64_t inFlight = r.stats.maxInFlight[static_cast<size_t>(s)];
          if (schedule == Schedule::kGPipe) {
            EXPECT_EQ(inFlight, kMicroBatches) << "stage " << s << ", step " << step;
          } else {
            EXPECT_GE(inFlight, 1) << "stage " << s << ", step " << step;
            EXPECT_LE(inFlight, stages - s) << "stage " << s << ", step " << step;  // 1F1B's own bound
          }
          most[static_cast<size_t>(s)] = std::max(most[static_cast<size_t>(s)], inFlight);
          EXPECT_GE(r.stats.peakActivationBytes[static_cast<size_t>(s)], 0) << "stage " << s;
        }
      }
      if (schedule == Schedule::k1F1B) {
        for (int64_t s = 0; s < stages; ++s) EXPECT_EQ(most[static_cast<size_t>(s)], stages - s) << "stage " << s;
      }
    }
  }
}

// Note [Stage gradient folding]: with 8 micro-batches (8 contexts) the stages hold ONE copy of their
// parameters' gradients, not 8. An MLP whose parameters dwarf its activations (batch 8, one row per
// micro-batch): the stages' peak tensor bytes above the step's start stay under four copies of all the
// parameters, where one context per micro-batch holding its own would reach seven or eight. (Process-wide
// here: all three agents share this process, so both stages' gradients count, and with them what is in
// flight when a sample is taken: a layer's incoming gradient on each stage, the activations. That share
// depends on timing: it reached 3.02 copies once on a loaded machine, so the bound is four copies, still
// half of what per-context gradients would hold.)
TEST_P(RpcPipelineTest, StagesHoldOneGradientCopyWhateverTheMicroBatches) {
  ModelSpec model = mlpSpec();
  model.imageSize = 16;
  model.hidden = {256, 256};
  model.numClasses = 8;
  int64_t parameterBytes = 0;
  for (const Tensor& p : buildModel(model)->parameters()) parameterBytes += static_cast<int64_t>(p.nbytes());
  constexpr int64_t kMicroBatches = 8;
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    SCOPED_TRACE(scheduleName(schedule));
    RpcPipeline pipe(agent(0), twoStages(model, 1),
                     {.microBatches = kMicroBatches, .schedule = schedule, .optimizer = OptimizerSpec::sgd({})});
    for (int step = 0; step < 2; ++step) {
      // The previous step's contexts are released asynchronously: wait, so they are not in the baseline.
      for (auto& a : cluster_.agents) ASSERT_TRUE(eventually([&] { return liveContexts(*a) == 0; })) << a->name();
      StepResult r = pipe.step(images(8, model, 40 + step), classes(8, 8, 50 + step));
      int64_t peak = 0;
      for (int64_t bytes : r.stats.peakActivationBytes) peak = std::max(peak, bytes);
      EXPECT_LT(peak, 4 * parameterBytes) << "step " << step << ": peak " << peak << " B, parameters "
                                          << parameterBytes << " B";
      // The samples do see the gradients (at the last backward's start most of them exist).
      EXPECT_GT(peak, parameterBytes / 4) << "step " << step;
    }
  }
}

TEST_P(RpcPipelineTest, SmallResNetTrains) {
  ModelSpec model;
  model.name = "resnet18";
  model.baseWidth = 4;
  model.imageSize = 8;
  model.numClasses = 4;
  model.seed = 3;
  const int64_t units = numUnits(model);
  RpcPipeline pipe(
      agent(0),
      {RemoteStage{"worker1", StageSpec{model, 0, units / 2}},
       RemoteStage{"worker2", StageSpec{model, units / 2, units}}},
      {.microBatches = 3, .schedule = Schedule::k1F1B, .optimizer = OptimizerSpec::adam({.learningRate = 0.01})});
  const Tensor x = images(12, model, 5);
  const Tensor y = classes(12, 4, 6);
  std::vector<double> losses;
  for (int step = 0; step < 8; ++step) losses.push_back(pipe.step(x, y).loss);
  EXPECT_LT(losses.back(), 0.7 * losses.front()) << "first loss " << losses.front() << ", last " << losses.back();
  // predict runs the stages in eval mode (BatchNorm running statistics) and restores training.
  const Tensor logits = pipe.predict(x);
  EXPECT_EQ(logits.shape(), (Shape{12, 4}));
  (void)pipe.step(x, y);
}

TEST_P(RpcPipelineTest, PredictEqualsTheLocalModel) {
  const ModelSpec model = mlpSpec();
  RpcPipeline pipe(
      agent(0), twoStages(model, 2),
      {.microBatches = 2, .schedule = Schedule::kGPipe, .optimizer = OptimizerSpec::sgd({.learningRate = 0.2})});
  (void)pipe.step(images(8, model, 30), classes(8, 5, 31));
  // The local model with the pipeline's trained parameters.
  auto local = buildModel(model);
  const std::vector<Tensor> trained = pipe.fetchParameters();
  std::vector<Tensor> params = local->parameters();
  ASSERT_EQ(trained.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) params[i].copyFrom(trained[i]);
  const Tensor x = images(7, model, 32);  // 7 rows: uneven chunks over the two stages
  autograd::NoGradGuard noGrad;
  EXPECT_LE(maxAbsDiff(pipe.predict(x), local->forward(x)), 1e-5);
}

TEST_P(RpcPipelineTest, StageErrorNamesTheWorkerAndThePipelineRecovers) {
  const ModelSpec model = mlpSpec();
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    SCOPED_TRACE(scheduleName(schedule));
    RpcPipeline pipe(agent(0), twoStages(model, 2),
                     {.microBatches = 4, .schedule = schedule, .optimizer = OptimizerSpec::sgd({})});
    // 7 features per image instead of 36: stage 0 (worker1) refuses them.
    tensor::Generator gen(1);
    const Tensor wrong = tensor::uniform({8, 7}, -1.0, 1.0, gen);
    const auto begin = std::chrono::steady_clock::now();
    try {
      (void)pipe.step(wrong, classes(8, 5, 2));
      ADD_FAILURE() << "expected an RpcError";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.error().worker, "worker1") << e.what();
      EXPECT_NE(std::string(e.what()).find("pipeline stage on worker1"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("forward of micro-batch"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - begin, 5s);
    // Every context of the failed step is released; the next step works.
    for (int rank = 0; rank < 3; ++rank) {
      EXPECT_TRUE(eventually([&] { return liveContexts(agent(rank)) == 0; })) << rank;
    }
    StepResult r = pipe.step(images(8, model, 3), classes(8, 5, 4));
    EXPECT_TRUE(std::isfinite(r.loss));
    // Labels that do not fit the logits fail at the last stage, which computes the loss, naming it.
    try {
      (void)pipe.step(images(4, model, 3), Tensor::fromVector(std::vector<int64_t>{7, 7, 7, 7}, {4}));
      ADD_FAILURE() << "expected an RpcError";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.error().worker, "worker2") << e.what();
      EXPECT_NE(std::string(e.what()).find("loss failed"), std::string::npos) << e.what();
      EXPECT_NE(e.error().kind, rpc::ErrorKind::kCancelled) << e.what();
    }
    // Float labels are the caller's mistake, found before anything is sent.
    EXPECT_THROW((void)pipe.step(images(4, model, 3), tensor::uniform({4}, 0.0, 4.0, gen)), ValueError);
    r = pipe.step(images(8, model, 5), classes(8, 5, 6));
    EXPECT_TRUE(std::isfinite(r.loss));
  }
}

// Under GPipe the last stage keeps micro-batches 0 and 1's losses for the drain when micro-batch 2's fails:
// they fail at once (cancelled), and so does 3 when it arrives; the step reports micro-batch 2's own error.
TEST_P(RpcPipelineTest, AFailedStepLeavesNoMicroBatchInFlight) {
  const ModelSpec model = mlpSpec();
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    SCOPED_TRACE(scheduleName(schedule));
    // Micro-batch 2's labels (rows 4 and 5) are out of range: its loss fails at the last stage after
    // micro-batches 0 and 1 went through it, while 3 is forwarded or waits at stage 0, so the stages hold
    // graphs that never get a backward.
    Tensor bad = Tensor::fromVector(std::vector<int64_t>{0, 1, 2, 3, 7, 9, 4, 0}, {8});
    auto ownedRRefs = [&] {
      size_t owned = 0;
      for (auto& a : cluster_.agents) owned += rref::RRefContext::of(*a)->ownedCount();
      return owned;
    };
    // The previous schedule's pipeline is gone: its RRefs too (asynchronously), before this one's are counted.
    ASSERT_TRUE(eventually([&] { return ownedRRefs() == 0; })) << ownedRRefs();
    RpcPipeline pipe(agent(0), twoStages(model, 2),
                     {.microBatches = 4, .schedule = schedule, .optimizer = OptimizerSpec::sgd({})});
    const size_t ownedBefore = ownedRRefs();  // the stages and their parameters
    const auto begin = std::chrono::steady_clock::now();
    try {
      (void)pipe.step(images(8, model, 40), bad);
      ADD_FAILURE() << "expected an RpcError";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.error().worker, "worker2") << e.what();
      EXPECT_NE(e.error().kind, rpc::ErrorKind::kCancelled) << e.what();
      EXPECT_NE(std::string(e.what()).find("micro-batch 2"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("loss failed"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - begin, 5s) << "the failed step waited for something that never came";
    // Those graphs went with the step's contexts: their in-flight slots are free again (a held slot would
    // stall these steps' forwards behind stage 0's limit until the calls time out). They go asynchronously,
    // with the contexts and with the RRefs of the stages' outputs: waited for, so that GPipe's next step,
    // which has no limit to wait behind, does not count them in flight beside its own.
    for (auto& a : cluster_.agents) ASSERT_TRUE(eventually([&] { return liveContexts(*a) == 0; })) << a->name();
    ASSERT_TRUE(eventually([&] { return ownedRRefs() == ownedBefore; })) << ownedRRefs() << " vs " << ownedBefore;
    for (int step = 0; step < 2; ++step) {
      const auto start = std::chrono::steady_clock::now();
      StepResult r = pipe.step(images(8, model, 41 + step), classes(8, 5, 51 + step));
      EXPECT_LT(std::chrono::steady_clock::now() - start, 5s) << "step " << step << " stalled";
      EXPECT_TRUE(std::isfinite(r.loss));
      ASSERT_EQ(r.stats.maxInFlight.size(), 2u);
      if (schedule == Schedule::kGPipe) {
        // The last stage keeps every loss for the drain, so every stage holds all four.
        EXPECT_EQ(r.stats.maxInFlight, (std::vector<int64_t>{4, 4})) << "step " << step;
      } else {
        // Within 1F1B's bound (reached or not: that depends on how fast the calls come).
        EXPECT_GE(r.stats.maxInFlight[0], 1) << "step " << step;
        EXPECT_LE(r.stats.maxInFlight[0], 2) << "step " << step;
        EXPECT_EQ(r.stats.maxInFlight[1], 1) << "step " << step;
      }
    }
  }
}

// A stage may switch modes the moment its last forward answered: a continuation that runs as that answer
// is published (inline, on the stage's runner thread) finds no forward running. The second forward waits
// for the in-flight slot the first one holds, so its runner is an executor thread that resumes it after
// the test has attached the continuation.
TEST_P(RpcPipelineTest, ModesSwitchAsSoonAsTheLastForwardAnswered) {
  auto stage = std::make_shared<PipelineStage>("worker1", StageSpec{mlpSpec(), 0, 2});
  stage->setMaxInFlight(1);
  rpc::CallContext ctx;
  ctx.agent = &agent(1);
  ctx.caller = "worker0";
  ctx.callee = "worker1";
  for (int i = 0; i < 5; ++i) {
    Tensor first = stage->forwardFirst(ctx, images(2, mlpSpec(), 2 * i), 0, i, 0).get();
    rpc::Future<Tensor> second = stage->forwardFirst(ctx, images(2, mlpSpec(), 2 * i + 1), 1, i, 0);
    ASSERT_FALSE(second.isReady()) << "the second forward should wait for the first one's slot";
    std::promise<std::string> switched;
    (void)std::move(second).then(rpc::kInlineSafe, [&](rpc::Result<Tensor>&& r) {
      std::string problem = r.ok() ? "" : r.error().message;
      try {
        if (problem.empty()) stage->train(false);
        if (problem.empty()) stage->train(true);
      } catch (const std::exception& e) {
        problem = e.what();
      }
      switched.set_value(problem);
    });
    first = Tensor();  // its graph goes without a backward: the slot frees and the second forward runs
    EXPECT_EQ(switched.get_future().get(), "");
  }
}

TEST_P(RpcPipelineTest, CpuPlacementTrainsAndFetchedParametersAreCopies) {
  // Runs everywhere: an explicit "/cpu" placement moves nothing (PipelineStage::to), and the parameters come
  // back as copies, not views of the stages' own (inproc passes references).
  const ModelSpec model = mlpSpec();
  RpcPipeline pipe(agent(0), {RemoteStage{"worker1/cpu", StageSpec{model, 0, 2}}, twoStages(model, 2)[1]},
                   {.microBatches = 2, .schedule = Schedule::k1F1B, .optimizer = OptimizerSpec::sgd({.learningRate = 0.1})});
  const std::vector<Tensor> before = pipe.fetchParameters();
  (void)pipe.step(images(6, model, 50), classes(6, 5, 51));
  const std::vector<Tensor> after = pipe.fetchParameters();
  ASSERT_EQ(before.size(), after.size());
  double moved = 0;
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(after[i].device(), Device::cpu());
    moved = std::max(moved, maxAbsDiff(before[i], after[i]));
  }
  EXPECT_GT(moved, 0.0) << "the step changed no parameter, or fetchParameters returned views";
}

TEST_P(RpcPipelineTest, GpuStagesTrainAndPredictLikeCpuStages) {
  if (!tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device";
  // Note [Stage devices]: both stages on cuda:0 (two processes' worth of workers on one GPU), against the
  // same pipeline on the CPU; float32 on different kernels, so within 1e-4.
  const ModelSpec model = mlpSpec();
  std::vector<RemoteStage> gpuStages = twoStages(model, 2);
  gpuStages[0].placement = "worker1/cuda:0";
  gpuStages[1].placement = "worker2/cuda:0";
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    SCOPED_TRACE(scheduleName(schedule));
    const PipelineOptions options{.microBatches = 2, .schedule = schedule,
                                  .optimizer = OptimizerSpec::sgd({.learningRate = 0.1, .momentum = 0.9})};
    RpcPipeline onGpu(agent(0), gpuStages, options);
    RpcPipeline onCpu(agent(0), twoStages(model, 2), options);
    for (int step = 0; step < 2; ++step) {
      const Tensor x = images(6, model, 60 + step);
      const Tensor y = classes(6, 5, 70 + step);
      const StepResult got = onGpu.step(x, y);
      const StepResult want = onCpu.step(x, y);
      EXPECT_NEAR(got.loss, want.loss, 1e-4) << "step " << step;
    }
    const std::vector<Tensor> got = onGpu.fetchParameters();
    const std::vector<Tensor> want = onCpu.fetchParameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].device(), Device::cpu());
      EXPECT_LE(maxAbsDiff(got[i], want[i]), 1e-4) << "parameter " << i;
    }
    const Tensor x = images(5, model, 80);
    const Tensor predicted = onGpu.predict(x);
    EXPECT_EQ(predicted.device(), Device::cpu());
    EXPECT_LE(maxAbsDiff(predicted, onCpu.predict(x)), 1e-4);
  }
}

TEST_P(RpcPipelineTest, BadConfigurationsAreValueErrors) {
  const ModelSpec model = mlpSpec();
  EXPECT_THROW(RpcPipeline(agent(0), {}, {}), ValueError);
  // Stages that do not chain.
  EXPECT_THROW(
      RpcPipeline(agent(0),
                  {RemoteStage{"worker1", StageSpec{model, 0, 1}}, RemoteStage{"worker2", StageSpec{model, 2, 3}}}, {}),
      ValueError);
  if (!tensor::cuda::isAvailable()) {
    // A GPU stage on a worker without a GPU: the owner refuses the placement, naming itself and the device.
    try {
      RpcPipeline(agent(0), {RemoteStage{"worker1/cuda:0", StageSpec{model, 0, 3}}}, {});
      ADD_FAILURE() << "a cuda:0 stage on a worker without a GPU was accepted";
    } catch (const std::exception& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("cuda:0"), std::string::npos) << message;
      EXPECT_NE(message.find("worker1"), std::string::npos) << message;
    }
  }
  EXPECT_THROW(RpcPipeline(agent(0), twoStages(model, 2),
                           PipelineOptions{.microBatches = 0, .schedule = Schedule::kGPipe, .optimizer = {}}),
               ValueError);
}

INSTANTIATE_TEST_SUITE_P(Transports, RpcPipelineTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

// ---------------------------------------------------------------- a stage worker dies (processes)

// worker2 (the last stage) runs in a forked child; the driver (worker0) and stage 0 (worker1) here.
class StageWorkerDeathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int portPipe[2];
    ASSERT_EQ(pipe(portPipe), 0);
    child_ = fork();  // before this test starts any thread
    if (child_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      int storePort = 0;
      if (read(portPipe[0], &storePort, sizeof(storePort)) != sizeof(storePort)) _exit(2);
      try {
        rpc::Registry reg;
        bindPipelineWorker(reg);
        auto agent = rpc::Agent::start(rpc::testing::processOptions(2, 3, storePort, kSecret), reg);
        while (true) pause();
      } catch (...) {
        _exit(3);
      }
    }
    ASSERT_GT(child_, 0);
    store_ = rpc::StoreServer::start("127.0.0.1:0");
    const int port = store_->port();
    ASSERT_EQ(write(portPipe[1], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
    close(portPipe[0]);
    close(portPipe[1]);
    bindPipelineWorker(registry_);
    rpc::testing::startProcessAgentPair(0, agent0_, 1, agent1_, 3, port, kSecret, registry_);
  }
  void TearDown() override {
    if (child_ > 0) {
      kill(child_, SIGKILL);
      int status = 0;
      waitpid(child_, &status, 0);
    }
    if (agent0_) agent0_->shutdown(false);
    if (agent1_) agent1_->shutdown(false);
    agent0_.reset();
    agent1_.reset();
    store_.reset();
  }

  static constexpr const char* kSecret = "pipeline-death";
  pid_t child_ = -1;
  std::unique_ptr<rpc::StoreServer> store_;
  rpc::Registry registry_;
  std::unique_ptr<rpc::Agent> agent0_;
  std::unique_ptr<rpc::Agent> agent1_;
};

TEST_F(StageWorkerDeathTest, KilledStageWorkerFailsTheStepNamingItWithinTheHeartbeatBound) {
  const ModelSpec model = mlpSpec();
  for (Schedule schedule : {Schedule::kGPipe, Schedule::k1F1B}) {
    SCOPED_TRACE(scheduleName(schedule));
    auto pipe = std::make_unique<RpcPipeline>(
        *agent0_, twoStages(model, 2),
        PipelineOptions{.microBatches = 4, .schedule = schedule, .optimizer = OptimizerSpec::sgd({})});
    (void)pipe->step(images(8, model, 1), classes(8, 5, 2));
    if (schedule == Schedule::kGPipe) continue;  // the worker dies once, under the second schedule's step
    ASSERT_EQ(kill(child_, SIGKILL), 0);
    const auto begin = rpc::testing::SteadyTime::now();
    try {
      (void)pipe->step(images(8, model, 3), classes(8, 5, 4));
      ADD_FAILURE() << "expected an RpcError";
    } catch (const rpc::RpcError& e) {
      EXPECT_NE(std::string(e.what()).find("worker2"), std::string::npos) << e.what();
    }
    // The connection closes at once; the heartbeat bound (1 s) plus slack covers a slow notice.
    EXPECT_LT(rpc::testing::SteadyTime::now() - begin, 5s);
    pipe.reset();
    EXPECT_TRUE(eventually([&] { return liveContexts(*agent0_) == 0 && liveContexts(*agent1_) == 0; }))
        << liveContexts(*agent0_) << " " << liveContexts(*agent1_);
  }
}

// One executor thread per worker (DISTGRAD_EXECUTOR_THREADS=1): a stage's backwards, blocked for its compute
// token, must never wait for a forward that has no thread left to run it (Note [Starved reservation] in
// models/pipeline/compute_token.h; rpc_pipeline deadlocked this way under 1F1B). Both schedules train
// several steps, with more micro-batches than stages, to the local pipeline's losses.
class RpcPipelineOneThreadTest : public RpcPipelineTest {
 protected:
  RpcPipelineOneThreadTest() { executorThreads_ = 1; }
};

TEST_P(RpcPipelineOneThreadTest, BothSchedulesTrainLikeTheLocalPipeline) {
  const ModelSpec model = mlpSpec();
  for (const Schedule schedule : {Schedule::k1F1B, Schedule::kGPipe}) {
    SCOPED_TRACE(scheduleName(schedule));
    const PipelineOptions options{.microBatches = 8, .schedule = schedule, .optimizer = OptimizerSpec::sgd({})};
    const std::vector<StageSpec> specs = stageSpecs(model, uniformPartition(numUnits(model), 2));
    RpcPipeline rpcPipe(agent(0), {{"worker1", specs[0]}, {"worker2", specs[1]}}, options);
    LocalPipeline localPipe({buildStage(specs[0]), buildStage(specs[1])}, options);
    for (int step = 0; step < 6; ++step) {
      const Tensor x = images(32, model, 500 + step);
      const Tensor y = classes(32, 5, 600 + step);
      EXPECT_NEAR(rpcPipe.step(x, y).loss, localPipe.step(x, y).loss, 1e-6) << "step " << step;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, RpcPipelineOneThreadTest,
                         ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

// ---------------------------------------------------------------- tracing

class RpcPipelineTraceTest : public RpcPipelineTest {
 protected:
  RpcPipelineTraceTest() { traceDir_ = dir_.path(); }
  // Trains `steps` steps of the two-stage MLP pipeline (batches of `batch`, data from `seed` on), then
  // flushes the trace; returns the last stage's trace file.
  trace::testing::TraceFile trainAndReadLastStage(Schedule schedule, int64_t microBatches, int64_t steps,
                                                  int64_t batch, uint64_t seed) {
    const ModelSpec model = mlpSpec();
    {
      RpcPipeline pipe(agent(0), twoStages(model, 2),
                       {.microBatches = microBatches, .schedule = schedule, .optimizer = OptimizerSpec::sgd({})});
      for (int64_t k = 0; k < steps; ++k) {
        (void)pipe.step(images(batch, model, seed + k), classes(batch, 5, seed + 10 + k));
      }
    }
    EXPECT_GT(trace::flush(), 0u);
    return trace::testing::readTrace(dir_.path() + "/worker2.trace.jsonl");
  }
  trace::testing::TempDir dir_;
};

// Traced (docs/tracing.md, "Pipeline events"): the driver's file holds one pipeline.step per step (its
// thread is no agent's, and another worker of this process may be the first traced one); each stage
// worker's file holds exactly one pipeline.forward and one pipeline.backward span per micro-batch and step of
// its own stage (the backward's two ends on one thread), and nothing of another stage. predict() records
// no stage events.
TEST_P(RpcPipelineTraceTest, StepsRecordEveryStageAndMicroBatchInTheirWorkersFiles) {
  ASSERT_TRUE(trace::enabled());
  const ModelSpec model = mlpSpec();
  constexpr int64_t kMicro = 3;
  constexpr int64_t kSteps = 2;
  {
    RpcPipeline pipe(agent(0), twoStages(model, 2),
                     {.microBatches = kMicro, .schedule = Schedule::k1F1B, .optimizer = OptimizerSpec::sgd({})});
    for (int64_t k = 0; k < kSteps; ++k) (void)pipe.step(images(9, model, 30 + k), classes(9, 5, 40 + k));
    (void)pipe.predict(images(4, model, 50));
  }
  ASSERT_GT(trace::flush(), 0u);
  using trace::testing::named;
  const auto driver = trace::testing::readTrace(dir_.path() + "/worker0.trace.jsonl");
  (void)tracecheck::expectStepEvents(driver, kMicro, 2, kSteps, "1f1b");
  EXPECT_TRUE(named(driver, "pipeline.forward").empty());
  EXPECT_TRUE(named(driver, "pipeline.backward").empty());
  for (int64_t stage = 0; stage < 2; ++stage) {
    const std::string worker = "worker" + std::to_string(stage + 1);
    SCOPED_TRACE(worker);
    const auto file = trace::testing::readTrace(dir_.path() + "/" + worker + ".trace.jsonl");
    tracecheck::expectStageEvents(file, stage, stage + 1, kMicro, kSteps, "rpc");
    EXPECT_TRUE(named(file, "pipeline.step").empty());
  }
}

// Note [Loss on the last stage]: under GPipe the last stage drains one micro-batch at a time, in
// micro-batch order, starting each backward when the previous one has left the stage. Observed in the last
// stage's trace: every node the distributed engine ran there for a micro-batch's backward (autograd spans,
// a0 its context) began after the last node of the previous micro-batch's had ended (started all at once,
// the passes' first nodes overlap: each blocks there for the compute token), and the stage's
// pipeline.backward spans follow micro-batch order.
TEST_P(RpcPipelineTraceTest, GPipeDrainsTheLastStageOneMicroBatchAtATimeInOrder) {
  ASSERT_TRUE(trace::enabled());
  constexpr int64_t kMicro = 4;
  constexpr int64_t kSteps = 3;
  const auto file = trainAndReadLastStage(Schedule::kGPipe, kMicro, kSteps, 8, 60);
  // The engine's node spans on the last stage, by context: [first begin, last end].
  std::map<int64_t, std::pair<int64_t, int64_t>> byContext;
  for (const auto& e : file.events) {
    if (e.string("cat") != "autograd" || e.string("type") != "span") continue;
    const int64_t context = e.integer("a0").value_or(-1);
    const int64_t begin = e.integer("b").value_or(-1);
    const int64_t end = e.integer("e").value_or(-1);
    auto [it, fresh] = byContext.try_emplace(context, begin, end);
    if (!fresh) {
      it->second.first = std::min(it->second.first, begin);
      it->second.second = std::max(it->second.second, end);
    }
  }
  ASSERT_EQ(static_cast<int64_t>(byContext.size()), kMicro * kSteps);
  // The driver creates the contexts in micro-batch order, step after step: their ids ascend likewise.
  int64_t index = 0;
  int64_t previousEnd = 0;
  for (const auto& [context, span] : byContext) {
    if (index > 0) {
      EXPECT_GE(span.first, previousEnd) << "the backward of micro-batch " << index % kMicro << " of step "
                                         << index / kMicro
                                         << " began on the last stage before the previous one had left it";
    }
    previousEnd = span.second;
    ++index;
  }
  const auto backwards = tracecheck::pipelineEvents(file, "pipeline.backward", "rpc");
  ASSERT_EQ(static_cast<int64_t>(backwards.size()), kMicro * kSteps);
  for (int64_t k = 0; k < kSteps; ++k) {
    for (int64_t m = 1; m < kMicro; ++m) {
      const auto* before = backwards.at(tracecheck::Key{1, m - 1, k});
      const auto* after = backwards.at(tracecheck::Key{1, m, k});
      EXPECT_GE(after->integer("b").value_or(-1), before->integer("e").value_or(0))
          << "step " << k << ": micro-batch " << m << "'s backward began before " << m - 1 << "'s ended";
    }
  }
}

// Note [Stage backward bracket]: a stage whose input came from another worker ends its backward once the
// input's gradient was handed to the agent (the RecvBackward's post-hook), so nothing else of the stage
// computes before the gradient left. Observed on the last stage: each pipeline.backward span ends after
// the autograd.send_gradients instant of its micro-batch's context, on the same thread.
TEST_P(RpcPipelineTraceTest, AStageBackwardEndsOnceItsInputGradientLeft) {
  ASSERT_TRUE(trace::enabled());
  constexpr int64_t kMicro = 3;
  constexpr int64_t kSteps = 2;
  const auto file = trainAndReadLastStage(Schedule::k1F1B, kMicro, kSteps, 9, 80);
  // One gradient leaves the last stage per micro-batch (its input's); by context id, which the driver
  // creates in micro-batch order, step after step.
  std::map<int64_t, const tools::FlatObject*> sends;
  for (const tools::FlatObject* e : trace::testing::named(file, "autograd.send_gradients")) {
    EXPECT_TRUE(sends.emplace(e->integer("a0").value_or(-1), e).second) << "two sends for one context";
  }
  ASSERT_EQ(static_cast<int64_t>(sends.size()), kMicro * kSteps);
  const auto backwards = tracecheck::pipelineEvents(file, "pipeline.backward", "rpc");
  ASSERT_EQ(static_cast<int64_t>(backwards.size()), kMicro * kSteps);
  auto send = sends.begin();
  for (int64_t k = 0; k < kSteps; ++k) {
    for (int64_t m = 0; m < kMicro; ++m, ++send) {
      const auto* backward = backwards.at(tracecheck::Key{1, m, k});
      EXPECT_GE(backward->integer("e").value_or(-1), send->second->integer("b").value_or(0))
          << "step " << k << ": micro-batch " << m << "'s backward ended before its input gradient left";
      EXPECT_EQ(backward->integer("tid"), send->second->integer("tid")) << "step " << k << ", micro-batch " << m;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, RpcPipelineTraceTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::models::pipeline
