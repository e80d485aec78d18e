// zero: data-parallel training on Fashion-MNIST with ZeRO stage 1 (ZeroRedundancyOptimizer): gradients
// averaged by DistributedDataParallel as in examples/ddp, but each rank keeps the optimizer state (Adam's
// two moments) of its own shard of the parameters only, steps that shard and broadcasts it to the others.
// The shards are equal element ranges (--partition elements, the default: 1/N of the state per rank) or
// whole tensors (--partition tensors: LeNet-5's first fully connected layer alone is ~3/4 of the model).
// One process per worker, launched by distgrad-run:
//
//   distgrad-run --nproc 2 -- zero [--model lenet5|resnet18|resnet50|mlp] [--width N] [--epochs N]
//                                  [--batch-size N] [--optimizer adam|sgd] [--lr X] [--seed N] [--limit N]
//                                  [--threads N] [--bucket-kb N] [--compression none|fp16|bf16]
//                                  [--partition elements|tensors] [--data-dir DIR] [--checkpoint PATH]
//
// After training rank 0 prints every rank's optimizer-state bytes beside what one full (unsharded)
// optimizer holds, saves the checkpoint and prints the final JSON line:
//   {"example":"zero","mode":"zero","workers":N,"optimizer_state_bytes_max":...,
//    "optimizer_state_bytes_full":...,"optimizer_state_fraction":...,"test_accuracy":...,...}
// The loop, flags and reporting are shared with examples/ddp (examples/data_parallel.h).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "examples/data_parallel.h"
#include "models/parallel/ddp.h"
#include "models/parallel/zero.h"

using namespace distgrad;

namespace {

// Bytes of per-parameter floating-point state in `optimizer` (stateDict's "<index>.<field>" entries:
// Adam's moments, not its step counters), as ZeroRedundancyOptimizer::stateBytes counts them.
size_t stateBytes(const models::optim::Optimizer& optimizer) {
  size_t bytes = 0;
  for (const auto& [name, value] : optimizer.stateDict()) {
    if (name.find('.') != std::string::npos && tensor::isFloatingPoint(value.dtype())) bytes += value.nbytes();
  }
  return bytes;
}

// What one full optimizer of the same kind holds for all of `parameters`: built over copies of them and
// stepped once with zero gradients (the state exists from the first update on). Measured, not computed
// from a formula, so it stays true for any optimizer --optimizer names.
size_t fullStateBytes(const models::optim::OptimizerSpec& spec, const std::vector<Tensor>& parameters) {
  std::vector<Tensor> copies;
  std::vector<Tensor> zeros;
  for (const Tensor& p : parameters) {
    copies.push_back(p.detach().cloneData().setRequiresGrad(true));
    zeros.push_back(Tensor::zeros(p.shape(), p.dtype()));
  }
  auto full = spec.make(copies);
  full->step(zeros);
  return stateBytes(*full);
}

}  // namespace

int main(int argc, char** argv) {
  examples::DataParallelFlags opt;
  std::string partition = "elements";
  examples::parseDataParallelFlags("zero", "trains a zoo model on Fashion-MNIST with DDP and ZeRO-1 "
                                   "(optimizer state sharded over the ranks)", opt, argc, argv,
                                   [&](examples::Flags& flags) {
                                     flags.add("--partition", partition, "shard by elements or by tensors");
                                   });
  if (partition != "elements" && partition != "tensors") {
    std::cerr << "zero: --partition must be elements or tensors\n";
    return 2;
  }
  models::ZeroOptions zeroOptions;
  zeroOptions.partition = partition == "tensors" ? models::ZeroPartition::kTensors : models::ZeroPartition::kElements;
  return examples::runDataParallel("zero", opt, [&](rpc::Agent&, rpc::collectives::ProcessGroup& group) {
    const int rank = group.rank();
    const examples::Data data = examples::loadFashionMnist(opt.dataDir, opt.limit);
    auto model = examples::buildReplica(opt, rank);
    models::DistributedDataParallel ddp(*model, group, opt.ddpOptions());  // broadcasts rank 0's weights
    const models::optim::OptimizerSpec spec = opt.optimizerSpec();
    models::ZeroRedundancyOptimizer optimizer(
        model->parameters(), group, [&](std::vector<Tensor> shard) { return spec.make(std::move(shard)); },
        zeroOptions);
    if (rank == 0) {
      std::printf("zero: %d workers, %s, %s sharded over the ranks by %s (rank 0 owns %lld elements of %zu of "
                  "the %zu parameter tensors), batch %lld per rank, %lld train / %lld test images\n",
                  group.size(), opt.modelSpec().describe().c_str(), spec.describe().c_str(), partition.c_str(),
                  static_cast<long long>(optimizer.shardElements()), optimizer.shard().size(),
                  model->parameters().size(), static_cast<long long>(opt.batchSize),
                  static_cast<long long>(data.train.size()), static_cast<long long>(data.test.size()));
    }
    const examples::TrainSummary summary =
        examples::trainDataParallel("zero", *model, ddp, group, data, opt, [&] { optimizer.step(); });

    // Every rank's share of the optimizer state, gathered on all (a collective), beside one full optimizer's.
    const Tensor mine = Tensor::fromVector(std::vector<int64_t>{static_cast<int64_t>(optimizer.stateBytes())}, {1});
    const std::vector<int64_t> perRank = group.allGatherSync(mine).toVector<int64_t>();
    if (rank == 0) {
      const auto full = static_cast<int64_t>(fullStateBytes(spec, model->parameters()));
      int64_t sum = 0;
      for (size_t r = 0; r < perRank.size(); ++r) {
        std::printf("zero: rank %zu holds %.3f MiB of optimizer state (%.1f%% of a full %s's %.3f MiB)\n", r,
                    static_cast<double>(perRank[r]) / (1 << 20), 100.0 * static_cast<double>(perRank[r]) / full,
                    opt.optimizer.c_str(), static_cast<double>(full) / (1 << 20));
        sum += perRank[r];
      }
      const int64_t largest = *std::max_element(perRank.begin(), perRank.end());
      examples::saveOnRankZero(*model, opt.checkpoint);
      examples::dataParallelJson("zero", "zero", group.size(), opt, ddp, summary)
          .add("partition", partition)
          .add("optimizer_state_bytes_max", largest)
          .add("optimizer_state_bytes_sum", sum)
          .add("optimizer_state_bytes_full", full)
          .add("optimizer_state_fraction", static_cast<double>(largest) / static_cast<double>(full))
          .add("optimizer_state_partitioned", sum == full)
          .print();
    }
  });
}
