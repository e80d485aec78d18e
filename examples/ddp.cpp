// ddp: data-parallel training on Fashion-MNIST with DistributedDataParallel, one process per worker
// (launched by distgrad-run, torchrun-style environment):
//
//   distgrad-run --nproc 2 -- ddp [--model lenet5|resnet18|resnet50|mlp] [--width N] [--epochs N]
//                                 [--batch-size N] [--optimizer adam|sgd] [--lr X] [--seed N] [--limit N]
//                                 [--threads N] [--bucket-kb N] [--compression none|fp16|bf16]
//                                 [--data-dir DIR] [--checkpoint PATH]
//
// Every rank holds a replica (rank 0's initial weights, broadcast by DDP) and trains on its own shard of
// each epoch (DistributedSampler: disjoint, same size on every rank); gradients are averaged by bucketed
// all-reduces that start during backward, and every rank steps its own full optimizer. Per epoch rank 0
// prints the loss averaged over ranks, images/s of all ranks and the test accuracy; it alone saves the
// checkpoint and prints the final JSON line:
//   {"example":"ddp","mode":"ddp","workers":N,"test_accuracy":...,"images_per_s":...,...}
// The loop, flags and reporting are shared with examples/zero (examples/data_parallel.h).
#include <memory>

#include "examples/data_parallel.h"
#include "models/parallel/ddp.h"

using namespace distgrad;

int main(int argc, char** argv) {
  examples::DataParallelFlags opt;
  examples::parseDataParallelFlags("ddp", "trains a zoo model on Fashion-MNIST with DistributedDataParallel "
                                   "(one process per rank)", opt, argc, argv);
  return examples::runDataParallel("ddp", opt, [&](rpc::Agent&, rpc::collectives::ProcessGroup& group) {
    const examples::Data data = examples::loadFashionMnist(opt.dataDir, opt.limit);
    auto model = examples::buildReplica(opt, group.rank());
    models::DistributedDataParallel ddp(*model, group, opt.ddpOptions());  // broadcasts rank 0's weights
    auto optimizer = opt.optimizerSpec().make(model->parameters());
    if (group.rank() == 0) {
      std::printf("ddp: %d workers, %s, %s, batch %lld per rank, %lld train / %lld test images\n", group.size(),
                  opt.modelSpec().describe().c_str(), opt.optimizerSpec().describe().c_str(),
                  static_cast<long long>(opt.batchSize), static_cast<long long>(data.train.size()),
                  static_cast<long long>(data.test.size()));
    }
    const examples::TrainSummary summary =
        examples::trainDataParallel("ddp", *model, ddp, group, data, opt, [&] { optimizer->step(); });
    if (group.rank() == 0) {
      examples::saveOnRankZero(*model, opt.checkpoint);
      examples::dataParallelJson("ddp", "ddp", group.size(), opt, ddp, summary).print();
    }
  });
}
