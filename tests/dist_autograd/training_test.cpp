// Distributed training ends where single-process training ends (float64, over inproc and tcp): models
// trained with forward inside a DistContext, ctx.backward and DistributedOptimizer::step, and the same
// models trained in this process on twin parameters (same initial values, same data) with the local
// optimizer of the same spec. Every step's loss and, after 20 steps, every parameter agree to 1e-9, for
// SGD with momentum and for Adam:
//   - a small CNN whose conv stage (conv2d + relu + max pool + flatten) is a RemoteModule on worker1, with a
//     linear head on worker0;
//   - the same CNN split in three: conv on worker1, a hidden layer on worker2 that fetches the conv output
//     straight from worker1 (an RRef, never through worker0), head on worker0;
//   - an MLP whose forward bounces worker0 -> worker1 -> worker0 -> worker1 -> worker0 (worker0's handler
//     runs on worker0's own parameters in the middle of worker1's stage), every parameter an RRef (worker0's
//     own ones owned by worker0, stepped in-process).
// And two trainers (worker0 and worker2, a thread each, a context per step, their own data, heads and
// DistributedOptimizers) training concurrently against one RemoteModule on worker1 for 30 steps: both
// losses fall below half their initial value, and every context's gradients (on worker1 and on the trainer)
// equal a local backward of that trainer's batch through a copy of the parameters its forward saw.
#include <gtest/gtest.h>

#include <functional>
#include <latch>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "dist_autograd_test_util.h"
#include "models/optim/distributed_optimizer.h"
#include "rref/remote_module.h"
#include "tests/transport_params.h"

namespace distgrad::autograd::distributed::e2e {
namespace {

using models::optim::DistributedOptimizer;
using models::optim::LocalOptimizer;
using models::optim::OptimizerSpec;
using rref::RemoteModule;
using rref::RRef;

// Parameters after 20 distributed steps equal the single-process ones to this.
constexpr double kTrainTolerance = 1e-9;
constexpr int kSteps = 20;

// Keeps the MlpStage module handle it receives on the callee (how a second trainer gets its own handle).
inline const rpc::Function<bool(RemoteModule<MlpStage>)> kAdoptMlp{"training_test.adopt_mlp"};


double maxAbsDiff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.toVector<double>();
  const std::vector<double> y = b.toVector<double>();
  double out = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) out = std::max(out, std::abs(x[i] - y[i]));
  return out;
}

// A data batch of step `step` (no gradient: data, not parameters).
Tensor cnnInput(int step) { return input({6, 2, 6, 6}, 7000 + static_cast<uint64_t>(step), /*requiresGrad=*/false); }
Tensor cnnLabels(int step) { return labels(6, 3, 8000 + static_cast<uint64_t>(step)); }
Tensor mlpInput(int step) { return input({8, 5}, 9000 + static_cast<uint64_t>(step), /*requiresGrad=*/false); }
Tensor mlpLabels(int step) { return labels(8, 3, 10000 + static_cast<uint64_t>(step)); }

// One model trained twice. Distributed: `remoteParams` (RRefs, on any owner, this worker included) and
// `localParams` (this worker's plain tensors) stepped by a DistributedOptimizer on `distributedLoss`'s
// gradients. In this process: `referenceParams` (twins, in the order remoteParams then localParams)
// stepped by a local optimizer on `referenceLoss`'s.
struct TrainedModel {
  std::vector<RRef<Tensor>> remoteParams;
  std::vector<Tensor> localParams;
  std::vector<std::string> names;              // of every parameter, in the reference order (for messages)
  std::function<Tensor(int)> distributedLoss;  // runs inside the step's DistContext, on worker0's thread
  std::vector<Tensor> referenceParams;
  std::function<Tensor(int)> referenceLoss;
};

class DistributedTrainingTest : public DistAutogradFixture {
 protected:
  void bindExtra(rpc::Registry& reg) override {
    DistributedOptimizer::install(reg);
    reg.bind(kAdoptMlp, [this](RemoteModule<MlpStage> module) {
      std::lock_guard<std::mutex> lock(adoptedMutex_);
      adopted_ = std::move(module);
      return true;
    });
  }

  void TearDown() override {
    takeAdopted();
    DistAutogradFixture::TearDown();
    // Every LocalOptimizer, context and RRef released on every worker.
    for (auto& a : cluster_.agents) {
      EXPECT_TRUE(eventually([&] { return LocalOptimizer::liveCount(*a) == 0; })) << a->name();
    }
    EXPECT_TRUE(allReleased()) << liveCounts();
    EXPECT_TRUE(rrefsSettled()) << rrefTables();
  }

  RemoteModule<MlpStage> takeAdopted() {
    std::lock_guard<std::mutex> lock(adoptedMutex_);
    return std::exchange(adopted_, RemoteModule<MlpStage>());
  }

  // Trains `m` for kSteps steps both ways; every step's loss and the final parameters must agree.
  void trainAndCompare(TrainedModel& m, const OptimizerSpec& spec, BackwardMode mode) {
    SCOPED_TRACE(spec.describe() + ", " + backwardModeName(mode));
    ASSERT_EQ(m.names.size(), m.referenceParams.size());
    ASSERT_EQ(m.remoteParams.size() + m.localParams.size(), m.referenceParams.size());
    const std::vector<Tensor> initial = copies(m.referenceParams);
    {
      // The distributed parameters start where their twins do.
      const std::vector<Tensor> start = current(m);
      for (size_t i = 0; i < start.size(); ++i) ASSERT_EQ(maxAbsDiff(start[i], initial[i]), 0.0) << m.names[i];
    }

    DistributedOptimizer opt(agent(0), spec, m.remoteParams, m.localParams);
    EXPECT_EQ(opt.numParameters(), m.referenceParams.size());
    std::unique_ptr<models::optim::Optimizer> reference = spec.make(m.referenceParams);
    BackwardOptions options;
    options.mode = mode;
    for (int step = 0; step < kSteps; ++step) {
      Tensor loss;
      {
        DistContext ctx(agent(0));
        loss = m.distributedLoss(step);
        ctx.backward(loss, options);
        opt.step(ctx);
      }
      reference->zeroGrad();
      const Tensor referenceLoss = m.referenceLoss(step);
      distgrad::backward(referenceLoss);
      reference->step();
      ASSERT_TRUE(allClose(loss, referenceLoss, kTrainTolerance)) << "loss of step " << step;
    }

    const std::vector<Tensor> trained = current(m);
    for (size_t i = 0; i < trained.size(); ++i) {
      EXPECT_TRUE(allClose(trained[i], m.referenceParams[i], kTrainTolerance)) << m.names[i];
      // Training moved every parameter (equal but untouched parameters would pass the comparison too).
      EXPECT_GT(maxAbsDiff(m.referenceParams[i], initial[i]), 1e-3) << m.names[i];
    }
  }

  // Copies of the distributed parameters' values, in the reference order.
  static std::vector<Tensor> current(const TrainedModel& m) {
    std::vector<Tensor> out = fetch(m.remoteParams);
    for (const Tensor& t : copies(m.localParams)) out.push_back(t);
    return out;
  }

  // The CNN: conv stage a RemoteModule on worker1; with `threeWorkers`, worker2's cnn_hidden layer on the
  // conv output (fetched by worker2 from worker1) and worker0's head, else worker0's cnn_head on it.
  TrainedModel cnnModel(bool threeWorkers) {
    constexpr uint64_t kSeed = 41;
    const std::string headKey = threeWorkers ? "head" : "cnn_head";
    auto conv = RemoteModule<ConvStage>::create(agent(0), name(1), kSeed);
    auto ref = std::make_shared<Reference>();
    auto refConv = std::make_shared<ConvStage>(kSeed);

    TrainedModel m;
    m.remoteParams = conv.remoteParameters();
    m.names = {"worker1 conv.weight", "worker1 conv.bias"};
    m.referenceParams = refConv->parameters();
    if (threeWorkers) {
      for (const auto& p : agent(0).rpcSync(name(2), kLayerParameters, std::string("cnn_hidden"))) {
        m.remoteParams.push_back(p);
      }
      const Layer& hidden = ref->layer("worker2", "cnn_hidden");
      m.names.insert(m.names.end(), {"worker2 cnn_hidden.weight", "worker2 cnn_hidden.bias"});
      m.referenceParams.insert(m.referenceParams.end(), {hidden.weight, hidden.bias});
    }
    const Layer head = layer("worker0", headKey);
    const Layer refHead = ref->layer("worker0", headKey);
    m.localParams = {head.weight, head.bias};
    m.names.insert(m.names.end(), {"worker0 " + headKey + ".weight", "worker0 " + headKey + ".bias"});
    m.referenceParams.insert(m.referenceParams.end(), {refHead.weight, refHead.bias});

    m.distributedLoss = [this, conv, head, threeWorkers](int step) {
      Tensor features;
      if (threeWorkers) {
        // The conv output stays on worker1; worker2 fetches it from there inside the context.
        RRef<Tensor> convOut = conv.forwardRemote(cnnInput(step));
        features = agent(0).rpcSync(name(2), kConsumeRef, std::string("cnn_hidden"), convOut);
      } else {
        features = conv.forward(cnnInput(step));
      }
      return headLoss(features, head, cnnLabels(step));
    };
    m.referenceLoss = [ref, refConv, refHead, threeWorkers](int step) {
      Tensor features = refConv->forward(cnnInput(step));
      if (threeWorkers) features = applyLayer(features, ref->layer("worker2", "cnn_hidden"));
      return headLoss(features, refHead, cnnLabels(step));
    };
    return m;
  }

  // worker0 -> worker1 (l1) -> worker0 (l2, in worker0's handler on worker0's parameters) -> worker1 (l3)
  // -> worker0 (head, loss). Every parameter is an RRef: worker1's from worker1, worker0's owned by worker0.
  TrainedModel bounceModel() {
    auto ref = std::make_shared<Reference>();
    TrainedModel m;
    for (const std::string key : {"l1", "l3"}) {
      for (const auto& p : agent(0).rpcSync(name(1), kLayerParameters, key)) m.remoteParams.push_back(p);
      const Layer& twinLayer = ref->layer("worker1", key);
      m.referenceParams.insert(m.referenceParams.end(), {twinLayer.weight, twinLayer.bias});
      m.names.insert(m.names.end(), {"worker1 " + key + ".weight", "worker1 " + key + ".bias"});
    }
    for (const std::string key : {"l2", "head"}) {
      const Layer& own = layer("worker0", key);
      m.remoteParams.push_back(rrefs(0)->own<Tensor>(own.weight));
      m.remoteParams.push_back(rrefs(0)->own<Tensor>(own.bias));
      const Layer& twinLayer = ref->layer("worker0", key);
      m.referenceParams.insert(m.referenceParams.end(), {twinLayer.weight, twinLayer.bias});
      m.names.insert(m.names.end(), {"worker0 " + key + ".weight", "worker0 " + key + ".bias"});
    }
    m.distributedLoss = [this](int step) {
      Tensor h = agent(0).rpcSync(name(1), kChain, std::string("l1"), name(0), std::string("l2"),
                                  static_cast<int64_t>(Behavior::kPlain), std::string("l3"), mlpInput(step));
      return headLoss(h, layer("worker0", "head"), mlpLabels(step));
    };
    m.referenceLoss = [ref](int step) {
      Tensor h = applyLayer(mlpInput(step), ref->layer("worker1", "l1"));
      h = applyLayer(applyLayer(h, ref->layer("worker0", "l2")), ref->layer("worker1", "l3"));
      return headLoss(h, ref->layer("worker0", "head"), mlpLabels(step));
    };
    return m;
  }

  std::mutex adoptedMutex_;
  RemoteModule<MlpStage> adopted_;  // GUARDED_BY(adoptedMutex_)
};

const OptimizerSpec& sgdMomentum() {
  static const OptimizerSpec spec = OptimizerSpec::sgd({.learningRate = 0.1, .momentum = 0.9, .weightDecay = 1e-3});
  return spec;
}
const OptimizerSpec& adam() {
  static const OptimizerSpec spec = OptimizerSpec::adam({.learningRate = 0.01, .weightDecay = 1e-3});
  return spec;
}

TEST_P(DistributedTrainingTest, CnnOnTwoWorkersSgdMomentumMatchesSingleProcess) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  TrainedModel m = cnnModel(/*threeWorkers=*/false);
  trainAndCompare(m, sgdMomentum(), BackwardMode::kExact);
}

TEST_P(DistributedTrainingTest, CnnOnTwoWorkersAdamMatchesSingleProcess) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  TrainedModel m = cnnModel(/*threeWorkers=*/false);
  trainAndCompare(m, adam(), BackwardMode::kFast);
}

TEST_P(DistributedTrainingTest, CnnOnThreeWorkersSgdMomentumMatchesSingleProcess) {
  ASSERT_NO_FATAL_FAILURE(start(3));
  TrainedModel m = cnnModel(/*threeWorkers=*/true);
  trainAndCompare(m, sgdMomentum(), BackwardMode::kFast);
}

TEST_P(DistributedTrainingTest, CnnOnThreeWorkersAdamMatchesSingleProcess) {
  ASSERT_NO_FATAL_FAILURE(start(3));
  TrainedModel m = cnnModel(/*threeWorkers=*/true);
  trainAndCompare(m, adam(), BackwardMode::kExact);
}

TEST_P(DistributedTrainingTest, BranchThatBouncesBackSgdMomentumMatchesSingleProcess) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  TrainedModel m = bounceModel();
  trainAndCompare(m, sgdMomentum(), BackwardMode::kExact);
}

TEST_P(DistributedTrainingTest, BranchThatBouncesBackAdamMatchesSingleProcess) {
  ASSERT_NO_FATAL_FAILURE(start(2));
  TrainedModel m = bounceModel();
  trainAndCompare(m, adam(), BackwardMode::kFast);
}

// ---------------------------------------------------------------- two concurrent trainers

// Labels of a teacher: argmax of x times a fixed random [5, 3] matrix (a learnable task).
Tensor teacherLabels(const Tensor& x, uint64_t seed) {
  tensor::Generator gen(seed);
  return argmax(matmul(x, tensor::uniform({5, 3}, -1.0, 1.0, gen, DType::kFloat64)), 1);
}

// One trainer: its handle to the shared trunk (an MlpStage on worker1), its own head (its worker's "head"
// layer: local parameters), data and optimizer, and what it observed.
struct Trainer {
  int rank = 0;
  RemoteModule<MlpStage> trunk;
  std::vector<RRef<Tensor>> trunkParams;  // RRefs through this trainer's handle
  Layer head;
  Tensor x, y;
  std::unique_ptr<DistributedOptimizer> opt;
  std::vector<double> losses;  // the loss of every step
  std::string failure;         // an exception that ended the trainer's loop
};

TEST_P(DistributedTrainingTest, TwoTrainersConcurrentlyAgainstOneSharedOwner) {
  ASSERT_NO_FATAL_FAILURE(start(3));
  constexpr uint64_t kSeed = 51;
  constexpr int kConcurrentSteps = 30;
  // The trunk lives on worker1, created by worker2, whose handle worker0 adopts.
  auto fromWorker2 = RemoteModule<MlpStage>::create(agent(2), name(1), kSeed);
  ASSERT_TRUE(agent(2).rpcSync(name(0), kAdoptMlp, fromWorker2));
  RemoteModule<MlpStage> fromWorker0 = takeAdopted();
  ASSERT_TRUE(fromWorker0.valid());

  Trainer trainers[2];
  for (int t = 0; t < 2; ++t) {
    Trainer& tr = trainers[t];
    tr.rank = t == 0 ? 0 : 2;
    tr.trunk = t == 0 ? fromWorker0 : fromWorker2;
    tr.trunkParams = tr.trunk.remoteParameters();
    tr.head = layer(name(tr.rank), "head");
    // Its own samples of one task (the trainers help each other through the shared trunk). With these
    // settings the final loss is 0.04-0.16 of the initial one whatever the interleaving (1200 runs, 3 in
    // parallel), against the 0.5 asserted below.
    tr.x = input({32, 5}, 12000 + static_cast<uint64_t>(t), /*requiresGrad=*/false);
    tr.y = teacherLabels(tr.x, 13000);
    tr.opt = std::make_unique<DistributedOptimizer>(agent(tr.rank),
                                                    OptimizerSpec::sgd({.learningRate = 0.3, .momentum = 0.5}),
                                                    tr.trunkParams, std::vector<Tensor>{tr.head.weight, tr.head.bias});
  }
  // Both optimizers have a part on the shared owner.
  EXPECT_EQ(LocalOptimizer::liveCount(agent(1)), 2u);
  // The trunk's parameters at their owner (where each context's gradients of them are kept).
  const std::vector<Tensor> ownerParams = world_.module(kSeed)->parameters();
  ASSERT_EQ(ownerParams.size(), 4u);

  // Forward and backward passes of both trainers run concurrently (shared), steps exclusively: no pass
  // reads parameters while a step writes them (no data race), so each context's gradients are those of the
  // values its trainer copied before its forward. (Steps of both trainers on one owner at once are the
  // DistributedOptimizer tests' subject.)
  std::shared_mutex phase;
  // Both trainers' first forward passes finish before either first backward starts: two live contexts on
  // worker1, two backward passes through it at once.
  std::latch firstBackward(2);
  auto train = [&](Trainer& tr) {
    bool arrived = false;
    try {
      MlpStage twinTrunk(kSeed);  // the local reference (its values are overwritten every step)
      for (int step = 0; step < kConcurrentSteps; ++step) {
        std::shared_lock<std::shared_mutex> compute(phase);
        const std::vector<Tensor> seen = fetch(tr.trunkParams);  // outside the context
        DistContext ctx(agent(tr.rank));
        Tensor loss = headLoss(tr.trunk.forward(tr.x), tr.head, tr.y);
        if (step == 0) {
          arrived = true;
          firstBackward.arrive_and_wait();
          EXPECT_EQ(liveContexts(agent(1)), 2u) << "both first contexts live on the shared owner";
        }
        ctx.backward(loss);

        // The same batch through a copy of what this forward saw, in this process.
        std::vector<Tensor> twinParams = twinTrunk.parameters();
        for (size_t i = 0; i < twinParams.size(); ++i) twinParams[i].copyFrom(seen[i]);
        const Layer twinHead{twin(tr.head.weight), twin(tr.head.bias)};
        const Tensor lossR = headLoss(twinTrunk.forward(tr.x), twinHead, tr.y);
        const std::vector<Tensor> g = Reference::gradients(
            lossR, {twinParams[0], twinParams[1], twinParams[2], twinParams[3], twinHead.weight, twinHead.bias});
        EXPECT_TRUE(allClose(loss, lossR, 1e-12)) << name(tr.rank) << " step " << step << " loss";
        const Gradients atOwner = gradientsOf(agent(1), ctx.id());
        EXPECT_EQ(atOwner.size(), 4u) << name(tr.rank) << " step " << step << ": only this context's trunk gradients";
        for (size_t i = 0; i < 4; ++i) {
          EXPECT_TRUE(allClose(atOwner.get(ownerParams[i]), g[i]))
              << name(tr.rank) << " step " << step << " trunk parameter " << i;
        }
        const Gradients here = ctx.gradients();
        EXPECT_EQ(here.size(), 2u) << name(tr.rank) << " step " << step;
        EXPECT_TRUE(allClose(here.get(tr.head.weight), g[4])) << name(tr.rank) << " step " << step << " head.weight";
        EXPECT_TRUE(allClose(here.get(tr.head.bias), g[5])) << name(tr.rank) << " step " << step << " head.bias";
        compute.unlock();

        std::unique_lock<std::shared_mutex> stepping(phase);
        tr.opt->step(ctx);
        tr.losses.push_back(loss.item());
      }
    } catch (const std::exception& e) {
      tr.failure = e.what();
      if (!arrived) firstBackward.count_down();
    }
  };
  std::thread other([&] { train(trainers[1]); });
  train(trainers[0]);
  other.join();

  for (Trainer& tr : trainers) {
    SCOPED_TRACE(name(tr.rank));
    EXPECT_EQ(tr.failure, "");
    ASSERT_EQ(tr.losses.size(), static_cast<size_t>(kConcurrentSteps));
    // The loss on the trainer's data with the trained parameters (outside any context).
    const double finalLoss = headLoss(tr.trunk.forward(tr.x), tr.head, tr.y).item();
    EXPECT_LT(finalLoss, 0.5 * tr.losses.front()) << "initial loss " << tr.losses.front();
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, DistributedTrainingTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace distgrad::autograd::distributed::e2e
