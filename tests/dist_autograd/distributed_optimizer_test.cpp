// DistributedOptimizer over inproc and tcp, three workers: a model split across worker0 (a local stage),
// worker1 and worker2 (RemoteModules), trained with forward inside a DistContext, ctx.backward and
// opt.step(ctx), ends with the parameters single-process training of the same model on the same data gives
// (float64, 20 SGD-momentum steps and 20 Adam steps, 1e-9). Also: one LocalOptimizer per owner and one
// call per owner per step; local parameters and RRefs this worker owns stepped in-process; a parameter
// without a gradient left alone; two contexts (one optimizer, and two optimizers) stepping concurrently on
// a shared owner end where the sequential steps end (no torn updates); errors name the failing owner;
// bad specs are refused on the caller and on the owner; everything is released afterwards.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "dist_autograd_test_util.h"
#include "models/nn/linear.h"
#include "models/optim/adam.h"
#include "models/optim/distributed_optimizer.h"
#include "models/optim/sgd.h"
#include "rref/remote_module.h"
#include "rref/rref_test_util.h"
#include "tensor/random.h"
#include "tests/transport_params.h"

namespace distgrad::models::optim::testing {
namespace {

// One stage of the split model: Linear (float64), optionally followed by ReLU. A type of this test only, so
// its rpc::Class (and DG_REMOTE_MODULE) cannot collide with another test file's declarations.
class Stage : public Module {
 public:
  Stage(int64_t in, int64_t out, uint64_t seed, bool relu) : Module("Stage"), relu_(relu) {
    tensor::Generator gen(seed);
    linear_ = registerModule("linear", std::make_shared<Linear>(in, out, gen));
    toDType(DType::kFloat64);
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = linear_->forward(x);
    return relu_ ? relu(y) : y;
  }

 private:
  bool relu_;
  std::shared_ptr<Linear> linear_;
};

const rpc::Class<Stage>& stageClass() {
  static const rpc::Class<Stage> cls = rref::moduleClass<Stage>("dopt_test.Stage");
  return cls;
}

}  // namespace
}  // namespace distgrad::models::optim::testing

DG_REMOTE_MODULE(distgrad::models::optim::testing::Stage, distgrad::models::optim::testing::stageClass());

namespace distgrad::models::optim::testing {
namespace {

using autograd::distributed::BackwardMode;
using autograd::distributed::BackwardOptions;
using autograd::distributed::DistContext;
using autograd::distributed::e2e::copies;
using autograd::distributed::e2e::fetch;
using rref::RemoteModule;
using rref::RRef;

// A tensor made on the worker it is called on, kept there as an RRef (parameters the optimizer refuses).
inline const rpc::Function<Tensor(int64_t)> kMakeTensor{"dopt_test.make_tensor"};
constexpr int64_t kNonLeaf = 0;
constexpr int64_t kInt64 = 1;
constexpr int64_t kFloat64Leaf = 2;
// Keeps the module it receives on the callee (how a second trainer gets its own handle to a module).
inline const rpc::Function<bool(RemoteModule<Stage>)> kAdopt{"dopt_test.adopt"};

Tensor data(const Shape& shape, uint64_t seed) {
  tensor::Generator gen(seed);
  return tensor::uniform(shape, -1.0, 1.0, gen, DType::kFloat64);
}

double maxAbsDiff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  const auto x = a.toVector<double>();
  const auto y = b.toVector<double>();
  double out = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) out = std::max(out, std::abs(x[i] - y[i]));
  return out;
}


std::vector<Tensor> concat(std::vector<Tensor> a, const std::vector<Tensor>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct SplitModel;

class DistributedOptimizerTest : public rref::testing::RRefFixture {
 protected:
  // Three workers with `executorThreads` each (RRefFixture::start, with the thread count).
  void start(int executorThreads = 4) {
    rpc::testing::ClusterSpec spec;
    spec.transport = GetParam();
    spec.size = 3;
    spec.executorThreads = executorThreads;
    registry_ = rref::testing::makeRegistry(world_);
    bindExtra(registry_);
    rpc::testing::startCluster(cluster_, spec, rpcWorld_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) ASSERT_FALSE(cluster_.errors[i]) << "rank " << i;
    std::lock_guard<std::mutex> lock(world_.mutex);
    for (auto& agent : cluster_.agents) world_.agents[agent->name()] = agent.get();
  }

  void bindExtra(rpc::Registry& reg) override {
    autograd::distributed::install(reg);
    DistributedOptimizer::install(reg);
    rref::bindRemoteModule(reg, stageClass())
        .factory<int64_t, int64_t, uint64_t, bool>([](int64_t in, int64_t out, uint64_t seed, bool relu) {
          return std::make_shared<Stage>(in, out, seed, relu);
        });
    reg.bind(kMakeTensor, [](int64_t which) {
      if (which == kInt64) return Tensor::zeros({3}, DType::kInt64);
      if (which == kFloat64Leaf) return Tensor::ones({3}, DType::kFloat64).setRequiresGrad(true);
      Tensor leaf = Tensor::ones({3}, DType::kFloat64);
      leaf.setRequiresGrad(true);
      return leaf * 2.0;  // produced by an op: not a leaf
    });
    reg.bind(kAdopt, [this](RemoteModule<Stage> module) {
      std::lock_guard<std::mutex> lock(adoptedMutex_);
      adopted_ = std::move(module);
      return true;
    });
  }

  RemoteModule<Stage> takeAdopted() {
    std::lock_guard<std::mutex> lock(adoptedMutex_);
    return std::exchange(adopted_, RemoteModule<Stage>());
  }

  void TearDown() override {
    takeAdopted();
    // Every LocalOptimizer released, every context and reference table settled.
    for (auto& a : cluster_.agents) {
      EXPECT_TRUE(rpc::testing::eventually([&] { return LocalOptimizer::liveCount(*a) == 0; })) << a->name();
      EXPECT_TRUE(rpc::testing::eventually([&] { return autograd::distributed::liveContexts(*a) == 0; }))
          << a->name();
    }
    EXPECT_TRUE(allSettled()) << tables();
    RRefFixture::TearDown();
  }

  RemoteModule<Stage> stage(int owner, int64_t in, int64_t out, uint64_t seed, bool relu) {
    return RemoteModule<Stage>::create(rrefs(0), name(owner), in, out, seed, relu);
  }
  SplitModel splitModel();

  std::mutex adoptedMutex_;
  RemoteModule<Stage> adopted_;  // GUARDED_BY(adoptedMutex_)
};

// The split model: a (local, worker0) 4 -> 8 ReLU, b (worker1) 8 -> 6 ReLU, c (worker2) 6 -> 3; and the same
// model in this process as the reference.
struct SplitModel {
  std::shared_ptr<Stage> a;
  RemoteModule<Stage> b, c;
  std::vector<RRef<Tensor>> bParams = b.remoteParameters(), cParams = c.remoteParameters();
  Stage refA{4, 8, 11, true}, refB{8, 6, 12, true}, refC{6, 3, 13, false};

  std::vector<RRef<Tensor>> remoteParams() const {
    std::vector<RRef<Tensor>> out = bParams;
    out.insert(out.end(), cParams.begin(), cParams.end());
    return out;
  }
  std::vector<Tensor> refParams() const {
    return concat(concat(refA.parameters(), refB.parameters()), refC.parameters());
  }
  static Tensor input(int step) { return data({5, 4}, 1000 + static_cast<uint64_t>(step)); }
  static Tensor target(int step) { return data({5, 3}, 2000 + static_cast<uint64_t>(step)); }

  Tensor distributedLoss(int step) { return mseLoss(c.forward(b.forward(a->forward(input(step)))), target(step)); }
  Tensor referenceLoss(int step) {
    return mseLoss(refC.forward(refB.forward(refA.forward(input(step)))), target(step));
  }
  // One step of `reference` on the summed losses of steps first .. first + count - 1 (micro-batches).
  void referenceStepOnSum(Optimizer& reference, int first, int count) {
    reference.zeroGrad();
    Tensor total = referenceLoss(first);
    for (int k = 1; k < count; ++k) total = total + referenceLoss(first + k);
    distgrad::backward(total);
    reference.step();
  }

  void expectMatchesReference(double tolerance, const std::string& what) {
    std::vector<Tensor> ref = refParams();
    std::vector<Tensor> got = concat(concat(a->parameters(), fetch(bParams)), fetch(cParams));
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LE(maxAbsDiff(got[i], ref[i]), tolerance) << what << ": parameter " << i;
      // Training moved the parameters (a vacuous comparison would pass too).
    }
  }
};

SplitModel DistributedOptimizerTest::splitModel() {
  return SplitModel{std::make_shared<Stage>(4, 8, 11, true), stage(1, 8, 6, 12, true), stage(2, 6, 3, 13, false)};
}

class TrainingTest : public DistributedOptimizerTest {
 protected:
  // Trains `steps` steps distributed and in one process with `spec`; the parameters must agree to 1e-9.
  void trainAndCompare(const OptimizerSpec& spec, BackwardMode mode, int steps) {
    SplitModel m = splitModel();
    const std::vector<Tensor> initial = copies(m.refParams());

    DistributedOptimizer opt(agent(0), spec, m.remoteParams(), m.a->parameters());
    EXPECT_EQ(opt.owners(), (std::vector<std::string>{name(1), name(2), name(0)}));
    EXPECT_EQ(opt.numParameters(), 6u);
    std::unique_ptr<Optimizer> reference = spec.make(m.refParams());

    BackwardOptions options;
    options.mode = mode;
    for (int step = 0; step < steps; ++step) {
      {
        DistContext ctx(agent(0));
        Tensor loss = m.distributedLoss(step);
        ctx.backward({loss}, options);
        opt.step(ctx);
      }
      reference->zeroGrad();
      distgrad::backward(m.referenceLoss(step));
      reference->step();
    }
    m.expectMatchesReference(1e-9, spec.describe());
    // The parameters moved (against the initial values).
    std::vector<Tensor> trained = m.refParams();
    for (size_t i = 0; i < trained.size(); ++i) EXPECT_GT(maxAbsDiff(trained[i], initial[i]), 1e-4) << i;
  }
};

TEST_P(TrainingTest, SgdMomentumMatchesSingleProcessTraining) {
  start();
  trainAndCompare(OptimizerSpec::sgd({.learningRate = 0.05, .momentum = 0.9, .weightDecay = 1e-3}),
                  BackwardMode::kExact, 20);
}

TEST_P(TrainingTest, NesterovSgdWithFastBackwardMatchesSingleProcessTraining) {
  start();
  trainAndCompare(OptimizerSpec::sgd({.learningRate = 0.05, .momentum = 0.8, .nesterov = true}), BackwardMode::kFast,
                  20);
}

TEST_P(TrainingTest, AdamMatchesSingleProcessTraining) {
  start();
  trainAndCompare(OptimizerSpec::adam({.learningRate = 0.01, .weightDecay = 1e-3}), BackwardMode::kExact, 20);
}

TEST_P(TrainingTest, AmsgradAdamWWithFastBackwardMatchesSingleProcessTraining) {
  start();
  trainAndCompare(OptimizerSpec::adamw({.learningRate = 0.01, .amsgrad = true}), BackwardMode::kFast, 20);
}

TEST_P(DistributedOptimizerTest, OneLocalOptimizerPerOwnerAndOneCallPerOwnerPerStep) {
  start();
  {
    // Two modules on worker1, one on worker2, and local parameters: three parts.
    auto b1 = stage(1, 4, 5, 21, true);
    auto b2 = stage(1, 5, 5, 22, true);
    auto c = stage(2, 5, 2, 23, false);
    Stage a(3, 4, 20, true);
    std::vector<RRef<Tensor>> params = b1.remoteParameters();
    for (auto& p : c.remoteParameters()) params.push_back(p);
    for (auto& p : b2.remoteParameters()) params.push_back(p);  // worker1 again, after worker2
    DistributedOptimizer opt(agent(0), OptimizerSpec::sgd({.learningRate = 0.1}), params, a.parameters());
    EXPECT_EQ(opt.owners(), (std::vector<std::string>{name(1), name(2), name(0)}));
    EXPECT_EQ(LocalOptimizer::liveCount(agent(0)), 1u);
    EXPECT_EQ(LocalOptimizer::liveCount(agent(1)), 1u);
    EXPECT_EQ(LocalOptimizer::liveCount(agent(2)), 1u);

    const std::vector<Tensor> before1 = fetch(b1.remoteParameters());
    const std::vector<Tensor> before2 = fetch(b2.remoteParameters());
    {
      DistContext ctx(agent(0));
      Tensor x = data({2, 3}, 5);
      Tensor loss = sum(c.forward(b2.forward(b1.forward(a.forward(x)))));
      ctx.backward(loss);
      // The deletions of the parameter RRefs fetched above leave in a batch up to 1 ms after their drop
      // (docs/rref_protocol.md, Note [Batched settlements]): let them go before counting the step's calls.
      ASSERT_TRUE(rpc::testing::eventually([&] { return rrefs(0)->pendingControlCount() == 0; }));
      const rpc::PeerMetrics to1 = agent(0).metrics(name(1));
      const rpc::PeerMetrics to2 = agent(0).metrics(name(2));
      opt.step(ctx);
      // One step call per remote owner, whatever the number of parameters or modules it holds.
      EXPECT_EQ(agent(0).metrics(name(1)).callsSent - to1.callsSent, 1u);
      EXPECT_EQ(agent(0).metrics(name(2)).callsSent - to2.callsSent, 1u);
    }
    // Both modules of worker1 were updated by its one LocalOptimizer.
    const std::vector<Tensor> after1 = fetch(b1.remoteParameters());
    const std::vector<Tensor> after2 = fetch(b2.remoteParameters());
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_GT(maxAbsDiff(after1[i], before1[i]), 0.0) << i;
      EXPECT_GT(maxAbsDiff(after2[i], before2[i]), 0.0) << i;
    }
  }
  // Dropping the optimizer releases its LocalOptimizers on every owner.
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_TRUE(rpc::testing::eventually([&] { return LocalOptimizer::liveCount(agent(rank)) == 0; })) << rank;
  }
}

TEST_P(DistributedOptimizerTest, LocalParametersAndOwnRRefsStepInProcess) {
  start();
  Stage a(3, 2, 30, false);
  Stage refA(3, 2, 30, false);
  // The bias as an RRef this worker owns, the weight as a plain tensor: one in-process part, no calls.
  RRef<Tensor> ownBias = rrefs(0)->own<Tensor>(a.parameters()[1]);
  DistributedOptimizer opt(agent(0), OptimizerSpec::sgd({.learningRate = 0.1, .momentum = 0.5}), {ownBias},
                           {a.parameters()[0]});
  EXPECT_EQ(opt.owners(), std::vector<std::string>{name(0)});
  SGD reference(refA.parameters(), {.learningRate = 0.1, .momentum = 0.5});
  // Batched RRef settlements of earlier drops leave first (Note [Batched settlements]).
  ASSERT_TRUE(rpc::testing::eventually([&] { return rrefs(0)->pendingControlCount() == 0; }));
  const rpc::PeerMetrics to1 = agent(0).metrics(name(1));
  const rpc::PeerMetrics to2 = agent(0).metrics(name(2));
  for (int step = 0; step < 3; ++step) {
    {
      DistContext ctx(agent(0));
      ctx.backward(sum(a.forward(data({4, 3}, 40 + step))));
      opt.step(ctx.id());
    }
    reference.zeroGrad();
    distgrad::backward(sum(refA.forward(data({4, 3}, 40 + step))));
    reference.step();
  }
  EXPECT_EQ(agent(0).metrics(name(1)).callsSent, to1.callsSent);
  EXPECT_EQ(agent(0).metrics(name(2)).callsSent, to2.callsSent);
  for (size_t i = 0; i < 2; ++i) EXPECT_LE(maxAbsDiff(a.parameters()[i], refA.parameters()[i]), 1e-12) << i;
  // .grad is never touched by the distributed backward.
  EXPECT_FALSE(a.parameters()[0].grad().defined());
}

TEST_P(DistributedOptimizerTest, ParameterWithoutGradientIsLeftAlone) {
  start();
  auto used = stage(1, 3, 2, 50, false);
  auto unused = stage(1, 3, 2, 51, false);  // same owner, never in the forward
  std::vector<RRef<Tensor>> params = used.remoteParameters();
  for (auto& p : unused.remoteParameters()) params.push_back(p);
  DistributedOptimizer opt(agent(0), OptimizerSpec::adam({.learningRate = 0.1}), params);
  const std::vector<Tensor> usedBefore = fetch(used.remoteParameters());
  const std::vector<Tensor> unusedBefore = fetch(unused.remoteParameters());
  {
    DistContext ctx(agent(0));
    ctx.backward(sum(used.forward(data({4, 3}, 52))));
    opt.step(ctx);
  }
  const std::vector<Tensor> usedAfter = fetch(used.remoteParameters());
  const std::vector<Tensor> unusedAfter = fetch(unused.remoteParameters());
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_GT(maxAbsDiff(usedAfter[i], usedBefore[i]), 0.05) << i;  // Adam's first step moves by ~lr
    EXPECT_EQ(maxAbsDiff(unusedAfter[i], unusedBefore[i]), 0.0) << i;
  }
}

// Gradients of a Stage's parameters for one batch, computed in this process.
std::vector<Tensor> localGradients(Stage& s, const Tensor& x) {
  s.zeroGrad();
  distgrad::backward(sum(s.forward(x)));
  std::vector<Tensor> out;
  for (const auto& p : s.parameters()) out.push_back(p.grad().cloneData());
  s.zeroGrad();
  return out;
}

TEST_P(DistributedOptimizerTest, ConcurrentContextsOfOneOptimizerSerialiseOnTheOwner) {
  start();
  // A large layer on worker1 (4 executor threads), so two updates would overlap if nothing serialised them.
  constexpr int64_t kIn = 384, kOut = 384;
  auto shared = stage(1, kIn, kOut, 60, false);
  Stage ref(kIn, kOut, 60, false);
  const std::vector<RRef<Tensor>> params = shared.remoteParameters();
  // Plain SGD: both orders end at p - lr gA - lr gB (up to rounding); a torn update loses part of one.
  DistributedOptimizer opt(agent(0), OptimizerSpec::sgd({.learningRate = 0.01}), params);
  SGD reference(ref.parameters(), {.learningRate = 0.01});
  for (int round = 0; round < 5; ++round) {
    const Tensor xA = data({8, kIn}, 600 + round), xB = data({8, kIn}, 700 + round);
    const std::vector<Tensor> gA = localGradients(ref, xA), gB = localGradients(ref, xB);
    {
      DistContext ctxA(agent(0));
      ctxA.backward(sum(shared.forward(xA)));
      DistContext ctxB(agent(0));  // active on this thread from here on; ctxA stays alive
      ctxB.backward(sum(shared.forward(xB)));
      rpc::Future<void> stepA = opt.stepAsync(ctxA.id());
      rpc::Future<void> stepB = opt.stepAsync(ctxB.id());
      stepA.get();
      stepB.get();
    }
    reference.step(gA);
    reference.step(gB);
    const std::vector<Tensor> got = fetch(params);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_LE(maxAbsDiff(got[i], ref.parameters()[i]), 1e-10) << "round " << round << ", parameter " << i;
    }
  }
}

TEST_P(DistributedOptimizerTest, TwoTrainersWithTheirOwnOptimizersSerialiseOnTheSharedOwner) {
  start();
  constexpr int64_t kIn = 384, kOut = 384;
  // One module on worker1, reached by worker0 and worker2, each training it with its own optimizer.
  auto fromWorker2 = RemoteModule<Stage>::create(rrefs(2), name(1), kIn, kOut, uint64_t{61}, false);
  EXPECT_TRUE(agent(2).rpcSync(name(0), kAdopt, fromWorker2));
  RemoteModule<Stage> fromWorker0 = takeAdopted();
  ASSERT_TRUE(fromWorker0.valid());
  // Adam without weight decay: an update does not depend on the parameter, so both orders end at the same
  // place (up to rounding) while a torn update loses part of one. Each optimizer keeps its own moments.
  const OptimizerSpec spec = OptimizerSpec::adam({.learningRate = 0.01});
  DistributedOptimizer opt0(agent(0), spec, fromWorker0.remoteParameters());
  DistributedOptimizer opt2(agent(2), spec, fromWorker2.remoteParameters());
  EXPECT_EQ(LocalOptimizer::liveCount(agent(1)), 2u);
  Stage ref(kIn, kOut, 61, false);
  Adam ref0(ref.parameters(), {.learningRate = 0.01});
  Adam ref2(ref.parameters(), {.learningRate = 0.01});
  const std::vector<RRef<Tensor>> params = fromWorker0.remoteParameters();
  for (int round = 0; round < 5; ++round) {
    const Tensor x0 = data({8, kIn}, 800 + round), x2 = data({8, kIn}, 900 + round);
    const std::vector<Tensor> g0 = localGradients(ref, x0), g2 = localGradients(ref, x2);
    {
      DistContext ctx0(agent(0));
      ctx0.backward(sum(fromWorker0.forward(x0)));
      DistContext ctx2(agent(2));
      ctx2.backward(sum(fromWorker2.forward(x2)));
      rpc::Future<void> step0 = opt0.stepAsync(ctx0.id());
      rpc::Future<void> step2 = opt2.stepAsync(ctx2.id());
      step0.get();
      step2.get();
    }
    ref0.step(g0);
    ref2.step(g2);
    const std::vector<Tensor> got = fetch(params);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_LE(maxAbsDiff(got[i], ref.parameters()[i]), 1e-10) << "round " << round << ", parameter " << i;
    }
  }
}

TEST_P(DistributedOptimizerTest, StepsWaitForHeldParameterLocksWithoutHoldingAThread) {
  start(/*executorThreads=*/1);
  // The module lives on worker1, created there (so this test can reach its tensors) and adopted by worker0.
  auto atOwner = RemoteModule<Stage>::create(rrefs(1), name(1), int64_t{3}, int64_t{2}, uint64_t{90}, false);
  std::vector<Tensor> ownerParams;
  for (const auto& p : atOwner.remoteParameters()) ownerParams.push_back(*p.localValue());
  ASSERT_TRUE(agent(1).rpcSync(name(0), kAdopt, atOwner));
  RemoteModule<Stage> handle = takeAdopted();
  DistributedOptimizer opt(agent(0), OptimizerSpec::sgd({.learningRate = 0.1}), handle.remoteParameters());
  Stage ref(3, 2, 90, false);
  SGD reference(ref.parameters(), {.learningRate = 0.1});
  const Tensor x = data({4, 3}, 91);
  const std::vector<Tensor> g = localGradients(ref, x);
  {
    DistContext ctx(agent(0));
    ctx.backward(sum(handle.forward(x)));
    const std::vector<Tensor> before = copies(ownerParams);
    rpc::Future<void> first, second;
    {
      StepLockGuard hold(agent(1), ownerParams);
      first = opt.stepAsync(ctx.id());
      second = opt.stepAsync(ctx.id());
      // worker1's only executor thread serves calls sent after both steps (two round trips, so the steps'
      // own tasks, queued at the owner behind the first, have run): they wait on the locks, not on a
      // thread, and have not touched the parameters.
      for (int i = 0; i < 2; ++i) {
        EXPECT_EQ(agent(0).rpcSync(name(1), rref::testing::kAddInt, int64_t{2}, int64_t{i}), 2 + i);
      }
      EXPECT_FALSE(first.isReady());
      EXPECT_FALSE(second.isReady());
      for (size_t i = 0; i < ownerParams.size(); ++i) EXPECT_EQ(maxAbsDiff(ownerParams[i], before[i]), 0.0) << i;
    }
    first.get();
    second.get();
  }
  reference.step(g);
  reference.step(g);
  for (size_t i = 0; i < ownerParams.size(); ++i) {
    EXPECT_LE(maxAbsDiff(ownerParams[i], ref.parameters()[i]), 1e-12) << i;
  }
}

TEST_P(DistributedOptimizerTest, UnknownContextFailsNamingEveryOwner) {
  start();
  auto b = stage(1, 3, 2, 70, false);
  auto c = stage(2, 2, 1, 71, false);
  std::vector<RRef<Tensor>> params = b.remoteParameters();
  for (auto& p : c.remoteParameters()) params.push_back(p);
  DistributedOptimizer opt(agent(0), OptimizerSpec::sgd({.learningRate = 0.1}), params);
  const std::vector<Tensor> before = fetch(params);
  const uint64_t unknown = 12345;
  try {
    opt.step(unknown);
    ADD_FAILURE() << "expected an RpcError";
  } catch (const rpc::RpcError& e) {
    const std::string what = e.what();
    EXPECT_TRUE(e.error().worker == name(1) || e.error().worker == name(2)) << what;
    EXPECT_NE(what.find(name(1)), std::string::npos) << what;
    EXPECT_NE(what.find(name(2)), std::string::npos) << what;
    EXPECT_NE(what.find("12345"), std::string::npos) << what;
  }
  const std::vector<Tensor> after = fetch(params);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(maxAbsDiff(after[i], before[i]), 0.0) << i;

  // A context only worker1 joined: worker2 (and only worker2) reports it.
  {
    DistContext ctx(agent(0));
    ctx.backward(sum(b.forward(data({2, 3}, 72))));
    try {
      opt.step(ctx);
      ADD_FAILURE() << "expected an RpcError";
    } catch (const rpc::RpcError& e) {
      const std::string what = e.what();
      EXPECT_EQ(e.error().worker, name(2)) << what;
      EXPECT_EQ(what.find("[" + name(1) + "]"), std::string::npos) << what;
    }
  }
}

// Contexts made on this thread that do not stay active on it (a pipeline's per-micro-batch contexts):
// each is activated only while its calls are made.
std::vector<std::unique_ptr<DistContext>> makeContexts(rpc::Agent& agent, size_t n) {
  rpc::AutogradContextScope restore(rpc::activeAutogradContext());
  std::vector<std::unique_ptr<DistContext>> out;
  for (size_t i = 0; i < n; ++i) out.push_back(std::make_unique<DistContext>(agent));
  return out;
}

std::vector<uint64_t> idsOf(const std::vector<std::unique_ptr<DistContext>>& contexts) {
  std::vector<uint64_t> out;
  for (const auto& c : contexts) out.push_back(c->id());
  return out;
}

TEST_P(DistributedOptimizerTest, StepOverSeveralContextsEqualsTheStepOnTheSummedGradients) {
  start();
  SplitModel m = splitModel();
  const std::vector<Tensor> initial = copies(m.refParams());
  // Adam with weight decay: a step on the sum is not the sum of steps, so a per-context step would show.
  const OptimizerSpec spec = OptimizerSpec::adam({.learningRate = 0.01, .weightDecay = 1e-3});
  DistributedOptimizer opt(agent(0), spec, m.remoteParams(), m.a->parameters());
  std::unique_ptr<Optimizer> reference = spec.make(m.refParams());
  constexpr int kMicroBatches = 3;
  for (int step = 0; step < 4; ++step) {
    // One batch in three micro-batches, each in its own context, all alive at once.
    auto contexts = makeContexts(agent(0), kMicroBatches);
    for (int k = 0; k < kMicroBatches; ++k) {
      auto active = contexts[k]->activate();
      contexts[k]->backward(m.distributedLoss(10 * step + k));
    }
    // Batched RRef settlements of earlier drops leave first (Note [Batched settlements]).
    ASSERT_TRUE(rpc::testing::eventually([&] { return rrefs(0)->pendingControlCount() == 0; }));
    const rpc::PeerMetrics to1 = agent(0).metrics(name(1));
    const rpc::PeerMetrics to2 = agent(0).metrics(name(2));
    opt.step(idsOf(contexts));
    // One call per remote owner, whatever the number of contexts.
    EXPECT_EQ(agent(0).metrics(name(1)).callsSent - to1.callsSent, 1u);
    EXPECT_EQ(agent(0).metrics(name(2)).callsSent - to2.callsSent, 1u);
    contexts.clear();

    m.referenceStepOnSum(*reference, 10 * step, kMicroBatches);
  }
  m.expectMatchesReference(1e-9, "step over " + std::to_string(kMicroBatches) + " contexts");
  const std::vector<Tensor> trained = m.refParams();
  for (size_t i = 0; i < trained.size(); ++i) EXPECT_GT(maxAbsDiff(trained[i], initial[i]), 1e-3) << i;
}

// Note [Gradient folding]: contexts folded into the first one on every worker (two before their backward,
// one after it, so both the redirect and the move are used) step exactly like the unfolded contexts (Adam:
// a step on the sum), while every worker holds one gradient per parameter: the folded contexts hold none.
TEST_P(DistributedOptimizerTest, FoldedContextsStepLikeTheSumAndHoldOneGradientPerParameter) {
  start();
  SplitModel m = splitModel();
  const OptimizerSpec spec = OptimizerSpec::adam({.learningRate = 0.01, .weightDecay = 1e-3});
  DistributedOptimizer opt(agent(0), spec, m.remoteParams(), m.a->parameters());
  std::unique_ptr<Optimizer> reference = spec.make(m.refParams());
  constexpr int kMicroBatches = 4;
  for (int step = 0; step < 3; ++step) {
    auto contexts = makeContexts(agent(0), kMicroBatches);
    const std::vector<uint64_t> ids = idsOf(contexts);
    auto foldEverywhere = [&](int k) {
      for (int w = 0; w < 3; ++w) autograd::distributed::foldGradients(agent(w), ids[k], ids[0]);
    };
    for (int k = 0; k < kMicroBatches; ++k) {
      if (k == 1 || k == 2) foldEverywhere(k);  // before: its gradients go straight to context 0
      auto active = contexts[k]->activate();
      contexts[k]->backward(m.distributedLoss(10 * step + k));
    }
    foldEverywhere(3);  // after: what context 3 holds moves into context 0
    foldEverywhere(3);  // again: nothing happens
    for (int w = 0; w < 3; ++w) {
      const size_t parametersHere = w == 0 ? m.a->parameters().size() : 2;
      EXPECT_EQ(autograd::distributed::gradientsOf(agent(w), ids[0]).size(), parametersHere) << name(w);
      for (int k = 1; k < kMicroBatches; ++k) {
        EXPECT_EQ(autograd::distributed::gradientsOf(agent(w), ids[k]).size(), 0u) << name(w) << " context " << k;
      }
    }
    // A fold that would make a cycle, a second target, a context into itself, one this worker never had:
    // refused, naming the problem; nothing moves.
    EXPECT_THROW(autograd::distributed::foldGradients(agent(1), ids[0], ids[1]), ValueError);
    EXPECT_THROW(autograd::distributed::foldGradients(agent(1), ids[1], ids[2]), ValueError);
    EXPECT_THROW(autograd::distributed::foldGradients(agent(1), ids[0], ids[0]), ValueError);
    EXPECT_THROW(autograd::distributed::foldGradients(agent(0), ids[0] + 1000, ids[0]), ValueError);
    opt.step(ids);
    contexts.clear();

    m.referenceStepOnSum(*reference, 10 * step, kMicroBatches);
  }
  m.expectMatchesReference(1e-9, "step over " + std::to_string(kMicroBatches) + " folded contexts");
}

// Once the context folded into is released, a folding context keeps its own later gradients (they are not
// lost into a context nobody can step any more), and folding into a released context is refused.
TEST_P(DistributedOptimizerTest, AContextFoldingIntoAReleasedOneKeepsItsGradients) {
  start();
  auto b = stage(1, 3, 2, 81, false);
  auto contexts = makeContexts(agent(0), 3);
  const std::vector<uint64_t> ids = idsOf(contexts);
  {
    auto active = contexts[1]->activate();
    contexts[1]->backward(sum(b.forward(data({2, 3}, 82))));
  }
  {
    auto active = contexts[2]->activate();
    (void)b.forward(data({2, 3}, 83));  // worker1 joins context 2
  }
  {
    auto active = contexts[0]->activate();
    (void)b.forward(data({2, 3}, 84));  // worker1 joins context 0
  }
  autograd::distributed::foldGradients(agent(1), ids[1], ids[0]);
  EXPECT_EQ(autograd::distributed::gradientsOf(agent(1), ids[0]).size(), 2u);
  contexts[0]->end();  // released everywhere, with what context 1 folded into it
  {
    auto active = contexts[1]->activate();
    contexts[1]->backward(sum(b.forward(data({2, 3}, 85))));
  }
  EXPECT_EQ(autograd::distributed::gradientsOf(agent(1), ids[1]).size(), 2u);
  EXPECT_ANY_THROW(autograd::distributed::foldGradients(agent(1), ids[2], ids[0]));
  contexts.clear();  // TearDown checks that every context and RRef is released
}

TEST_P(DistributedOptimizerTest, StepOverContextsWithAnUnknownOneUpdatesNothingAndNamesIt) {
  start();
  auto b = stage(1, 3, 2, 73, false);
  auto c = stage(2, 2, 1, 74, false);
  std::vector<RRef<Tensor>> params = b.remoteParameters();
  for (auto& p : c.remoteParameters()) params.push_back(p);
  DistributedOptimizer opt(agent(0), OptimizerSpec::sgd({.learningRate = 0.1}), params);
  const std::vector<Tensor> before = fetch(params);
  auto contexts = makeContexts(agent(0), 2);
  for (auto& ctx : contexts) {
    auto active = ctx->activate();
    ctx->backward(sum(c.forward(b.forward(data({2, 3}, 75)))));
  }
  std::vector<uint64_t> ids = idsOf(contexts);
  ids.push_back(987654);  // known nowhere
  try {
    opt.step(ids);
    ADD_FAILURE() << "expected an RpcError";
  } catch (const rpc::RpcError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("987654"), std::string::npos) << what;
    EXPECT_NE(what.find(name(1)), std::string::npos) << what;
    EXPECT_NE(what.find(name(2)), std::string::npos) << what;
  }
  // No owner applied part of the step: the known contexts' gradients were read first, the unknown one failed
  // before any update.
  const std::vector<Tensor> after = fetch(params);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(maxAbsDiff(after[i], before[i]), 0.0) << i;
  // Caller's mistakes are ValueErrors before anything is sent.
  EXPECT_THROW(opt.step(std::vector<uint64_t>{}), ValueError);
  EXPECT_THROW(opt.step(std::vector<uint64_t>{ids[0], ids[1], ids[0]}), ValueError);
  // The known contexts still step fine afterwards.
  opt.step(idsOf(contexts));
  const std::vector<Tensor> stepped = fetch(params);
  for (size_t i = 0; i < stepped.size(); ++i) EXPECT_GT(maxAbsDiff(stepped[i], before[i]), 0.0) << i;
}

// stepAfterBackwardAsync issued before the forwards: no owner steps before its part of the last backward has
// run, and the result is the step on the summed gradients (Adam with weight decay, 1e-9 against one process).
TEST_P(DistributedOptimizerTest, StepAfterBackwardWaitsForEveryContextsBackwardThenStepsOnTheSum) {
  start();
  SplitModel m = splitModel();
  const OptimizerSpec spec = OptimizerSpec::adam({.learningRate = 0.01, .weightDecay = 1e-3});
  DistributedOptimizer opt(agent(0), spec, m.remoteParams(), m.a->parameters());
  std::unique_ptr<Optimizer> reference = spec.make(m.refParams());
  constexpr int kMicroBatches = 3;
  auto current = [&] { return copies(concat(m.a->parameters(), fetch(m.remoteParams()))); };
  for (int step = 0; step < 3; ++step) {
    auto contexts = makeContexts(agent(0), kMicroBatches);
    const std::vector<uint64_t> ids = idsOf(contexts);
    // Issued before the owners have seen the contexts: they join them and wait.
    rpc::Future<void> stepping = opt.stepAfterBackwardAsync(ids);
    for (int k = 0; k < kMicroBatches; ++k) {
      if (k + 1 == kMicroBatches) {
        // Every backward but the last has run everywhere: nothing has moved.
        const std::vector<Tensor> before = current();
        EXPECT_FALSE(stepping.wait(std::chrono::milliseconds(50)));
        const std::vector<Tensor> still = current();
        for (size_t i = 0; i < still.size(); ++i) EXPECT_EQ(maxAbsDiff(still[i], before[i]), 0.0) << i;
      }
      auto active = contexts[k]->activate();
      contexts[k]->backward(m.distributedLoss(10 * step + k));
    }
    ASSERT_TRUE(stepping.wait(rpc::testing::kTestTimeout));
    stepping.get();
    contexts.clear();

    m.referenceStepOnSum(*reference, 10 * step, kMicroBatches);
  }
  m.expectMatchesReference(1e-9, "step after the backwards of " + std::to_string(kMicroBatches) + " contexts");
  EXPECT_THROW((void)opt.stepAfterBackwardAsync({}), ValueError);
}

// A context released before its backward ran fails the waiting step on every owner, naming them, and no
// owner updates anything (each waits for all its contexts before stepping).
TEST_P(DistributedOptimizerTest, StepAfterBackwardFailsAndUpdatesNothingWhenAContextIsReleasedFirst) {
  start();
  auto b = stage(1, 3, 2, 91, false);
  auto c = stage(2, 2, 1, 92, false);
  std::vector<RRef<Tensor>> params = b.remoteParameters();
  for (auto& p : c.remoteParameters()) params.push_back(p);
  DistributedOptimizer opt(agent(0), OptimizerSpec::sgd({.learningRate = 0.1}), params);
  const std::vector<Tensor> before = fetch(params);
  auto contexts = makeContexts(agent(0), 2);
  rpc::Future<void> stepping = opt.stepAfterBackwardAsync(idsOf(contexts));
  {
    auto active = contexts[0]->activate();
    contexts[0]->backward(sum(c.forward(b.forward(data({2, 3}, 93)))));
  }
  {
    auto active = contexts[1]->activate();
    (void)c.forward(b.forward(data({2, 3}, 94)));  // both owners take part; no backward
  }
  contexts[1]->end();
  ASSERT_TRUE(stepping.wait(rpc::testing::kTestTimeout));
  rpc::Result<void> r = stepping.result();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, rpc::ErrorKind::kCancelled) << r.error().describe();
  for (const std::string& owner : {name(1), name(2)}) {
    EXPECT_NE(r.error().message.find(owner), std::string::npos) << r.error().describe();
  }
  EXPECT_NE(r.error().message.find("released before a backward pass"), std::string::npos) << r.error().describe();
  const std::vector<Tensor> after = fetch(params);
  for (size_t i = 0; i < after.size(); ++i) EXPECT_EQ(maxAbsDiff(after[i], before[i]), 0.0) << i;
}

TEST_P(DistributedOptimizerTest, OwnerRefusingParametersFailsConstructionNamingIt) {
  start();
  auto expectRefused = [&](const std::vector<RRef<Tensor>>& params, const std::string& owner,
                           const std::string& needle) {
    try {
      DistributedOptimizer opt(agent(0), OptimizerSpec::sgd({.learningRate = 0.1}), params);
      ADD_FAILURE() << "expected an RpcError containing '" << needle << "'";
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.error().worker, owner) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("LocalOptimizer on " + owner), std::string::npos) << e.what();
    }
  };
  RRef<Tensor> nonLeaf = rrefs(0)->remote(name(1), kMakeTensor, kNonLeaf);
  RRef<Tensor> integer = rrefs(0)->remote(name(1), kMakeTensor, kInt64);
  RRef<Tensor> leaf = rrefs(0)->remote(name(2), kMakeTensor, kFloat64Leaf);
  expectRefused({nonLeaf}, name(1), "not a leaf");
  expectRefused({integer}, name(1), "must be float32 or float64");
  expectRefused({leaf, leaf}, name(2), "appears twice");
  // A local parameter the optimizer refuses: this worker is named.
  Tensor local = Tensor::ones({2}, DType::kFloat64);
  Tensor notLeaf = local.setRequiresGrad(true) * 3.0;
  try {
    DistributedOptimizer opt(agent(0), OptimizerSpec::sgd({.learningRate = 0.1}), {leaf}, {notLeaf});
    ADD_FAILURE() << "expected an RpcError";
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.error().worker, name(0)) << e.what();
    EXPECT_NE(std::string(e.what()).find("not a leaf"), std::string::npos) << e.what();
  }
  EXPECT_THROW(DistributedOptimizer(agent(0), OptimizerSpec::sgd({}), {}, {}), ValueError);
  EXPECT_THROW(DistributedOptimizer(agent(0), OptimizerSpec::sgd({}), {RRef<Tensor>()}), ValueError);
}

TEST_P(DistributedOptimizerTest, OwnerValidatesTheSpecFromTheWire) {
  start();
  auto b = stage(1, 3, 2, 80, false);
  std::vector<RRef<Tensor>> params = b.remoteParameters();
  // Bypass the caller's validation: construct LocalOptimizers on worker1 directly.
  OptimizerSpec unknown;
  unknown.kind = "rmsprop";
  OptimizerSpec badBeta = OptimizerSpec::adam({});
  badBeta.beta2 = 1.5;
  for (const auto& [spec, needle] : std::vector<std::pair<OptimizerSpec, std::string>>{
           {unknown, "unknown optimizer kind 'rmsprop'"}, {badBeta, "beta2 must be in [0, 1), got 1.5"}}) {
    RRef<LocalOptimizer> direct = rrefs(0)->remote<LocalOptimizer>(name(1), spec, params);
    const rpc::Error error = rpc::testing::errorOf([&] { (void)direct.rpcSync(&LocalOptimizer::ready); });
    EXPECT_EQ(error.worker, name(1)) << error.describe();
    EXPECT_NE(error.message.find(needle), std::string::npos) << error.describe();
  }
  // A parameter of another owner handed to worker1's LocalOptimizer.
  auto c = stage(2, 2, 1, 81, false);
  RRef<LocalOptimizer> misplaced =
      rrefs(0)->remote<LocalOptimizer>(name(1), OptimizerSpec::sgd({}), c.remoteParameters());
  const rpc::Error error = rpc::testing::errorOf([&] { (void)misplaced.rpcSync(&LocalOptimizer::ready); });
  EXPECT_EQ(error.worker, name(1)) << error.describe();
  EXPECT_NE(error.message.find("owned by " + name(2)), std::string::npos) << error.describe();
  // A good one works directly too.
  RRef<LocalOptimizer> good = rrefs(0)->remote<LocalOptimizer>(name(1), OptimizerSpec::sgd({}), params);
  EXPECT_EQ(good.rpcSync(&LocalOptimizer::ready), 2);
}

INSTANTIATE_TEST_SUITE_P(Transports, DistributedOptimizerTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));
INSTANTIATE_TEST_SUITE_P(Transports, TrainingTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));

// ---- OptimizerSpec (no workers) ----

TEST(OptimizerSpecTest, FactoriesMirrorTheOptimizerOptions) {
  OptimizerSpec s = OptimizerSpec::sgd({.learningRate = 0.2, .momentum = 0.9, .dampening = 0.1, .weightDecay = 0.01});
  EXPECT_EQ(s.kind, "sgd");
  EXPECT_EQ(s.learningRate, 0.2);
  EXPECT_EQ(s.momentum, 0.9);
  EXPECT_EQ(s.dampening, 0.1);
  EXPECT_EQ(s.weightDecay, 0.01);
  EXPECT_FALSE(s.nesterov);
  auto sgd = s.make({Tensor::zeros({2}, DType::kFloat64).setRequiresGrad(true)});
  auto* asSgd = dynamic_cast<SGD*>(sgd.get());
  ASSERT_NE(asSgd, nullptr);
  EXPECT_EQ(asSgd->options().momentum, 0.9);
  EXPECT_EQ(asSgd->options().dampening, 0.1);
  EXPECT_EQ(asSgd->learningRate(), 0.2);

  OptimizerSpec a = OptimizerSpec::adam({.learningRate = 0.3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6,
                                         .weightDecay = 0.1, .amsgrad = true});
  EXPECT_EQ(a.kind, "adam");
  auto adam = a.make({Tensor::zeros({2}).setRequiresGrad(true)});
  auto* asAdam = dynamic_cast<Adam*>(adam.get());
  ASSERT_NE(asAdam, nullptr);
  EXPECT_EQ(dynamic_cast<AdamW*>(adam.get()), nullptr);
  EXPECT_EQ(asAdam->options().beta1, 0.8);
  EXPECT_EQ(asAdam->options().beta2, 0.99);
  EXPECT_EQ(asAdam->options().eps, 1e-6);
  EXPECT_EQ(asAdam->options().weightDecay, 0.1);
  EXPECT_TRUE(asAdam->options().amsgrad);

  OptimizerSpec w = OptimizerSpec::adamw({});
  EXPECT_EQ(w.kind, "adamw");
  EXPECT_EQ(w.weightDecay, 1e-2);  // AdamW's default
  EXPECT_NE(dynamic_cast<AdamW*>(w.make({Tensor::zeros({2}).setRequiresGrad(true)}).get()), nullptr);
  EXPECT_EQ(w.describe(), "adamw(lr=0.001, beta1=0.9, beta2=0.999, eps=1e-08, amsgrad=false, weightDecay=0.01)");
}

TEST(OptimizerSpecTest, BadSpecsAreRefusedWithClearMessages) {
  auto refused = [](const OptimizerSpec& spec, const std::string& needle) {
    try {
      spec.validate();
      ADD_FAILURE() << "expected a ValueError containing '" << needle << "' for " << spec.describe();
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  OptimizerSpec unknown;
  unknown.kind = "rmsprop";
  refused(unknown, "unknown optimizer kind 'rmsprop' (expected sgd, adam or adamw)");
  refused(OptimizerSpec::sgd({.learningRate = -1}), "learningRate must be a finite number >= 0, got -1");
  refused(OptimizerSpec::sgd({.learningRate = std::nan("")}), "learningRate must be a finite number >= 0");
  refused(OptimizerSpec::sgd({.momentum = -0.5}), "momentum must be a finite number >= 0, got -0.5");
  refused(OptimizerSpec::sgd({.dampening = 2}), "dampening must be in [0, 1], got 2");
  refused(OptimizerSpec::sgd({.momentum = 0.9, .dampening = 0.5, .nesterov = true}),
          "nesterov momentum requires momentum > 0 and dampening == 0");
  refused(OptimizerSpec::sgd({.weightDecay = -1}), "weightDecay must be a finite number >= 0, got -1");
  refused(OptimizerSpec::adam({.beta1 = 1.0}), "beta1 must be in [0, 1), got 1");
  refused(OptimizerSpec::adam({.beta2 = -0.1}), "beta2 must be in [0, 1), got -0.1");
  refused(OptimizerSpec::adam({.eps = -1e-8}), "eps must be a finite number >= 0");
  OptimizerSpec sgdWithAmsgrad = OptimizerSpec::sgd({});
  sgdWithAmsgrad.amsgrad = true;
  refused(sgdWithAmsgrad, "are Adam options and must keep their defaults for sgd");
  OptimizerSpec adamWithMomentum = OptimizerSpec::adam({});
  adamWithMomentum.momentum = 0.9;
  refused(adamWithMomentum, "are SGD options and must keep their defaults for adam");
  // make() validates too.
  EXPECT_THROW((void)unknown.make({Tensor::zeros({1}).setRequiresGrad(true)}), ValueError);
}

}  // namespace
}  // namespace distgrad::models::optim::testing
