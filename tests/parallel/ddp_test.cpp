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

// Single-process SGD + momentum on the whole of `data` for `steps` steps from rank 0's initial weights
// (seed 100): each step's gradients and the parameters after it.
struct Reference {
  std::vector<std::vector<Tensor>> grads;
  std::vector<std::vector<Tensor>> params;
};
Reference singleProcessReference(const Data& data, int steps) {
  auto model = makeModel(100);
  SGD optimizer(model->parameters(), SgdOptions{0.1, 0.9});
  Reference out;
  for (int step = 0; step < steps; ++step) {
    model->zeroGrad();
    autograd::backward(std::vector<Tensor>{distgrad::mseLoss(model->forward(data.x), data.y)});
    std::vector<Tensor> grads;
    for (const Tensor& p : model->parameters()) grads.push_back(p.grad().cloneData());
    out.grads.push_back(std::move(grads));
    optimizer.step();
    std::vector<Tensor> params;
    for (const Tensor& p : model->parameters()) params.push_back(p.detach().cloneData());
    out.params.push_back(std::move(params));
  }
  return out;
}

enum class Mode { kLocal, kDistAutograd };

// The gradients distributed autograd gathered in `ctx` for `model`'s parameters (copies), checking that
// .grad stayed untouched.
std::vector<Tensor> contextGradients(autograd::distributed::DistContext& ctx, Module& model) {
  std::vector<Tensor> grads;
  auto inContext = ctx.gradients();
  for (const Tensor& p : model.parameters()) {
    EXPECT_FALSE(p.grad().defined()) << "distributed autograd must not touch .grad";
    grads.push_back(inContext.get(p).cloneData());
  }
  return grads;
}

void expectGradients(const std::vector<Tensor>& grads, const std::vector<Tensor>& reference, int rank, int step) {
  ASSERT_EQ(grads.size(), reference.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    expectClose(grads[i], reference[i], 1e-6,
                "rank " + std::to_string(rank) + " step " + std::to_string(step) + " gradient " + std::to_string(i));
  }
}

class Ddp : public ::testing::TestWithParam<std::tuple<std::string, int, Mode>> {};

TEST_P(Ddp, GradientsEqualSingleProcessOnTheConcatenatedBatch) {
  const auto [transport, n, mode] = GetParam();
  constexpr int64_t kPerRank = 5;
  constexpr int kSteps = 3;
  auto job = startJob(transport, n);
  const Data data = makeData(n * kPerRank);

  const auto [referenceGrads, referenceParams] = singleProcessReference(data, kSteps);

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
        grads = contextGradients(ctx, *model);
        optimizer.step(grads);
      }
      expectGradients(grads, referenceGrads[static_cast<size_t>(step)], rank, step);
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

// noSync(): K passes accumulate locally without communication, the (K+1)-th all-reduces the accumulated
// sum. Each rank runs K+1 micro-batches of kPerRank rows, each loss scaled by 1/(K+1) (the usual gradient
// accumulation), so the result is the single-process gradient of the mean loss over all n(K+1)kPerRank rows.
class DdpNoSync : public ::testing::TestWithParam<std::tuple<std::string, int, Mode>> {};

TEST_P(DdpNoSync, AccumulatedThenSynchronisedGradientsEqualSingleProcessOnAllBatches) {
  const auto [transport, n, mode] = GetParam();
  constexpr int64_t kPerRank = 3;
  constexpr int kAccumulate = 2;  // K passes under noSync(), then one synchronised pass
  constexpr int kMicro = kAccumulate + 1;
  constexpr int kSteps = 2;       // two optimizer steps: the second window starts from a clean state
  auto job = startJob(transport, n);
  const Data data = makeData(static_cast<int64_t>(n) * kMicro * kPerRank);
  // Rows of rank r's micro-batch m: [(m * n + r) * kPerRank, +kPerRank).
  auto rowsOf = [&](const Tensor& t, int rank, int micro) {
    return distgrad::narrow(t, 0, (static_cast<int64_t>(micro) * n + rank) * kPerRank, kPerRank).cloneData();
  };

  const auto referenceGrads = singleProcessReference(data, kSteps).grads;

  // Each rank's gradients right after its first pass under noSync() in step 0.
  std::vector<std::vector<Tensor>> afterFirstPass(static_cast<size_t>(n));
  onEveryRank(n, [&](int rank) {
    rpc::Agent& agent = *job->cluster.agents[static_cast<size_t>(rank)];
    auto model = makeModel(100 + static_cast<uint64_t>(rank));
    DdpOptions options;
    options.bucketBytes = 300;  // several buckets, launched during the synchronised backward
    DistributedDataParallel ddp(*model, *job->groups[static_cast<size_t>(rank)], options);
    SGD optimizer(model->parameters(), SgdOptions{0.1, 0.9});
    for (int step = 0; step < kSteps; ++step) {
      model->zeroGrad();
      std::vector<Tensor> grads;
      auto lossOf = [&](int micro) {
        return distgrad::mseLoss(ddp.forward(rowsOf(data.x, rank, micro)), rowsOf(data.y, rank, micro)) *
               (1.0 / kMicro);
      };
      if (mode == Mode::kLocal) {
        for (int micro = 0; micro < kAccumulate; ++micro) {
          auto guard = ddp.noSync();
          ddp.backward(lossOf(micro));
          if (step == 0 && micro == 0) {
            for (const Tensor& p : model->parameters()) afterFirstPass[static_cast<size_t>(rank)].push_back(p.grad().cloneData());
          }
        }
        ddp.backward(lossOf(kAccumulate));
        for (const Tensor& p : model->parameters()) grads.push_back(p.grad());
        optimizer.step();
      } else {
        autograd::distributed::DistContext ctx(agent);
        {
          auto guard = ddp.noSync();
          for (int micro = 0; micro < kAccumulate; ++micro) {
            ddp.backward(ctx, lossOf(micro));
            if (step == 0 && micro == 0) {
              auto inContext = ctx.gradients();
              for (const Tensor& p : model->parameters()) {
                afterFirstPass[static_cast<size_t>(rank)].push_back(inContext.get(p).cloneData());
              }
            }
          }
        }
        ddp.backward(ctx, lossOf(kAccumulate));
        grads = contextGradients(ctx, *model);
        optimizer.step(grads);
      }
      expectGradients(grads, referenceGrads[static_cast<size_t>(step)], rank, step);
    }
  });
  // Under noSync() nothing was averaged: after the first pass each rank holds the gradient of its own
  // micro-batch alone (from rank 0's initial weights, which DDP broadcast), so accumulation was local.
  for (int r = 0; r < n; ++r) {
    auto local = makeModel(100);
    autograd::backward(std::vector<Tensor>{
        distgrad::mseLoss(local->forward(rowsOf(data.x, r, 0)), rowsOf(data.y, r, 0)) * (1.0 / kMicro)});
    auto params = local->parameters();
    ASSERT_EQ(afterFirstPass[static_cast<size_t>(r)].size(), params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      expectClose(afterFirstPass[static_cast<size_t>(r)][i], params[i].grad(), 1e-6,
                  "rank " + std::to_string(r) + " local gradient " + std::to_string(i));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    RanksTransportsModes, DdpNoSync,
    ::testing::Combine(::testing::Values("inproc", "tcp"), ::testing::Values(2, 3),
                       ::testing::Values(Mode::kLocal, Mode::kDistAutograd)),
    [](const ::testing::TestParamInfo<std::tuple<std::string, int, Mode>>& info) {
      return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "ranks_" +
             (std::get<2>(info.param) == Mode::kLocal ? "local" : "dist_autograd");
    });

TEST(DdpSetup, NoSyncGradientsCannotBeSynchronisedInAnotherContextOrInsideTheGuard) {
  // A new distributed autograd context starts without the gradients accumulated in the previous one, so
  // synchronising there would silently drop them: a ValueError says so, on every rank, and the DDP stays
  // usable (a clean step afterwards averages as usual).
  auto job = startJob("inproc", 2);
  const Data data = makeData(4);
  std::vector<std::string> errors(2);
  std::vector<std::vector<Tensor>> grads(2);
  onEveryRank(2, [&](int rank) {
    rpc::Agent& agent = *job->cluster.agents[static_cast<size_t>(rank)];
    auto model = makeModel(5);
    DistributedDataParallel ddp(*model, *job->groups[static_cast<size_t>(rank)]);
    const Tensor x = distgrad::narrow(data.x, 0, rank * 2, 2).cloneData();
    const Tensor y = distgrad::narrow(data.y, 0, rank * 2, 2).cloneData();
    {
      autograd::distributed::DistContext first(agent);
      auto guard = ddp.noSync();
      ddp.backward(first, distgrad::mseLoss(ddp.forward(x), y));
      EXPECT_THROW(ddp.synchronize(first), ValueError);
    }
    {
      autograd::distributed::DistContext second(agent);
      try {
        ddp.forward(x);
      } catch (const ValueError& e) {
        errors[static_cast<size_t>(rank)] = e.what();
      }
    }
    model->zeroGrad();
    ddp.backward(distgrad::mseLoss(ddp.forward(x), y));
    for (const Tensor& p : model->parameters()) grads[static_cast<size_t>(rank)].push_back(p.grad());
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[static_cast<size_t>(r)].find("cannot be synchronised in distributed autograd context"),
              std::string::npos)
        << "rank " << r << ": " << errors[static_cast<size_t>(r)];
  }
  auto single = makeModel(5);
  autograd::backward(std::vector<Tensor>{distgrad::mseLoss(single->forward(data.x), data.y)});
  auto params = single->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    expectClose(grads[0][i], params[i].grad(), 1e-6, "rank 0 parameter " + std::to_string(i));
    expectClose(grads[1][i], params[i].grad(), 1e-6, "rank 1 parameter " + std::to_string(i));
  }
}

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

// The floating-point per-parameter state of an optimizer (Adam's moments; not its int64 step counters).
size_t momentBytes(const optim::Optimizer& optimizer) {
  size_t bytes = 0;
  for (const auto& [name, value] : optimizer.stateDict()) {
    if (name.find('.') != std::string::npos && tensor::isFloatingPoint(value.dtype())) bytes += value.nbytes();
  }
  return bytes;
}

class Zero : public ::testing::TestWithParam<ZeroPartition> {};

TEST_P(Zero, ShardedAdamMatchesSingleProcessAdamWithAFractionOfTheState) {
  // DDP averages the gradients; ZeRO-1 steps each rank's shard with Adam and broadcasts it back. Three
  // steps equal single-process Adam on the concatenated batch, and each rank keeps only its shard's moments.
  const ZeroPartition partition = GetParam();
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
    const size_t fullState = momentBytes(referenceAdam);
    int64_t totalElements = 0;
    for (const Tensor& p : reference->parameters()) totalElements += p.numel();
    std::vector<std::shared_ptr<Sequential>> models(static_cast<size_t>(n));
    std::vector<size_t> stateBytes(static_cast<size_t>(n));
    std::vector<int64_t> elements(static_cast<size_t>(n));
    std::vector<std::vector<ZeroRedundancyOptimizer::Piece>> pieces(static_cast<size_t>(n));
    onEveryRank(n, [&](int rank) {
      auto model = makeModel(100 + static_cast<uint64_t>(rank));
      models[static_cast<size_t>(rank)] = model;
      ProcessGroup& group = *job->groups[static_cast<size_t>(rank)];
      DistributedDataParallel ddp(*model, group);
      ZeroRedundancyOptimizer zero(
          model->parameters(), group,
          [](std::vector<Tensor> shard) {
            return std::make_unique<optim::Adam>(std::move(shard), optim::AdamOptions{.learningRate = 0.01});
          },
          ZeroOptions{.partition = partition});
      const Tensor x = distgrad::narrow(data.x, 0, rank * kPerRank, kPerRank).cloneData();
      const Tensor y = distgrad::narrow(data.y, 0, rank * kPerRank, kPerRank).cloneData();
      for (int step = 0; step < 3; ++step) {
        zero.zeroGrad();
        ddp.backward(distgrad::mseLoss(ddp.forward(x), y));
        zero.step();
      }
      stateBytes[static_cast<size_t>(rank)] = zero.stateBytes();
      elements[static_cast<size_t>(rank)] = zero.shardElements();
      pieces[static_cast<size_t>(rank)] = zero.pieces();
    });
    size_t total = 0;
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(pieces[static_cast<size_t>(r)], pieces[0]) << "ranks disagree on the shards";
      EXPECT_LT(stateBytes[static_cast<size_t>(r)], fullState) << "rank " << r;
      // The state is exactly the moments of the elements the rank owns.
      EXPECT_EQ(stateBytes[static_cast<size_t>(r)], static_cast<size_t>(elements[static_cast<size_t>(r)]) * 2 * 4);
      if (partition == ZeroPartition::kElements) {
        // Balanced to the element: floor or ceil of total / n.
        EXPECT_LE(std::abs(elements[static_cast<size_t>(r)] * n - totalElements), n) << "rank " << r;
      }
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
    // The pieces cover every element once, in order.
    int64_t covered = 0;
    for (const auto& piece : pieces[0]) covered += piece.length;
    EXPECT_EQ(covered, totalElements);
  }
}

INSTANTIATE_TEST_SUITE_P(Partitions, Zero, ::testing::Values(ZeroPartition::kElements, ZeroPartition::kTensors),
                         [](const ::testing::TestParamInfo<ZeroPartition>& info) {
                           return info.param == ZeroPartition::kElements ? "elements" : "tensors";
                         });

TEST(ZeroSetup, ElementPartitionSplitsADominantTensorEvenly) {
  // One tensor holds ~99% of the elements: whole-tensor sharding leaves it on one rank, the element
  // partition splits it, so each of 2 ranks holds half the moments and the split tensor's two halves are
  // stepped by different ranks (and broadcast back) to give the single-process result.
  auto job = startJob("inproc", 2);
  Generator gen(3);
  auto reference = std::make_shared<Sequential>();
  reference->add(std::make_shared<Linear>(64, 64, gen));  // 4160 elements
  reference->add(std::make_shared<Linear>(64, 1, gen));   // 65
  const Tensor x = tensor::uniform({4, 64}, -1.0, 1.0, gen);
  const Tensor y = tensor::uniform({4, 1}, -1.0, 1.0, gen);
  std::vector<std::vector<float>> after(2);
  std::vector<int64_t> elements(2);
  std::vector<size_t> shardSizes(2);
  onEveryRank(2, [&](int rank) {
    Generator same(3);
    auto model = std::make_shared<Sequential>();
    model->add(std::make_shared<Linear>(64, 64, same));
    model->add(std::make_shared<Linear>(64, 1, same));
    ProcessGroup& group = *job->groups[static_cast<size_t>(rank)];
    DistributedDataParallel ddp(*model, group);
    ZeroRedundancyOptimizer zero(model->parameters(), group, [](std::vector<Tensor> shard) {
      return std::make_unique<optim::Adam>(std::move(shard), optim::AdamOptions{.learningRate = 0.05});
    });
    const Tensor xs = distgrad::narrow(x, 0, rank * 2, 2).cloneData();
    const Tensor ys = distgrad::narrow(y, 0, rank * 2, 2).cloneData();
    for (int step = 0; step < 2; ++step) {
      zero.zeroGrad();
      ddp.backward(distgrad::mseLoss(ddp.forward(xs), ys));
      zero.step();
    }
    elements[static_cast<size_t>(rank)] = zero.shardElements();
    shardSizes[static_cast<size_t>(rank)] = zero.shard().size();
    after[static_cast<size_t>(rank)] = model->parameters()[0].toVector<float>();
  });
  EXPECT_EQ(elements[0], 2112);
  EXPECT_EQ(elements[1], 2113);
  EXPECT_EQ(shardSizes[0], 1u);  // the first half of the 64x64 weight
  EXPECT_EQ(shardSizes[1], 4u);  // its second half, the bias and the second layer
  optim::Adam referenceAdam(reference->parameters(), optim::AdamOptions{.learningRate = 0.05});
  for (int step = 0; step < 2; ++step) {
    reference->zeroGrad();
    autograd::backward(std::vector<Tensor>{distgrad::mseLoss(reference->forward(x), y)});
    referenceAdam.step();
  }
  const auto want = reference->parameters()[0].toVector<float>();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(after[static_cast<size_t>(r)].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(after[static_cast<size_t>(r)][i], want[i], 1e-5) << r << " " << i;
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
