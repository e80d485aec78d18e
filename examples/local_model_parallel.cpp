// local_model_parallel: model parallelism in one process, without pipelining. The model is cut into
// --stages contiguous stages of balanced cost (as a model too big for one device would be spread over
// several), and each batch goes through them one after another: stage 0's forward, stage 1's forward, ...,
// the loss, then the backwards in reverse, then every stage steps its own optimizer. At any moment only one
// stage works; the others wait. That idle time is what local_pipeline recovers with micro-batches.
//
// It runs LocalPipeline in sequential mode with one micro-batch: the same stages, hand-overs (each stage's
// input is the previous stage's output, detached) and accounting as the pipelines, on the calling thread.
// The training is the same as single_worker's (same model from the same --seed, same gradients).
//
// Each epoch reports compute, bubble (the stages' idle time the sequential schedule forces: (S-1)/S of
// every stage's time, in principle) and overhead shares (models/pipeline/schedule.h, StepStats).
//
// Ends with one JSON line: {"example":"local_model_parallel","mode":"local_mp","stages":2,
// "micro_batches":1,"schedule":"sequential","images_per_s":...,"test_accuracy":...,...}.
//
//   local_model_parallel [--stages N] [--balance time|params] [--model resnet18|resnet50|mlp|lenet5]
//                        [--width N] [--epochs N] [--batch-size N] [--optimizer sgd|adam] [--lr X]
//                        [--seed N] [--limit N] [--threads N] [--data-dir DIR]
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>

#include "examples/example_util.h"
#include "models/data/data_loader.h"
#include "models/pipeline/local_pipeline.h"
#include "models/pipeline/model_spec.h"
#include "models/pipeline/partition.h"
#include "tensor/cpu/dnnl_context.h"

using namespace distgrad;
namespace data = distgrad::models::data;
namespace pipeline = distgrad::models::pipeline;

namespace {

struct Options {
  int64_t stages = 2;
  std::string balance = "time";
  std::string model = "resnet18";
  int64_t width = 16;
  int64_t epochs = 1;
  int64_t batchSize = 64;
  std::string optimizer = "adam";
  double lr = 0;  // 0: the optimizer's default below
  uint64_t seed = 0;
  int64_t limit = 0;
  int threads = 1;
  std::string dataDir;
};

Options parseArgs(int argc, char** argv) {
  Options o;
  examples::Flags flags("local_model_parallel", "model-parallel training in one process, stages in turn");
  flags.add("--stages", o.stages, "model stages (run one after another)")
      .add("--balance", o.balance, "balance stages by measured time or by parameter count: time | params")
      .add("--model", o.model, "resnet18 | resnet50 | mlp | lenet5")
      .add("--width", o.width, "ResNet base width (torchvision's is 64)")
      .add("--epochs", o.epochs, "passes over the training set")
      .add("--batch-size", o.batchSize, "images per step")
      .add("--optimizer", o.optimizer, "sgd (momentum 0.9) | adam")
      .add("--lr", o.lr, "learning rate (0: 0.05 for sgd, 0.001 for adam)")
      .add("--seed", o.seed, "initialisation and shuffling seed")
      .add("--limit", o.limit, "use only the first N training and test images (0 = all)")
      .add("--threads", o.threads, "oneDNN threads per stage")
      .add("--data-dir", o.dataDir, "Fashion-MNIST directory (default: the Debian package's)");
  flags.parse(argc, argv);
  flags.require(
      o.stages >= 1 && o.epochs >= 1 && o.batchSize >= 1 && o.width >= 1 && o.threads >= 1 && o.limit >= 0 && o.lr >= 0,
      "--stages, --epochs, --batch-size, --width, --threads must be >= 1, "
      "--limit and --lr >= 0");
  flags.require(o.balance == "time" || o.balance == "params", "--balance must be time or params");
  flags.require(o.optimizer == "sgd" || o.optimizer == "adam", "--optimizer must be sgd or adam");
  return o;
}

models::optim::OptimizerSpec optimizerSpec(const Options& o) {
  if (o.optimizer == "adam") return models::optim::OptimizerSpec::adam({.learningRate = o.lr > 0 ? o.lr : 1e-3});
  return models::optim::OptimizerSpec::sgd({.learningRate = o.lr > 0 ? o.lr : 0.05, .momentum = 0.9});
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parseArgs(argc, argv);
  try {
    tensor::setNumThreads(opt.threads);
    const examples::Data data = examples::loadFashionMnist(opt.dataDir, opt.limit);
    pipeline::ModelSpec spec;
    spec.name = opt.model;
    spec.baseWidth = opt.width;
    spec.seed = opt.seed;
    auto model = pipeline::buildModel(spec);
    const auto units = pipeline::modelUnits(spec, model);

    // Balance on a batch of real images: a stage's cost is its forward + backward on what it will receive.
    const Tensor sample = narrow(data.train.inputs(), 0, 0, std::min(opt.batchSize, data.train.size()));
    const pipeline::Partition partition =
        pipeline::balance(units, opt.stages, pipeline::parseBalanceBy(opt.balance), sample);

    pipeline::PipelineOptions options;
    options.microBatches = 1;  // the whole batch goes through each stage at once
    options.optimizer = optimizerSpec(opt);
    pipeline::LocalPipeline pipe(pipeline::stageModules(units, partition), options, /*threaded=*/false);
    std::printf("local_model_parallel: %s (%.2fM parameters), %s, %s, batch %lld, %lld train / %lld test images\n",
                spec.describe().c_str(), static_cast<double>(model->numParameters()) / 1e6, pipe.describe().c_str(),
                options.optimizer.describe().c_str(), static_cast<long long>(opt.batchSize),
                static_cast<long long>(data.train.size()), static_cast<long long>(data.test.size()));
    std::printf("partition by %s: %s\n", opt.balance.c_str(), partition.describe().c_str());

    data::DataLoader loader(data.train, {.batchSize = opt.batchSize, .shuffle = true, .seed = opt.seed});
    pipeline::StepStats total;
    int64_t trainImages = 0;
    double accuracy = 0;
    for (int64_t epoch = 1; epoch <= opt.epochs; ++epoch) {
      const std::string label = "epoch " + std::to_string(epoch) + "/" + std::to_string(opt.epochs);
      examples::Progress progress(label, loader.numBatches());
      examples::RunningLoss runningLoss;
      pipeline::StepStats epochStats;
      int64_t done = 0;
      int64_t images = 0;
      for (const auto& batch : loader) {
        const pipeline::StepResult r = pipe.step(batch.inputs, batch.labels);
        epochStats.accumulate(r.stats);
        images += r.samples;
        const double smoothed = runningLoss.add(r.loss, label + " batch " + std::to_string(done + 1));
        progress.update(++done, images, smoothed);
      }
      total.accumulate(epochStats);
      trainImages += images;
      accuracy = examples::testAccuracy([&](const Tensor& x) { return pipe.predict(x); }, data.test);
      std::printf("epoch %lld: test accuracy %.2f%%, %.0f images/s, compute %.0f%%, bubble %.0f%%, overhead %.0f%%\n",
                  static_cast<long long>(epoch), 100.0 * accuracy, static_cast<double>(images) / epochStats.wallSeconds,
                  100.0 * epochStats.computeShare(), 100.0 * epochStats.bubbleShare(),
                  100.0 * epochStats.overheadShare());
      std::fflush(stdout);
    }

    examples::JsonLine("local_model_parallel")
        .add("mode", "local_mp")
        .add("workers", 1)
        .add("model", spec.name)
        .add("width", opt.width)
        .add("epochs", opt.epochs)
        .add("batch_size", opt.batchSize)
        .add("optimizer", opt.optimizer)
        .add("threads", opt.threads)
        .add("train_images", data.train.size())
        .add("stages", opt.stages)
        .add("micro_batches", 1)
        .add("schedule", "sequential")
        .add("balance", opt.balance)
        .add("compute_share", total.computeShare())
        .add("bubble_share", total.bubbleShare())
        .add("overhead_share", total.overheadShare())
        .add("images_per_s", static_cast<double>(trainImages) / total.wallSeconds)
        .add("test_accuracy", accuracy)
        .add("peak_rss_mib", examples::peakRssMiB())
        .print();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "local_model_parallel: error: " << e.what() << "\n";
    return 1;
  }
}
