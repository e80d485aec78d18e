// What the data-parallel examples share (ddp, zero): their flags, the job's start-up (an agent from the
// launcher's environment with the collectives installed, the world group), the training loop around
// DistributedDataParallel with per-epoch progress, throughput and accuracy, rank 0's checkpoint and the
// common fields of the final JSON line. Each example keeps only what makes it different: which optimizer
// steps the model. Header-only, like example_util.h.
//
//   examples::DataParallelFlags opt;
//   examples::parseDataParallelFlags("ddp", "...", opt, argc, argv);
//   return examples::runDataParallel("ddp", opt, [&](rpc::Agent& agent, ProcessGroup& group) {
//     auto model = examples::buildReplica(opt, group.rank());
//     models::DistributedDataParallel ddp(*model, group, opt.ddpOptions());
//     auto optimizer = ...;
//     examples::TrainSummary summary = examples::trainDataParallel("ddp", *model, ddp, group, data, opt,
//                                                                  [&] { optimizer->step(); });
//     if (group.rank() == 0) { examples::saveOnRankZero(...); examples::dataParallelJson(...).print(); }
//   });
//
// Thread-safety: none needed (one training thread per process).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "examples/example_util.h"
#include "examples/pipeline_flags.h"
#include "models/checkpoint.h"
#include "models/data/data_loader.h"
#include "models/data/sampler.h"
#include "models/parallel/ddp.h"
#include "models/pipeline/model_spec.h"
#include "rpc/agent.h"
#include "rpc/collectives/process_group.h"
#include "tensor/cpu/dnnl_context.h"

namespace distgrad::examples {

// The pipeline family's model and training flags (so bench_modes runs every mode alike) plus DDP's own.
// --batch-size is per rank (PyTorch's convention): the global batch is batch size x ranks.
struct DataParallelFlags : PipelineFlags {
  int64_t bucketKb = 25 * 1024;
  std::string compression = "none";
  std::string checkpoint;

  models::DdpOptions ddpOptions() const {
    models::DdpOptions o;
    o.bucketBytes = static_cast<size_t>(bucketKb) * 1024;
    if (compression == "fp16") o.compression = rpc::collectives::WireCompression::kFloat16;
    if (compression == "bf16") o.compression = rpc::collectives::WireCompression::kBFloat16;
    return o;
  }
};

// Defaults: LeNet-5 (quick on one core per process), 32 images per rank, Adam lr 0.001, checkpoint
// checkpoints/NAME.ckpt. `more` adds the program's own flags. Exits 2 with the usage on a bad flag.
inline void parseDataParallelFlags(const std::string& name, const std::string& summary, DataParallelFlags& o,
                                   int argc, char** argv, const std::function<void(Flags&)>& more = nullptr) {
  o.model = "lenet5";
  o.batchSize = 32;
  o.checkpoint = "checkpoints/" + name + ".ckpt";
  Flags flags(name, summary);
  flags.add("--bucket-kb", o.bucketKb, "gradient bucket size in KB")
      .add("--compression", o.compression, "gradients on the wire: none, fp16 or bf16")
      .add("--checkpoint", o.checkpoint, "where rank 0 saves the trained model");
  if (more) more(flags);
  parsePipelineFlags(flags, o, argc, argv, /*stagesFlag=*/"", "", /*pipelined=*/false);
  flags.require(o.bucketKb >= 1, "--bucket-kb must be >= 1");
  (void)cpuOnlyDeviceFromFlag(flags, o.deviceList,
                              "DistributedDataParallel's gradient buckets and the collectives that reduce them are "
                              "host-only so far");
  flags.require(o.compression == "none" || o.compression == "fp16" || o.compression == "bf16",
                "--compression must be none, fp16 or bf16");
}

// Starts this process's agent (rank and world from the launcher's environment: distgrad-run, torchrun,
// srun, mpirun) with the collectives installed, runs `body` with the world group, waits for every rank at a
// barrier and shuts down. Returns main's exit status: 0, or 1 with "NAME: error: ..." on stderr.
inline int runDataParallel(const std::string& name, const DataParallelFlags& opt,
                           const std::function<void(rpc::Agent&, rpc::collectives::ProcessGroup&)>& body) {
  try {
    tensor::setNumThreads(opt.threads);
    rpc::Registry registry;
    rpc::collectives::install(registry);
    auto agent = rpc::Agent::start(rpc::Options::fromEnv(), registry);
    {
      auto group = rpc::collectives::ProcessGroup::world(*agent);
      body(*agent, group);
      group.barrierSync();  // nobody shuts down while another rank still needs it
    }
    agent->shutdown();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << name << ": error: " << e.what() << "\n";
    return 1;
  }
}

// This rank's replica. The seed differs per rank on purpose: DistributedDataParallel's broadcast makes
// every replica start from rank 0's weights.
inline std::shared_ptr<models::Module> buildReplica(const DataParallelFlags& opt, int rank) {
  models::pipeline::ModelSpec spec = opt.modelSpec();
  spec.seed = opt.seed + static_cast<uint64_t>(rank);
  return models::pipeline::buildModel(spec);
}

// What a run measured, the same on every rank (reduced over ranks).
struct TrainSummary {
  double testAccuracy = 0;
  int64_t trainImages = 0;   // all ranks
  double trainSeconds = 0;   // wall time of the epochs' training loops (from a common start)
  double computeShare = 0;   // forward + backward time / step time, over all ranks' steps
  double peakRssMiBMax = 0;  // the largest peak RSS of any rank
  int64_t bucketsOverlapped = 0;  // rank 0's buckets launched before its backward ended, over all steps
};

// Trains `model` (wrapped by `ddp`) for opt.epochs epochs on this rank's DistributedSampler shard of
// `data.train`; `step` runs after each synchronised backward (the optimizer step). Rank 0 shows progress
// and, per epoch, the loss averaged over ranks, images/s of all ranks and the test accuracy (every rank
// scores its slice of the test set; the correct counts are summed). A collective: every rank calls it.
inline TrainSummary trainDataParallel(const std::string& name, models::Module& model,
                                      models::DistributedDataParallel& ddp, rpc::collectives::ProcessGroup& group,
                                      const Data& data, const DataParallelFlags& opt, const std::function<void()>& step) {
  const int rank = group.rank();
  const int world = group.size();
  auto sampler = std::make_shared<models::data::DistributedSampler>(data.train.size(), world, rank, true, opt.seed);
  models::data::DataLoader loader(data.train, {.batchSize = opt.batchSize}, sampler);
  TrainSummary summary;
  double stepSeconds = 0;
  double computeSeconds = 0;
  for (int64_t epoch = 1; epoch <= opt.epochs; ++epoch) {
    sampler->setEpoch(epoch);
    const std::string label = "epoch " + std::to_string(epoch) + "/" + std::to_string(opt.epochs);
    Progress progress(label, loader.numBatches());
    RunningLoss runningLoss;
    group.barrierSync();  // time the epoch from a common start
    const auto epochStart = std::chrono::steady_clock::now();
    int64_t done = 0;
    int64_t images = 0;
    double lossSum = 0;
    for (const auto& batch : loader) {
      const auto start = std::chrono::steady_clock::now();
      model.zeroGrad();
      Tensor loss = crossEntropy(ddp.forward(batch.inputs), batch.labels);
      autograd::backward(std::vector<Tensor>{loss});  // its buckets' all-reduces start as they fill
      computeSeconds += secondsSince(start);
      ddp.synchronize();  // waits for the rest: the communication that did not overlap
      step();
      stepSeconds += secondsSince(start);
      if (rank == 0) summary.bucketsOverlapped += static_cast<int64_t>(ddp.bucketsLaunchedDuringBackward());
      lossSum += loss.item();
      images += batch.size();
      const double smoothed = runningLoss.add(loss.item(), label + " batch " + std::to_string(done + 1));
      ++done;
      if (rank == 0) progress.update(done, images * world, smoothed);
    }
    // Horovod's metric_average: the mean of the ranks' mean losses; images summed over ranks.
    Tensor stats = Tensor::fromVector(
        std::vector<double>{lossSum / static_cast<double>(std::max<int64_t>(done, 1)), static_cast<double>(images)}, {2});
    group.allReduceSync(stats);
    const double seconds = secondsSince(epochStart);
    summary.trainSeconds += seconds;
    const auto s = stats.toVector<double>();
    summary.trainImages += static_cast<int64_t>(s[1]);

    // Replicas are identical: each rank scores a slice of the test set and the counts are summed.
    const int64_t begin = data.test.size() * rank / world;
    const int64_t end = data.test.size() * (rank + 1) / world;
    model.eval();
    const double sliceAccuracy =
        end > begin ? testAccuracy([&](const Tensor& x) { return model.forward(x); }, data.test.slice(begin, end - begin))
                    : 0.0;
    model.train();
    Tensor correct = Tensor::fromVector(std::vector<double>{sliceAccuracy * static_cast<double>(end - begin)}, {1});
    group.allReduceSync(correct);
    summary.testAccuracy = correct.item() / static_cast<double>(std::max<int64_t>(data.test.size(), 1));
    if (rank == 0) {
      std::printf("%s epoch %lld: loss %.4f, test accuracy %.2f%%, %.0f images/s (all ranks)\n", name.c_str(),
                  static_cast<long long>(epoch), s[0] / world, 100.0 * summary.testAccuracy, s[1] / seconds);
      std::fflush(stdout);
    }
  }
  // Step time not spent in forward + backward (waiting for gradients, the optimizer), over every rank's
  // steps; and the largest process.
  Tensor totals = Tensor::fromVector(std::vector<double>{computeSeconds, stepSeconds}, {2});
  group.allReduceSync(totals);
  const auto t = totals.toVector<double>();
  summary.computeShare = t[1] > 0 ? t[0] / t[1] : 0.0;
  Tensor rss = Tensor::fromVector(std::vector<double>{peakRssMiB()}, {1});
  group.allReduceSync(rss, {rpc::collectives::ReduceOp::kMax});
  summary.peakRssMiBMax = rss.item();
  return summary;
}

// Replicas are identical: one checkpoint, written by rank 0 only.
inline void saveOnRankZero(const models::Module& model, const std::string& path) {
  std::filesystem::path file(path);
  if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path());
  models::saveCheckpoint(model, path);
}

// The final line's fields every data-parallel example reports (the pipeline family's first fields, then
// the measurements); the caller adds its own and prints it. images_per_s counts the images of all ranks.
inline JsonLine dataParallelJson(const std::string& example, const std::string& mode, int world,
                                 const DataParallelFlags& opt, const models::DistributedDataParallel& ddp,
                                 const TrainSummary& s) {
  JsonLine json(example);
  DataParallelFlags global = opt;
  global.batchSize = opt.batchSize * world;  // batch_size: images per optimizer step, as in the other modes
  addRunFields(json, mode, world, global, opt.model, s.trainImages)
      .add("batch_size_per_rank", opt.batchSize)
      .add("buckets", static_cast<int64_t>(ddp.buckets().size()))
      .add("buckets_overlapped", s.bucketsOverlapped)
      .add("compression", opt.compression)
      .add("test_accuracy", s.testAccuracy)
      .add("images_per_s", static_cast<double>(s.trainImages) / s.trainSeconds)
      .add("compute_share", s.computeShare)
      .add("overhead_share", 1.0 - s.computeShare)
      .add("peak_rss_mib", peakRssMiB())
      .add("peak_rss_mib_max", std::max(s.peakRssMiBMax, peakRssMiB()))  // this rank may have grown since
      .add("checkpoint", opt.checkpoint);
  return json;
}

}  // namespace distgrad::examples
