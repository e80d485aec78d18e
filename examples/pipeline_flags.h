// The flags and defaults the pipeline family shares (single_worker, local_model_parallel, local_pipeline,
// rpc_pipeline), so their figures compare: ResNet-18 of base width 16 with a CIFAR stem, 1 epoch, batch 64,
// Adam lr 0.001 (sgd: lr 0.05, momentum 0.9), seed 0, 1 oneDNN thread; pipelines: 2 stages balanced by
// measured time, 4 micro-batches, GPipe. Header-only, like example_util.h.
// Thread-safety: none needed (parsed once on the main thread).
#pragma once

#include <cstdint>
#include <string>

#include "examples/example_util.h"
#include "models/optim/distributed_optimizer.h"
#include "models/pipeline/model_spec.h"

namespace distgrad::examples {

struct PipelineFlags {
  int64_t stages = 2;
  int64_t microBatches = 4;
  std::string schedule = "gpipe";
  std::string balance = "time";
  std::string model = "resnet18";
  int64_t width = 16;
  int64_t epochs = 1;
  int64_t batchSize = 64;
  std::string optimizer = "adam";
  double lr = 0;  // 0: the optimizer's default (optimizerSpec)
  uint64_t seed = 0;
  int64_t limit = 0;
  int threads = 1;
  std::string dataDir;

  models::pipeline::ModelSpec modelSpec() const {
    models::pipeline::ModelSpec spec;
    spec.name = model;
    spec.baseWidth = width;
    spec.seed = seed;
    return spec;
  }
  models::optim::OptimizerSpec optimizerSpec() const {
    if (optimizer == "adam") return models::optim::OptimizerSpec::adam({.learningRate = lr > 0 ? lr : 1e-3});
    return models::optim::OptimizerSpec::sgd({.learningRate = lr > 0 ? lr : 0.05, .momentum = 0.9});
  }
};

// Which of the shared flags a program takes: the model and training ones always; the stage split
// (`stagesFlag`, e.g. "--stages" or "--stage-workers", and --balance) unless empty; --micro-batches and
// --schedule when `pipelined`. Parses argv into `o` and checks every value (exit 2 with the usage).
inline void parsePipelineFlags(Flags& flags, PipelineFlags& o, int argc, char** argv, const std::string& stagesFlag,
                               const std::string& stagesHelp, bool pipelined) {
  if (!stagesFlag.empty()) {
    flags.add(stagesFlag, o.stages, stagesHelp)
        .add("--balance", o.balance, "balance stages by measured time or by parameter count: time | params");
  }
  if (pipelined) {
    flags.add("--micro-batches", o.microBatches, "micro-batches per batch")
        .add("--schedule", o.schedule, "gpipe | 1f1b");
  }
  flags.add("--model", o.model, "resnet18 | resnet50 | mlp | lenet5")
      .add("--width", o.width, "ResNet base width (torchvision's is 64)")
      .add("--epochs", o.epochs, "passes over the training set")
      .add("--batch-size", o.batchSize, "images per step")
      .add("--optimizer", o.optimizer, "sgd (momentum 0.9) | adam")
      .add("--lr", o.lr, "learning rate (0: 0.05 for sgd, 0.001 for adam)")
      .add("--seed", o.seed, "initialisation and shuffling seed")
      .add("--limit", o.limit, "use only the first N training and test images (0 = all)")
      .add("--threads", o.threads, "oneDNN threads per process")
      .add("--data-dir", o.dataDir, "Fashion-MNIST directory (default: the Debian package's)");
  flags.parse(argc, argv);
  flags.require(o.stages >= 1 && o.microBatches >= 1 && o.epochs >= 1 && o.batchSize >= 1 && o.width >= 1 &&
                    o.threads >= 1 && o.limit >= 0 && o.lr >= 0,
                "stages, --micro-batches, --epochs, --batch-size, --width, --threads must be >= 1, "
                "--limit and --lr >= 0");
  flags.require(o.schedule == "gpipe" || o.schedule == "1f1b", "--schedule must be gpipe or 1f1b");
  flags.require(o.balance == "time" || o.balance == "params", "--balance must be time or params");
  flags.require(o.optimizer == "sgd" || o.optimizer == "adam", "--optimizer must be sgd or adam");
}

}  // namespace distgrad::examples
