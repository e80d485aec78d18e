// ddp: data-parallel training of LeNet-5 on Fashion-MNIST with DistributedDataParallel, one process per
// worker (launched by distgrad-run, torchrun-style environment):
//
//   distgrad-run --nproc 2 -- ddp [--epochs N] [--batch-size N] [--lr X] [--seed N] [--limit N]
//                                 [--bucket-kb N] [--compression none|fp16|bf16] [--data-dir DIR]
//                                 [--checkpoint PATH]
//
// Every rank holds a replica (rank 0's initial weights, broadcast by DDP) and trains on its own shard of
// each epoch (DistributedSampler: disjoint, same size on every rank); gradients are averaged by bucketed
// all-reduces that start during backward. The epoch's loss is averaged over ranks with one more
// all-reduce; every rank evaluates the (identical) model on its shard of the test set and the correct
// counts are summed. Only rank 0 saves the checkpoint and prints the final JSON line:
//   {"example":"ddp","mode":"ddp","workers":N,"test_accuracy":...,"images_per_s":...,...}
// images_per_s counts the images of all ranks.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "examples/example_util.h"
#include "models/checkpoint.h"
#include "models/data/data_loader.h"
#include "models/data/sampler.h"
#include "models/optim/adam.h"
#include "models/parallel/ddp.h"
#include "models/zoo/lenet.h"
#include "rpc/agent.h"
#include "rpc/collectives/process_group.h"
#include "tensor/cpu/dnnl_context.h"

using namespace distgrad;
namespace data = distgrad::models::data;
using rpc::collectives::ProcessGroup;

namespace {

struct Options {
  int64_t epochs = 1;
  int64_t batchSize = 32;  // per rank
  double lr = 2e-3;
  uint64_t seed = 0;
  int64_t limit = 0;
  int64_t bucketKb = 25 * 1024;
  std::string compression = "none";
  std::string dataDir;
  std::string checkpoint = "checkpoints/ddp.ckpt";
};

Options parseArgs(int argc, char** argv) {
  Options o;
  examples::Flags flags("ddp", "trains LeNet-5 on Fashion-MNIST with DistributedDataParallel (one process per rank)");
  flags.add("--epochs", o.epochs, "passes over the training set")
      .add("--batch-size", o.batchSize, "images per step on each rank")
      .add("--lr", o.lr, "Adam learning rate")
      .add("--seed", o.seed, "initialisation and shuffling seed")
      .add("--limit", o.limit, "use only the first N training and test images (0 = all)")
      .add("--bucket-kb", o.bucketKb, "gradient bucket size in KB")
      .add("--compression", o.compression, "gradients on the wire: none, fp16 or bf16")
      .add("--data-dir", o.dataDir, "Fashion-MNIST directory (default: the Debian package's)")
      .add("--checkpoint", o.checkpoint, "where rank 0 saves the trained model");
  flags.parse(argc, argv);
  flags.require(o.epochs >= 1 && o.batchSize >= 1 && o.lr > 0 && o.limit >= 0 && o.bucketKb >= 1,
                "--epochs, --batch-size, --bucket-kb must be >= 1, --lr > 0, --limit >= 0");
  flags.require(o.compression == "none" || o.compression == "fp16" || o.compression == "bf16",
                "--compression must be none, fp16 or bf16");
  return o;
}

rpc::collectives::WireCompression compressionOf(const std::string& name) {
  if (name == "fp16") return rpc::collectives::WireCompression::kFloat16;
  if (name == "bf16") return rpc::collectives::WireCompression::kBFloat16;
  return rpc::collectives::WireCompression::kNone;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt = parseArgs(argc, argv);
  try {
    tensor::setNumThreads(1);
    rpc::Registry registry;
    rpc::collectives::install(registry);
    auto agent = rpc::Agent::start(rpc::Options::fromEnv(), registry);
    const int rank = agent->rank();
    const int world = agent->worldSize();
    {
      ProcessGroup group = ProcessGroup::world(*agent);
      examples::Data loaded = examples::loadFashionMnist(opt.dataDir, opt.limit);
      if (rank == 0) {
        std::printf("ddp: %d workers, Fashion-MNIST %lld train / %lld test images, LeNet-5, Adam lr %g, batch %lld "
                    "per rank (%lld global)\n",
                    world, static_cast<long long>(loaded.train.size()), static_cast<long long>(loaded.test.size()),
                    opt.lr, static_cast<long long>(opt.batchSize), static_cast<long long>(opt.batchSize * world));
      }

      // Seeds differ per rank on purpose: DDP's broadcast makes every replica start from rank 0's weights.
      tensor::Generator gen(opt.seed + static_cast<uint64_t>(rank));
      auto model = std::make_shared<models::LeNet5>(gen);
      models::DdpOptions ddpOptions;
      ddpOptions.bucketBytes = static_cast<size_t>(opt.bucketKb) * 1024;
      ddpOptions.compression = compressionOf(opt.compression);
      models::DistributedDataParallel ddp(*model, group, ddpOptions);
      models::optim::Adam optimizer(model->parameters(), {.learningRate = opt.lr});
      auto sampler = std::make_shared<data::DistributedSampler>(loaded.train.size(), world, rank, true, opt.seed);
      data::DataLoader loader(loaded.train, {.batchSize = opt.batchSize}, sampler);

      double trainSeconds = 0;
      int64_t trainImages = 0;  // all ranks
      double accuracy = 0;
      size_t overlappedBuckets = 0;
      for (int64_t epoch = 1; epoch <= opt.epochs; ++epoch) {
        sampler->setEpoch(epoch);
        group.barrierSync();  // time the epoch from a common start
        auto t0 = std::chrono::steady_clock::now();
        int64_t steps = 0;
        double lossSum = 0;
        int64_t images = 0;
        for (const auto& batch : loader) {
          model->zeroGrad();
          Tensor loss = crossEntropy(ddp.forward(batch.inputs), batch.labels);
          ddp.backward(loss);
          optimizer.step();
          overlappedBuckets += ddp.bucketsLaunchedDuringBackward();
          lossSum += loss.item();
          images += batch.size();
          ++steps;
        }
        // Horovod's metric_average: the mean of the ranks' mean losses; images summed over ranks.
        Tensor stats = Tensor::fromVector(std::vector<double>{lossSum / static_cast<double>(std::max<int64_t>(steps, 1)),
                                                              static_cast<double>(images)},
                                          {2});
        group.allReduceSync(stats);
        const double seconds = examples::secondsSince(t0);
        trainSeconds += seconds;
        const double meanLoss = stats.toVector<double>()[0] / world;
        const auto globalImages = static_cast<int64_t>(stats.toVector<double>()[1]);
        trainImages += globalImages;

        // Test accuracy: each rank scores its shard of the test set; the correct counts are summed.
        model->eval();
        const int64_t begin = loaded.test.size() * rank / world;
        const int64_t end = loaded.test.size() * (rank + 1) / world;
        double correct = 0;
        {
          autograd::NoGradGuard noGrad;
          for (int64_t start = begin; start < end; start += 256) {
            const int64_t count = std::min<int64_t>(256, end - start);
            Tensor logits = model->forward(narrow(loaded.test.inputs(), 0, start, count));
            const auto predicted = argmax(logits, 1).toVector<int64_t>();
            const auto labels = narrow(loaded.test.labels(), 0, start, count).toVector<int64_t>();
            for (size_t i = 0; i < predicted.size(); ++i) correct += predicted[i] == labels[i] ? 1 : 0;
          }
        }
        model->train();
        Tensor correctTotal = Tensor::fromVector(std::vector<double>{correct}, {1});
        group.allReduceSync(correctTotal);
        accuracy = correctTotal.item() / static_cast<double>(loaded.test.size());
        if (rank == 0) {
          std::printf("epoch %lld: loss %.4f, test accuracy %.2f%%, %.0f images/s (all ranks)\n",
                      static_cast<long long>(epoch), meanLoss, 100.0 * accuracy,
                      static_cast<double>(globalImages) / seconds);
          std::fflush(stdout);
        }
      }

      if (rank == 0) {
        // Replicas are identical: one checkpoint, written by rank 0 only.
        std::filesystem::path ckpt(opt.checkpoint);
        if (ckpt.has_parent_path()) std::filesystem::create_directories(ckpt.parent_path());
        models::saveCheckpoint(*model, opt.checkpoint);
        examples::JsonLine("ddp")
            .add("mode", "ddp")
            .add("model", "lenet5")
            .add("workers", static_cast<int64_t>(world))
            .add("epochs", opt.epochs)
            .add("batch_size_per_rank", opt.batchSize)
            .add("buckets", static_cast<int64_t>(ddp.buckets().size()))
            .add("buckets_overlapped", static_cast<int64_t>(overlappedBuckets))
            .add("compression", opt.compression)
            .add("train_images", trainImages)
            .add("test_accuracy", accuracy)
            .add("images_per_s", static_cast<double>(trainImages) / trainSeconds)
            .add("peak_rss_mib", examples::peakRssMiB())
            .add("checkpoint", opt.checkpoint)
            .print();
      }
      group.barrierSync();
    }
    agent->shutdown();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ddp: error: " << e.what() << "\n";
    return 1;
  }
}
