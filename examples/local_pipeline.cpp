// local_pipeline: pipeline-parallel training in one process. The model is cut into --stages contiguous
// stages of balanced cost; each stage runs on its own thread, and every batch is split into
// --micro-batches micro-batches that flow through the stages in the --schedule's order (GPipe: all
// forwards then all backwards; 1F1B: one forward, one backward, at most stages - s micro-batches held by
// stage s), so the stages work on different micro-batches at the same time. Each stage steps its own
// optimizer after its last backward. The result is the same training as single_worker's (same model from
// the same --seed, the gradient of the whole batch), computed in a pipeline.
//
// Each epoch reports where the stages' time went (models/pipeline/schedule.h, StepStats): compute (forward
// and backward), bubble (idle time the schedule itself forces while the pipeline fills and drains: it
// shrinks as micro-batches grow in number) and overhead (hand-overs between threads, the optimizer step,
// and the threads contending for this machine's cores).
//
// Ends with one JSON line: {"example":"local_pipeline","mode":"local_pipeline","stages":2,
// "micro_batches":4,"schedule":"gpipe","images_per_s":...,"test_accuracy":...,"bubble_share":...,...}.
//
//   local_pipeline [--stages N] [--micro-batches N] [--schedule gpipe|1f1b] [--balance time|params]
//                  [--model resnet18|resnet50|mlp|lenet5] [--width N] [--epochs N] [--batch-size N]
//                  [--optimizer sgd|adam] [--lr X] [--seed N] [--limit N] [--threads N] [--data-dir DIR]
#include "models/pipeline/local_pipeline.h"

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>

#include "examples/example_util.h"
#include "models/data/data_loader.h"
#include "models/pipeline/model_spec.h"
#include "models/pipeline/partition.h"
#include "tensor/cpu/dnnl_context.h"

using namespace distgrad;
namespace data = distgrad::models::data;
namespace pipeline = distgrad::models::pipeline;

namespace {

struct Options {
  int64_t stages = 2;
  int64_t microBatches = 4;
  std::string schedule = "gpipe";
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
  examples::Flags flags("local_pipeline", "pipeline-parallel training on threads of one process");
  flags.add("--stages", o.stages, "pipeline stages (one thread each)")
      .add("--micro-batches", o.microBatches, "micro-batches per batch")
      .add("--schedule", o.schedule, "gpipe | 1f1b")
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
  flags.require(o.stages >= 1 && o.microBatches >= 1 && o.epochs >= 1 && o.batchSize >= 1 && o.width >= 1 &&
                    o.threads >= 1 && o.limit >= 0 && o.lr >= 0,
                "--stages, --micro-batches, --epochs, --batch-size, --width, --threads must be >= 1, "
                "--limit and --lr >= 0");
  flags.require(o.schedule == "gpipe" || o.schedule == "1f1b", "--schedule must be gpipe or 1f1b");
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

    // Balance on a micro-batch of real images: a stage's cost is its forward + backward on what it will
    // actually receive.
    const int64_t microSize = std::max<int64_t>(1, opt.batchSize / opt.microBatches);
    const Tensor sample = narrow(data.train.inputs(), 0, 0, std::min(microSize, data.train.size()));
    const pipeline::Partition partition =
        pipeline::balance(units, opt.stages, pipeline::parseBalanceBy(opt.balance), sample);

    pipeline::PipelineOptions options;
    options.microBatches = opt.microBatches;
    options.schedule = pipeline::parseSchedule(opt.schedule);
    options.optimizer = optimizerSpec(opt);
    pipeline::LocalPipeline pipe(pipeline::stageModules(units, partition), options, /*threaded=*/true);
    std::printf("local_pipeline: %s (%.2fM parameters), %s, %s, batch %lld, %lld train / %lld test images\n",
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

    examples::JsonLine("local_pipeline")
        .add("mode", "local_pipeline")
        .add("workers", 1)
        .add("model", spec.name)
        .add("width", opt.width)
        .add("epochs", opt.epochs)
        .add("batch_size", opt.batchSize)
        .add("optimizer", opt.optimizer)
        .add("threads", opt.threads)
        .add("train_images", data.train.size())
        .add("stages", opt.stages)
        .add("micro_batches", opt.microBatches)
        .add("schedule", opt.schedule)
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
    std::cerr << "local_pipeline: error: " << e.what() << "\n";
    return 1;
  }
}
