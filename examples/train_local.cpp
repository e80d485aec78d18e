// train_local: trains a LeNet-5 (ReLU + max-pool) on Fashion-MNIST in one process.
//
// This is the single-process baseline the distributed examples are measured against. It shows a progress
// bar with loss and images/s (plain periodic lines when stdout is not a terminal), evaluates on the test
// set after each epoch, saves a checkpoint atomically, and ends with one JSON line:
//   {"example":"train_local","test_accuracy":...,"images_per_s":...,"peak_rss_mib":...,...}
//
//   train_local [--epochs N] [--batch-size N] [--lr X] [--seed N] [--threads N] [--limit N]
//               [--data-dir DIR] [--checkpoint PATH] [--device cpu|cuda[:N]]
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "examples/example_util.h"
#include "models/checkpoint.h"
#include "models/data/data_loader.h"
#include "models/data/fashion_mnist.h"
#include "models/optim/adam.h"
#include "models/optim/lr_scheduler.h"
#include "models/zoo/lenet.h"
#include "tensor/cpu/dnnl_context.h"

using namespace distgrad;
namespace data = distgrad::models::data;

namespace {

struct Options {
  int64_t epochs = 3;
  int64_t batchSize = 32;
  double lr = 2e-3;
  uint64_t seed = 0;
  int threads = 1;
  int64_t limit = 0;  // use only the first N training and test images (0 = all); for quick runs
  std::string dataDir;
  std::string checkpoint = "checkpoints/train_local.ckpt";
  std::string deviceName = "cpu";
  Device device;
};

Options parseArgs(int argc, char** argv) {
  Options o;
  examples::Flags flags("train_local", "trains LeNet-5 on Fashion-MNIST in one process");
  flags.add("--epochs", o.epochs, "passes over the training set")
      .add("--batch-size", o.batchSize, "images per step")
      .add("--lr", o.lr, "Adam learning rate (cosine-annealed over the epochs)")
      .add("--seed", o.seed, "initialisation and shuffling seed")
      .add("--threads", o.threads, "oneDNN threads")
      .add("--limit", o.limit, "use only the first N training and test images (0 = all)")
      .add("--data-dir", o.dataDir, "Fashion-MNIST directory (default: the Debian package's)")
      .add("--checkpoint", o.checkpoint, "where to save the trained model")
      .add("--device", o.deviceName, examples::kDeviceHelp);
  flags.parse(argc, argv);
  o.device = examples::deviceFromFlag(flags, o.deviceName);
  flags.require(o.epochs >= 1 && o.batchSize >= 1 && o.lr > 0 && o.threads >= 1 && o.limit >= 0,
                "--epochs, --batch-size, --threads must be >= 1, --lr > 0, --limit >= 0");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt = parseArgs(argc, argv);
  try {
    tensor::setNumThreads(opt.threads);
    examples::Data data = examples::loadFashionMnist(opt.dataDir, opt.limit);
    const data::TensorDataset& trainSet = data.train;
    const data::TensorDataset& testSet = data.test;
    std::printf(
        "train_local: Fashion-MNIST %lld train / %lld test images, LeNet-5, Adam lr %g, batch %lld, "
        "%d thread(s), %s\n",
        static_cast<long long>(trainSet.size()), static_cast<long long>(testSet.size()), opt.lr,
        static_cast<long long>(opt.batchSize), opt.threads, opt.device.str().c_str());

    tensor::Generator gen(opt.seed);
    auto model = std::make_shared<models::LeNet5>(gen);
    model->to(opt.device);  // before the optimizer (models/optim/optimizer.h, "Devices")
    models::optim::Adam optimizer(model->parameters(), {.learningRate = opt.lr});
    models::optim::CosineAnnealingLR schedule(optimizer, opt.epochs);
    data::DataLoader loader(trainSet,
                            {.batchSize = opt.batchSize, .shuffle = true, .seed = opt.seed, .device = opt.device});

    double trainSeconds = 0;
    int64_t trainImages = 0;
    double accuracy = 0;
    for (int64_t epoch = 1; epoch <= opt.epochs; ++epoch) {
      examples::Progress progress("epoch " + std::to_string(epoch) + "/" + std::to_string(opt.epochs),
                                  loader.numBatches());
      auto t0 = std::chrono::steady_clock::now();
      int64_t done = 0;
      int64_t images = 0;
      examples::RunningLoss runningLoss;
      for (const auto& batch : loader) {
        Tensor loss = crossEntropy(model->forward(batch.inputs), batch.labels);
        optimizer.zeroGrad();
        distgrad::backward(loss);
        optimizer.step();
        const double l = runningLoss.add(examples::itemOf(loss),
                                         "epoch " + std::to_string(epoch) + " batch " + std::to_string(done));
        images += batch.size();
        progress.update(++done, images, l);
      }
      const double seconds = examples::secondsSince(t0);
      trainSeconds += seconds;
      trainImages += images;
      schedule.step();
      model->eval();
      accuracy = examples::testAccuracy([&](const Tensor& x) { return model->forward(x); }, testSet, 1000, opt.device);
      model->train();
      std::printf("epoch %lld: test accuracy %.2f%%, %.0f images/s, lr %.2g\n", static_cast<long long>(epoch),
                  100.0 * accuracy, static_cast<double>(images) / seconds, optimizer.learningRate());
      std::fflush(stdout);
    }

    std::filesystem::path ckpt(opt.checkpoint);
    if (ckpt.has_parent_path()) std::filesystem::create_directories(ckpt.parent_path());
    models::saveCheckpoint(*model, opt.checkpoint);

    examples::JsonLine("train_local")
        .add("model", "lenet5")
        .add("epochs", opt.epochs)
        .add("batch_size", opt.batchSize)
        .add("threads", opt.threads)
        .add("device", opt.device.str())
        .add("train_images", trainSet.size())
        .add("test_accuracy", accuracy)
        .add("images_per_s", static_cast<double>(trainImages) / trainSeconds)
        .add("peak_rss_mib", examples::peakRssMiB())
        .add("checkpoint", opt.checkpoint)
        .print();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "train_local: error: " << e.what() << "\n";
    return 1;
  }
}
