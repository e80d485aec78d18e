// rpc_ddp_hybrid: the shape of PyTorch's "Combining Distributed DataParallel with Distributed RPC
// Framework" tutorial on distgrad, three processes through distgrad-run:
//
//   distgrad-run --nproc 3 -- rpc_ddp_hybrid [--steps N] [--batch-size N] [--lr X] [--seed N]
//
//   worker0  trainer: looks rows up remotely, a DDP-wrapped Linear head locally
//   worker1  trainer: the same, with its own data
//   worker2  parameter server: holds an Embedding table (a RemoteModule) shared by both trainers
//
// Each trainer step runs in a distributed autograd context: the embedding lookup is an RPC to worker2
// (recorded in the context), the head is DistributedDataParallel over the trainers' group, ddp.backward(ctx,
// loss) runs the distributed backward (gradients reach the table on worker2) and averages the head's
// gradients over both trainers, and a DistributedOptimizer steps the table on worker2 and the head locally
// from that context's gradients. worker0 creates the table and hands it to worker1 in an RPC.
// The task is synthetic (an index's class is index % classes), so learning shows in a few hundred steps.
// worker0 prints the final JSON line:
//   {"example":"rpc_ddp_hybrid","mode":"rpc_ddp","workers":3,"test_accuracy":...,"initial_loss":...,...}
#include <cstdio>
#include <future>
#include <iostream>
#include <mutex>

#include "autograd/distributed/dist_autograd.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "examples/example_util.h"
#include "examples/remote_modules.h"
#include "models/nn/embedding.h"
#include "models/nn/linear.h"
#include "models/optim/distributed_optimizer.h"
#include "models/parallel/ddp.h"
#include "rpc/agent.h"
#include "rpc/collectives/process_group.h"
#include "rref/remote_module.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/random.h"

using namespace distgrad;
using models::Embedding;
using models::Linear;

namespace hybrid {
// worker0 -> worker1: the shared table.
inline const rpc::Function<void(rref::RemoteModule<Embedding>)> kShareTable{"hybrid.share_table"};
}  // namespace hybrid

namespace {

constexpr int64_t kRows = 64;
constexpr int64_t kDim = 16;
constexpr int64_t kClasses = 4;

struct Options {
  std::string device = "cpu";  // --device
  int64_t steps = 300;
  int64_t batchSize = 32;
  double lr = 0.1;
  uint64_t seed = 0;
};

Options parseArgs(int argc, char** argv) {
  Options o;
  examples::Flags flags("rpc_ddp_hybrid",
                        "DDP trainers with an embedding table on a parameter server (3 processes: ps + 2 trainers)");
  flags.add("--steps", o.steps, "training steps per trainer")
      .add("--batch-size", o.batchSize, "indices per step on each trainer")
      .add("--lr", o.lr, "SGD learning rate (table and head)")
      .add("--seed", o.seed, "initialisation and data seed")
      .add("--device", o.device, examples::kDeviceHelp);
  flags.parse(argc, argv);
  (void)examples::cpuOnlyDeviceFromFlag(flags, o.device,
                                        "DistributedDataParallel's buckets and collectives are host-only, and the "
                                        "embedding table's lookups cross RPC as host tensors");
  flags.require(o.steps >= 1 && o.batchSize >= 1 && o.lr > 0, "--steps, --batch-size must be >= 1, --lr > 0");
  return o;
}

// Indices and their classes (index % kClasses).
std::pair<Tensor, Tensor> batchOf(tensor::Generator& gen, int64_t n) {
  std::vector<int64_t> indices(static_cast<size_t>(n)), labels(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    indices[static_cast<size_t>(i)] = static_cast<int64_t>(gen.below(kRows));
    labels[static_cast<size_t>(i)] = indices[static_cast<size_t>(i)] % kClasses;
  }
  return {Tensor::fromVector(indices, {n}), Tensor::fromVector(labels, {n})};
}

}  // namespace

int main(int argc, char** argv) {
  Options opt = parseArgs(argc, argv);
  try {
    tensor::setNumThreads(1);
    std::promise<rref::RemoteModule<Embedding>> shared;
    std::mutex sharedMutex;
    rpc::Registry reg;
    examples::installRemoteModules(reg);  // RRefs, distributed autograd, the server's Embedding table
    rpc::collectives::install(reg);
    reg.bind(hybrid::kShareTable, [&](rref::RemoteModule<Embedding> table) {
      std::lock_guard<std::mutex> lock(sharedMutex);
      shared.set_value(std::move(table));
    });
    auto agent = rpc::Agent::start(rpc::Options::fromEnv(), reg);
    if (agent->worldSize() != 3) {
      std::cerr << "rpc_ddp_hybrid: needs 3 workers (a parameter server and 2 trainers), got "
                << agent->worldSize() << "\n";
      agent->shutdown();
      return 1;
    }
    const int rank = agent->rank();
    if (rank != 2) {
      rpc::collectives::ProcessGroup trainers(*agent, {"worker0", "worker1"});
      rref::RemoteModule<Embedding> table = [&] {
        if (rank == 0) {
          auto created = rref::RemoteModule<Embedding>::create(*agent, "worker2", kRows, kDim, opt.seed);
          agent->rpcSync("worker1", hybrid::kShareTable, created);
          return created;
        }
        return shared.get_future().get();
      }();
      // Different initial heads on purpose: DDP broadcasts worker0's.
      tensor::Generator gen(opt.seed + 100 + static_cast<uint64_t>(rank));
      Linear head(kDim, kClasses, gen);
      models::DistributedDataParallel ddp(head, trainers);
      models::optim::DistributedOptimizer optimizer(
          *agent, models::optim::OptimizerSpec::sgd({.learningRate = opt.lr}),
          table.remoteParameters(), head.parameters());

      tensor::Generator data(opt.seed * 7919 + static_cast<uint64_t>(rank));
      double initialLoss = 0, finalLoss = 0;
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t step = 0; step < opt.steps; ++step) {
        auto [indices, labels] = batchOf(data, opt.batchSize);
        autograd::distributed::DistContext ctx(*agent);
        Tensor loss = crossEntropy(ddp.forward(table.forward(indices)), labels);
        ddp.backward(ctx, loss);
        optimizer.step(ctx);
        if (step == 0) initialLoss = loss.item();
        finalLoss = loss.item();
      }
      const double seconds = examples::secondsSince(t0);
      // Both trainers' final loss, averaged; accuracy on every row of the table.
      Tensor stats = Tensor::fromVector(std::vector<double>{initialLoss, finalLoss}, {2});
      trainers.allReduceSync(stats, {rpc::collectives::ReduceOp::kMean});
      std::vector<int64_t> all(kRows);
      for (int64_t i = 0; i < kRows; ++i) all[static_cast<size_t>(i)] = i;
      Tensor logits;
      {
        autograd::NoGradGuard noGrad;
        logits = head.forward(table.forward(Tensor::fromVector(all, {kRows})));
      }
      const auto predicted = argmax(logits, 1).toVector<int64_t>();
      int64_t correct = 0;
      for (int64_t i = 0; i < kRows; ++i) correct += predicted[static_cast<size_t>(i)] == i % kClasses ? 1 : 0;
      const auto headWeights = head.weight().toVector<float>();
      Tensor headSum = Tensor::fromVector(std::vector<double>{static_cast<double>(headWeights[0])}, {1});
      trainers.allReduceSync(headSum, {rpc::collectives::ReduceOp::kMax});
      const bool replicasAgree = headSum.item() == static_cast<double>(headWeights[0]);
      trainers.barrierSync();
      if (rank == 0) {
        const auto s = stats.toVector<double>();
        examples::JsonLine("rpc_ddp_hybrid")
            .add("mode", "rpc_ddp")
            .add("workers", int64_t{3})
            .add("trainers", int64_t{2})
            .add("steps", opt.steps)
            .add("batch_size_per_trainer", opt.batchSize)
            .add("initial_loss", s[0])
            .add("final_loss", s[1])
            .add("test_accuracy", static_cast<double>(correct) / static_cast<double>(kRows))
            .add("replicas_agree", replicasAgree)
            .add("steps_per_s", static_cast<double>(opt.steps) / seconds)
            .add("peak_rss_mib", examples::peakRssMiB())
            .print();
      }
    }
    agent->shutdown();  // the parameter server waits here until both trainers are done
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "rpc_ddp_hybrid: error: " << e.what() << "\n";
    return 1;
  }
}
