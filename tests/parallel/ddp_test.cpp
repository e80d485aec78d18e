// DistributedDataParallel against single-process training on the concatenated batch: 2 and 3 ranks in one
// process (inproc and tcp), each with its own model instance (different initial weights, which DDP's
// broadcast replaces with rank 0's) and its slice of the batch. After one DDP step every rank's gradients
// equal the single-process gradients of the whole batch to 1e-6 (float32); after several SGD steps every
// rank holds the same parameters as the single process. Also inside distributed autograd contexts
// (gradients live in the context), and with buckets small enough that all-reduces start during backward.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>

#include "../rpc/agent_test_util.h"
#include "autograd/distributed/dist_autograd.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "models/nn/activation.h"
#include "models/nn/linear.h"
#include "models/nn/sequential.h"
#include "models/optim/sgd.h"
#include "models/optim/adam.h"
#include "models/parallel/ddp.h"
#include "models/parallel/horovod.h"
#include "models/parallel/zero.h"
#include "tensor/random.h"

namespace distgrad::models {
namespace {

using rpc::collectives::ProcessGroup;
using optim::SGD;
using optim::SgdOptions;
using tensor::Generator;

std::shared_ptr<Sequential> makeModel(uint64_t seed) {
  Generator gen(seed);
  auto model = std::make_shared<Sequential>();
  model->add(std::make_shared<Linear>(6, 16, gen));
  model->add(std::make_shared<ReLU>());
  model->add(std::make_shared<Linear>(16, 16, gen));
  model->add(std::make_shared<ReLU>());
  model->add(std::make_shared<Linear>(16, 4, gen));
  return model;
}

struct Data {
  Tensor x;  // [n * perRank, 6]
  Tensor y;  // [n * perRank, 4]
};

Data makeData(int64_t rows) {
  Generator gen(99);
  return {tensor::uniform({rows, 6}, -1.0, 1.0, gen), tensor::uniform({rows, 4}, -1.0, 1.0, gen)};
}

void expectClose(const Tensor& got, const Tensor& want, double tolerance, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": no gradient";
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const auto g = got.toVector<float>();
  const auto w = want.toVector<float>();
  for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], w[i], tolerance) << what << " element " << i;
}

struct DdpJob {
  rpc::testing::World world;
  rpc::Registry registry;
  rpc::testing::Cluster cluster;
  std::vector<std::unique_ptr<ProcessGroup>> groups;
  ~DdpJob() { groups.clear(); }
};

std::unique_ptr<DdpJob> startJob(const std::string& transport, int n) {
  auto job = std::make_unique<DdpJob>();
  job->registry = rpc::testing::makeRegistry(job->world);
  rpc::collectives::install(job->registry);
  autograd::distributed::install(job->registry);
  rpc::testing::ClusterSpec spec;
  spec.transport = transport;
  spec.size = n;
  rpc::testing::startCluster(job->cluster, spec, job->world, job->registry);
  for (int r = 0; r < n; ++r) {
    if (job->cluster.errors[static_cast<size_t>(r)]) std::rethrow_exception(job->cluster.errors[static_cast<size_t>(r)]);
  }
  for (int r = 0; r < n; ++r) {
    job->groups.push_back(std::make_unique<ProcessGroup>(ProcessGroup::world(*job->cluster.agents[static_cast<size_t>(r)])));
  }
  return job;
}

// Runs `body(rank)` on one thread per rank (DDP's collectives need every rank at once).
void onEveryRank(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

enum class Mode { kLocal, kDistAutograd };

class Ddp : public ::testing::TestWithParam<std::tuple<std::string, int, Mode>> {};

TEST_P(Ddp, GradientsEqualSingleProcessOnTheConcatenatedBatch) {
  const auto [transport, n, mode] = GetParam();
  constexpr int64_t kPerRank = 5;
  constexpr int kSteps = 3;
  auto job = startJob(transport, n);
  const Data data = makeData(n * kPerRank);

  // The single-process reference starts from rank 0's initial weights (seed 100).
  auto reference = makeModel(100);
  SGD referenceOptimizer(reference->parameters(), SgdOptions{0.1, 0.9});
  std::vector<std::vector<Tensor>> referenceGrads;
  std::vector<std::vector<Tensor>> referenceParams;
  for (int step = 0; step < kSteps; ++step) {
    reference->zeroGrad();
    autograd::backward(std::vector<Tensor>{distgrad::mseLoss(reference->forward(data.x), data.y)});
    std::vector<Tensor> grads;
    for (const Tensor& p : reference->parameters()) grads.push_back(p.grad().cloneData());
    referenceGrads.push_back(grads);
    referenceOptimizer.step();
    std::vector<Tensor> params;
    for (const Tensor& p : reference->parameters()) params.push_back(p.detach().cloneData());
    referenceParams.push_back(params);
  }

  std::vector<std::shared_ptr<Sequential>> models(static_cast<size_t>(n));
  std::vector<size_t> overlapped(static_cast<size_t>(n));
  onEveryRank(n, [&](int rank) {
    rpc::Agent& agent = *job->cluster.agents[static_cast<size_t>(rank)];
    auto model = makeModel(100 + static_cast<uint64_t>(rank));  // different weights until DDP broadcasts
    models[static_cast<size_t>(rank)] = model;
    DdpOptions options;
    options.bucketBytes = 300;  // several buckets: the first ones start during backward
    DistributedDataParallel ddp(*model, *job->groups[static_cast<size_t>(rank)], options);
    EXPECT_GT(ddp.buckets().size(), size_t{2});
    SGD optimizer(model->parameters(), SgdOptions{0.1, 0.9});
    const Tensor x = distgrad::narrow(data.x, 0, rank * kPerRank, kPerRank).cloneData();
    const Tensor y = distgrad::narrow(data.y, 0, rank * kPerRank, kPerRank).cloneData();
    for (int step = 0; step < kSteps; ++step) {
      model->zeroGrad();
      std::vector<Tensor> grads;
      if (mode == Mode::kLocal) {
        ddp.backward(distgrad::mseLoss(ddp.forward(x), y));
        for (const Tensor& p : model->parameters()) grads.push_back(p.grad());
        optimizer.step();
      } else {
        autograd::distributed::DistContext ctx(agent);
        ddp.backward(ctx, distgrad::mseLoss(ddp.forward(x), y));
        auto inContext = ctx.gradients();
        for (const Tensor& p : model->parameters()) {
          EXPECT_FALSE(p.grad().defined()) << "distributed autograd must not touch .grad";
          grads.push_back(inContext.get(p).cloneData());
        }
        optimizer.step(grads);
      }
      for (size_t i = 0; i < grads.size(); ++i) {
        expectClose(grads[i], referenceGrads[static_cast<size_t>(step)][i], 1e-6,
                    "rank " + std::to_string(rank) + " step " + std::to_string(step) + " gradient " + std::to_string(i));
      }
      if (step == 0) overlapped[static_cast<size_t>(rank)] = ddp.bucketsLaunchedDuringBackward();
    }
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_GT(overlapped[static_cast<size_t>(r)], size_t{0}) << "no bucket started before backward ended on rank " << r;
    auto params = models[static_cast<size_t>(r)]->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      expectClose(params[i].detach(), referenceParams.back()[i], 1e-5, "rank " + std::to_string(r) + " parameter " + std::to_string(i));
      // All ranks hold bitwise the same parameters.
      EXPECT_EQ(params[i].toVector<float>(), models[0]->parameters()[i].toVector<float>()) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    RanksTransportsModes, Ddp,
    ::testing::Combine(::testing::Values("inproc", "tcp"), ::testing::Values(2, 3),
                       ::testing::Values(Mode::kLocal, Mode::kDistAutograd)),
    [](const ::testing::TestParamInfo<std::tuple<std::string, int, Mode>>& info) {
      return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "ranks_" +
             (std::get<2>(info.param) == Mode::kLocal ? "local" : "dist_autograd");
    });

TEST(DdpSetup, UnusedParameterOnOneRankStillAverages) {
  // Rank 1 never uses the model (its loss is on another tensor): it still joins every bucket's all-reduce
  // with zeros, so rank 0's gradients are halved and both ranks agree.
  auto job = startJob("inproc", 2);
  std::vector<std::vector<Tensor>> grads(2);
  onEveryRank(2, [&](int rank) {
    auto model = makeModel(7);
    DistributedDataParallel ddp(*model, *job->groups[static_cast<size_t>(rank)]);
    const Data data = makeData(4);
    if (rank == 0) {
      ddp.backward(distgrad::mseLoss(ddp.forward(data.x), data.y));
    } else {
      ddp.synchronize();
    }
    for (const Tensor& p : model->parameters()) grads[static_cast<size_t>(rank)].push_back(p.grad());
  });
  auto single = makeModel(7);
  const Data data = makeData(4);
  autograd::backward(std::vector<Tensor>{distgrad::mseLoss(single->forward(data.x), data.y)});
  auto params = single->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor half = (params[i].grad() * 0.5).detach();
    expectClose(grads[0][i], half, 1e-7, "rank 0 parameter " + std::to_string(i));
    expectClose(grads[1][i], half, 1e-7, "rank 1 parameter " + std::to_string(i));
  }
}


// A module that updates a buffer in forward (as BatchNorm's running statistics do), by a per-rank amount.
class Drifting : public Module {
 public:
  explicit Drifting(float delta) : Module("Drifting"), delta_(delta) {
    weight_ = Tensor::ones({3});
    registerParameter("weight", weight_);
    state_ = Tensor::zeros({2});
    registerBuffer("state", state_);
  }
  Tensor forward(const Tensor& x) override {
    float* d = state_.data<float>();
    for (int i = 0; i < 2; ++i) d[i] += delta_;
    return x * weight_;
  }
  float state() const { return state_.data<float>()[0]; }

 private:
  float delta_;
  Tensor weight_;
  Tensor state_;
};

TEST(DdpSetup, BuffersFollowRankZeroAtEveryForward) {
  for (bool broadcastBuffers : {true, false}) {
    auto job = startJob("inproc", 2);
    std::vector<float> states(2);
    onEveryRank(2, [&](int rank) {
      Drifting module(static_cast<float>(rank + 1));
      DdpOptions options;
      options.broadcastBuffers = broadcastBuffers;
      DistributedDataParallel ddp(module, *job->groups[static_cast<size_t>(rank)], options);
      for (int step = 0; step < 3; ++step) ddp.backward(distgrad::sum(ddp.forward(Tensor::ones({3}))));
      states[static_cast<size_t>(rank)] = module.state();
    });
    if (broadcastBuffers) {
      // Each forward starts from rank 0's buffer (2 after two steps) and adds the rank's own delta.
      EXPECT_EQ(states[0], 3.0f);
      EXPECT_EQ(states[1], 4.0f);
    } else {
      EXPECT_EQ(states[0], 3.0f);
      EXPECT_EQ(states[1], 6.0f);
    }
  }
}

TEST(Zero, ShardedAdamMatchesSingleProcessAdamWithAFractionOfTheState) {
  // DDP averages the gradients; ZeRO-1 steps each rank's shard with Adam and broadcasts it back. Three
  // steps equal single-process Adam on the concatenated batch, and each rank keeps only its shard's moments.
  for (int n : {2, 3}) {
    constexpr int64_t kPerRank = 4;
    auto job = startJob("inproc", n);
    const Data data = makeData(n * kPerRank);
    auto reference = makeModel(100);
    optim::Adam referenceAdam(reference->parameters(), optim::AdamOptions{.learningRate = 0.01});
    for (int step = 0; step < 3; ++step) {
      reference->zeroGrad();
      autograd::backward(std::vector<Tensor>{distgrad::mseLoss(reference->forward(data.x), data.y)});
      referenceAdam.step();
    }
    size_t fullState = 0;
    for (const auto& [name, value] : referenceAdam.stateDict()) {
      if (name.find('.') != std::string::npos) fullState += value.nbytes();
    }
    std::vector<std::shared_ptr<Sequential>> models(static_cast<size_t>(n));
    std::vector<size_t> stateBytes(static_cast<size_t>(n));
    std::vector<std::vector<int>> owners(static_cast<size_t>(n));
    onEveryRank(n, [&](int rank) {
      auto model = makeModel(100 + static_cast<uint64_t>(rank));
      models[static_cast<size_t>(rank)] = model;
      ProcessGroup& group = *job->groups[static_cast<size_t>(rank)];
      DistributedDataParallel ddp(*model, group);
      ZeroRedundancyOptimizer zero(model->parameters(), group, [](std::vector<Tensor> shard) {
        return std::make_unique<optim::Adam>(std::move(shard), optim::AdamOptions{.learningRate = 0.01});
      });
      const Tensor x = distgrad::narrow(data.x, 0, rank * kPerRank, kPerRank).cloneData();
      const Tensor y = distgrad::narrow(data.y, 0, rank * kPerRank, kPerRank).cloneData();
      for (int step = 0; step < 3; ++step) {
        zero.zeroGrad();
        ddp.backward(distgrad::mseLoss(ddp.forward(x), y));
        zero.step();
      }
      stateBytes[static_cast<size_t>(rank)] = zero.stateBytes();
      for (size_t i = 0; i < model->parameters().size(); ++i) owners[static_cast<size_t>(rank)].push_back(zero.ownerOf(i));
    });
    size_t total = 0;
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(owners[static_cast<size_t>(r)], owners[0]) << "ranks disagree on the shards";
      EXPECT_LT(stateBytes[static_cast<size_t>(r)], fullState) << "rank " << r;
      total += stateBytes[static_cast<size_t>(r)];
      auto params = models[static_cast<size_t>(r)]->parameters();
      auto want = reference->parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        expectClose(params[i].detach(), want[i].detach(), 1e-5, "n=" + std::to_string(n) + " rank " + std::to_string(r) +
                                                                    " parameter " + std::to_string(i));
      }
    }
    // The shards partition the state: together exactly one full Adam's worth.
    EXPECT_EQ(total, fullState);
  }
}


TEST(HorovodStyle, ConvertedLoopMatchesSingleProcessTraining) {
  // The conversion checklist's loop: broadcastParameters, HorovodOptimizer (fused gradient average, then
  // SGD), metricAverage. Three steps equal single-process SGD on the concatenated batch.
  constexpr int n = 2;
  constexpr int64_t kPerRank = 3;
  auto job = startJob("tcp", n);
  const Data data = makeData(n * kPerRank);
  auto reference = makeModel(100);
  SGD referenceSgd(reference->parameters(), SgdOptions{0.1, 0.9});
  double referenceLoss = 0;
  for (int step = 0; step < 3; ++step) {
    reference->zeroGrad();
    Tensor loss = distgrad::mseLoss(reference->forward(data.x), data.y);
    autograd::backward(std::vector<Tensor>{loss});
    referenceSgd.step();
    referenceLoss = loss.item();
  }
  std::vector<std::shared_ptr<Sequential>> models(n);
  std::vector<double> averagedLoss(n);
  std::vector<double> localLoss(n);
  onEveryRank(n, [&](int rank) {
    Horovod hvd(*job->cluster.agents[static_cast<size_t>(rank)]);
    EXPECT_EQ(hvd.rank(), rank);
    EXPECT_EQ(hvd.size(), n);
    auto model = makeModel(100 + static_cast<uint64_t>(rank));
    models[static_cast<size_t>(rank)] = model;
    SGD inner(model->parameters(), SgdOptions{0.1, 0.9});
    HorovodOptimizer optimizer(inner, hvd);
    hvd.broadcastParameters(*model);
    const Tensor x = distgrad::narrow(data.x, 0, rank * kPerRank, kPerRank).cloneData();
    const Tensor y = distgrad::narrow(data.y, 0, rank * kPerRank, kPerRank).cloneData();
    for (int step = 0; step < 3; ++step) {
      optimizer.zeroGrad();
      Tensor loss = distgrad::mseLoss(model->forward(x), y);
      autograd::backward(std::vector<Tensor>{loss});
      optimizer.step();
      localLoss[static_cast<size_t>(rank)] = loss.item();
      averagedLoss[static_cast<size_t>(rank)] = hvd.metricAverage(loss.item());
    }
  });
  // Equal shards: the mean of the ranks' mean losses is the loss of the whole batch.
  for (int r = 0; r < n; ++r) {
    EXPECT_NEAR(averagedLoss[static_cast<size_t>(r)], (localLoss[0] + localLoss[1]) / 2, 1e-12);
    EXPECT_NEAR(averagedLoss[static_cast<size_t>(r)], referenceLoss, 1e-5);
    auto params = models[static_cast<size_t>(r)]->parameters();
    auto want = reference->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      expectClose(params[i].detach(), want[i].detach(), 1e-5, "rank " + std::to_string(r) + " parameter " + std::to_string(i));
    }
  }
}

}  // namespace
}  // namespace distgrad::models
