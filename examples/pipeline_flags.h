// The flags and defaults the pipeline family shares (single_worker, local_model_parallel, local_pipeline,
// rpc_pipeline), so their figures compare: ResNet-18 of base width 16 with a CIFAR stem, 1 epoch, batch 64,
// Adam lr 0.001 (sgd: lr 0.05, momentum 0.9), seed 0, 1 oneDNN thread, on the CPU; pipelines: 2 stages balanced by
// measured time, 4 micro-batches, GPipe. --device picks where the model computes: one device for the
// programs in one process, one per stage (or one for all stages) for rpc_pipeline. --trace DIR writes a trace of the
// run (docs/tracing.md): rpc_pipeline through every agent's Options::traceDir, the programs without an agent through
// LocalTrace below. Header-only, like example_util.h. Thread-safety: none needed (parsed once on the main thread).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "examples/example_util.h"
#include "models/optim/distributed_optimizer.h"
#include "models/pipeline/model_spec.h"
#include "rpc/trace.h"

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
  std::string traceDir;  // --trace: empty = no trace
  std::string deviceList = "cpu";  // --device: "cpu", "cuda:0" or, per stage, "cuda:0,cuda:1"
  std::vector<Device> devices;     // parsed from deviceList: one entry, or one per stage

  // Where stage `s` computes (the single --device for every stage, or its own entry).
  Device stageDevice(int64_t s) const { return devices.size() == 1 ? devices[0] : devices.at(static_cast<size_t>(s)); }
  // The device of a program that runs in one process (parsePipelineFlags allowed one entry only).
  Device device() const { return devices.at(0); }

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
// `perStageDevices` (rpc_pipeline): --device may list one device per stage, and availability is checked
// by each stage's own process (checkStageDeviceOrExit), not here; otherwise --device names one device,
// checked here (exit 2 when this process cannot use it).
inline void parsePipelineFlags(Flags& flags, PipelineFlags& o, int argc, char** argv, const std::string& stagesFlag,
                               const std::string& stagesHelp, bool pipelined, bool perStageDevices = false) {
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
      .add("--data-dir", o.dataDir, "Fashion-MNIST directory (default: the Debian package's)")
      .add("--trace", o.traceDir, "write a trace of the run to DIR/<worker>.trace.jsonl (docs/tracing.md)")
      .add("--device", o.deviceList,
           perStageDevices ? "where the stages compute: one device for all (cpu | cuda | cuda:N) or a comma list, "
                             "one per stage (cuda:0,cuda:1)"
                           : kDeviceHelp);
  flags.parse(argc, argv);
  flags.require(o.stages >= 1 && o.microBatches >= 1 && o.epochs >= 1 && o.batchSize >= 1 && o.width >= 1 &&
                    o.threads >= 1 && o.limit >= 0 && o.lr >= 0,
                "stages, --micro-batches, --epochs, --batch-size, --width, --threads must be >= 1, "
                "--limit and --lr >= 0");
  flags.require(o.schedule == "gpipe" || o.schedule == "1f1b", "--schedule must be gpipe or 1f1b");
  flags.require(o.balance == "time" || o.balance == "params", "--balance must be time or params");
  flags.require(o.optimizer == "sgd" || o.optimizer == "adam", "--optimizer must be sgd or adam");
  o.devices.clear();
  for (size_t start = 0;;) {
    const size_t comma = o.deviceList.find(',', start);
    const std::string item = o.deviceList.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    try {
      o.devices.push_back(parseDevice(item));
    } catch (const ValueError& e) {
      flags.require(false, std::string("--device: ") + e.what());
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (!perStageDevices) {
    flags.require(o.devices.size() == 1, "--device names one device here, got '" + o.deviceList + "'");
    (void)deviceFromFlag(flags, o.deviceList);  // exits 2 when this process cannot use it
    return;
  }
  flags.require(o.devices.size() == 1 || static_cast<int64_t>(o.devices.size()) == o.stages,
                "--device lists " + std::to_string(o.devices.size()) + " devices for " + std::to_string(o.stages) +
                    " stages (give one for all stages or one per stage)");
}

// rpc_pipeline's stage workers: exits 2 with the reason when stage `stage`'s device is unusable in this
// process (each stage process checks its own GPU; the driver computes nothing on a device).
inline void checkStageDeviceOrExit(const Flags& flags, const PipelineFlags& o, int64_t stage) {
  const Device device = o.stageDevice(stage);
  const std::string reason = deviceUnavailableReason(device);
  if (reason.empty()) return;
  std::cerr << flags.program() << ": --device: stage " << stage << ": " << reason << "\n";
  std::exit(2);
}

// The first fields of the pipeline family's result line, the same in every program so bench_modes and
// readers compare them: which program and mode, how many workers, the model and the training settings.
inline JsonLine& addRunFields(JsonLine& json, const std::string& mode, int64_t workers, const PipelineFlags& opt,
                              const std::string& model, int64_t trainImages) {
  return json.add("mode", mode)
      .add("workers", workers)
      .add("model", model)
      .add("width", opt.width)
      .add("epochs", opt.epochs)
      .add("batch_size", opt.batchSize)
      .add("optimizer", opt.optimizer)
      .add("threads", opt.threads)
      .add("device", opt.deviceList)
      .add("train_images", trainImages);
}

// --trace for a program without an agent (single_worker, local_model_parallel, local_pipeline): the process
// registers itself as trace worker `name` (rank 0), so everything it records (the pipeline's events, from
// every thread) goes to DIR/<name>.trace.jsonl (rpc/trace.h, "A process without an agent"). finish() (or
// the destructor) writes the file and prints where it went. With an empty directory it does nothing.
class LocalTrace {
 public:
  // Throws ValueError if DIR or the file cannot be created.
  LocalTrace(const std::string& name, const std::string& directory) : name_(name) {
    if (directory.empty()) return;
    slot_ = trace::registerWorker(name, /*rank=*/0, directory);
    path_ = trace::workerFile(slot_);
  }
  ~LocalTrace() { finish(); }
  LocalTrace(const LocalTrace&) = delete;
  LocalTrace& operator=(const LocalTrace&) = delete;

  void finish() {
    if (slot_ == trace::kNoWorker) return;
    trace::unregisterWorker(std::exchange(slot_, trace::kNoWorker));
    std::printf("%s: trace written to %s\n", name_.c_str(), path_.c_str());
    std::fflush(stdout);
  }

 private:
  std::string name_;
  std::string path_;
  trace::WorkerSlot slot_ = trace::kNoWorker;
};

}  // namespace distgrad::examples
