// rpc_pipeline: distgrad's main job. A ResNet cut into --stage-workers stages, each on its own worker
// process, trained on Fashion-MNIST by a driver (rank 0: the data) through an RpcPipeline
// (models/pipeline/rpc_pipeline.h): every batch is split into --micro-batches micro-batches whose
// forwards go stage to stage directly (each stage fetches its input from the previous one; the last stage
// computes the loss and only the loss comes back to the driver), whose backwards run under distributed
// autograd, started by the last stage, in the --schedule's order
// (GPipe: all forwards, then all backwards; 1F1B: one forward, one backward, stage s holding at most
// stages - s micro-batches in flight), and one DistributedOptimizer step per batch updates every stage where
// it lives. Run it on local processes with:
//
//   build/tools/distgrad-run --nproc 3 -- build/examples/rpc_pipeline [FLAGS]
//
// (--nproc = --stage-workers + 1). It is the same training as local_pipeline's (same model from the same
// --seed, same partition, same micro-batches), with the stages in other processes instead of threads.
//
// Each epoch prints its images/s and test accuracy; the end prints the RPC overhead summary: per stage, the
// share of the steps' wall time it computed, the share its schedule left it idle (bubble), and the rest:
// the overhead of running it over RPC (messages, serialisation, thread hand-offs), then one verdict line.
// The final JSON line has mode "rpc_pipeline", images_per_s, test_accuracy, compute/bubble/overhead shares
// (rpc_overhead_share = overhead_share), peak_rss_mib (driver), peak_rss_mib_max (all processes) and each
// stage's peak activation bytes (training) and peak RSS (its process's, evaluation included).
//
//   rpc_pipeline [--stage-workers N] [--micro-batches N] [--schedule gpipe|1f1b] [--balance time|params]
//                [--model resnet18|resnet50|mlp|lenet5] [--width N] [--epochs N] [--batch-size N]
//                [--optimizer sgd|adam] [--lr X] [--seed N] [--limit N] [--threads N] [--data-dir DIR]
//                [--trace DIR] [--device cpu|cuda[:N]|DEV0,DEV1,...]
//
// --device places the stages: one device for every stage or a comma list with one per stage (two stages
// on one GPU: --device cuda:0; on two: --device cuda:0,cuda:1). Each stage process checks at start-up that
// it can use its device (exit 2 naming the stage and the device otherwise); the driver keeps the data and
// the loss on the CPU. A CUDA stage is created through RemoteModule placement "workerN/cuda:i" (the owner
// moves the module to its device). This path is untested on hardware (docs/cuda.md, "Models, optimizers
// and examples on CUDA").
//
// --trace DIR: every worker (the driver and each stage) writes DIR/<worker>.trace.jsonl (docs/tracing.md);
// tools/distgrad-trace merges and explains them.
#include "models/pipeline/rpc_pipeline.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "examples/example_util.h"
#include "examples/pipeline_flags.h"
#include "models/data/data_loader.h"
#include "models/optim/distributed_optimizer.h"
#include "models/pipeline/model_spec.h"
#include "models/pipeline/partition.h"
#include "rpc/agent.h"
#include "rpc/trace.h"
#include "rref/context.h"
#include "tensor/cpu/dnnl_context.h"

using namespace distgrad;
namespace data = distgrad::models::data;
namespace pipeline = distgrad::models::pipeline;

namespace {

std::string percent(double share) {
  char buffer[16];
  std::snprintf(buffer, sizeof buffer, "%.0f%%", 100.0 * share);
  return buffer;
}

double processCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// CPU seconds the training steps cost: each stage's process (from its own measurements) and the driver.
struct CpuTotals {
  std::vector<double> stages;
  std::vector<double> stagesCompute;  // the part the forwards and backwards took
  double driver = 0;
  static double sum(const std::vector<double>& values) {
    double out = 0;
    for (double v : values) out += v;
    return out;
  }
  double stagesTotal() const { return sum(stages); }
  double computeTotal() const { return sum(stagesCompute); }
};

// Per stage: the share of the steps' wall time it computed, idled for the schedule (its bubble), and lost
// to everything else (the RPC overhead), and the CPU its process spent per step beyond its compute (what
// the RPC machinery cost: a figure the machine's load hardly moves); then the verdict line.
void printOverheadSummary(const pipeline::StepStats& total, const CpuTotals& cpu,
                          const std::vector<std::string>& workers) {
  std::printf("RPC overhead summary (%lld steps, %.1f s of step wall time):\n", static_cast<long long>(total.steps),
              total.wallSeconds);
  const double steps = static_cast<double>(std::max<int64_t>(total.steps, 1));
  std::printf("  %-6s %-9s %8s %7s %9s %10s %14s %16s\n", "stage", "worker", "compute", "bubble", "overhead",
              "in flight", "CPU ms/step", "CPU not compute");
  for (int64_t s = 0; s < total.numStages(); ++s) {
    const double compute = total.busySeconds[s] / total.wallSeconds;
    const double bubble = std::max(0.0, total.idealSeconds - total.busySeconds[s]) / total.wallSeconds;
    const double overhead = std::max(0.0, total.wallSeconds - total.idealSeconds) / total.wallSeconds;
    const double stageCpu = cpu.stages[s];
    const double notCompute = stageCpu > 0 ? std::max(0.0, stageCpu - cpu.stagesCompute[s]) / stageCpu : 0.0;
    std::printf("  %-6lld %-9s %8s %7s %9s %10lld %14.1f %16s\n", static_cast<long long>(s), workers[s].c_str(),
                percent(compute).c_str(), percent(bubble).c_str(), percent(overhead).c_str(),
                static_cast<long long>(total.maxInFlight[s]), 1e3 * stageCpu / steps, percent(notCompute).c_str());
  }
  std::printf("  driver CPU %.1f ms/step (data, calls, optimizer step)\n", 1e3 * cpu.driver / steps);
  std::printf(
      "RPC overhead is %s of the step; bubbles %s; compute %s (ideal pipelined step %.1f ms, measured %.1f ms)\n",
      percent(total.overheadShare()).c_str(), percent(total.bubbleShare()).c_str(),
      percent(total.computeShare()).c_str(), 1e3 * total.idealSeconds / std::max<int64_t>(total.steps, 1),
      1e3 * total.wallSeconds / std::max<int64_t>(total.steps, 1));
}

int runDriver(rpc::Agent& agent, const examples::PipelineFlags& opt) {
  const examples::Data data = examples::loadFashionMnist(opt.dataDir, opt.limit);
  const pipeline::ModelSpec spec = opt.modelSpec();
  // The partition is computed here, on the driver's own copy of the model (the stage workers build theirs
  // from the same seed): by time on a micro-batch of real images, or by parameter count.
  const pipeline::Partition partition = [&] {
    auto model = pipeline::buildModel(spec);
    const auto units = pipeline::modelUnits(spec, model);
    const int64_t microSize = std::max<int64_t>(1, opt.batchSize / opt.microBatches);
    const Tensor sample = narrow(data.train.inputs(), 0, 0, std::min(microSize, data.train.size()));
    return pipeline::balance(units, opt.stages, pipeline::parseBalanceBy(opt.balance), sample);
  }();
  std::vector<pipeline::RemoteStage> stages;
  const std::vector<pipeline::StageSpec> specs = pipeline::stageSpecs(spec, partition);
  const std::vector<std::string> workers = agent.workerNames();  // by rank; rank 0 is this driver
  for (size_t s = 0; s < specs.size(); ++s) {
    const Device device = opt.stageDevice(static_cast<int64_t>(s));
    // "workerN" for a CPU stage (the placement every earlier run used), "workerN/cuda:i" for a GPU stage.
    std::string placement = workers.at(s + 1);
    if (device.isCuda()) placement.append("/").append(device.str());
    stages.push_back({placement, specs[s]});
  }

  pipeline::PipelineOptions options;
  options.microBatches = opt.microBatches;
  options.schedule = pipeline::parseSchedule(opt.schedule);
  options.optimizer = opt.optimizerSpec();
  pipeline::RpcPipeline pipe(agent, stages, options);
  std::printf("rpc_pipeline: %s, %s, %s, batch %lld, %lld train / %lld test images, %d thread(s) per process\n",
              spec.describe().c_str(), pipe.describe().c_str(), options.optimizer.describe().c_str(),
              static_cast<long long>(opt.batchSize), static_cast<long long>(data.train.size()),
              static_cast<long long>(data.test.size()), opt.threads);
  std::printf("partition by %s: %s\n", opt.balance.c_str(), partition.describe().c_str());

  data::DataLoader loader(data.train, {.batchSize = opt.batchSize, .shuffle = true, .seed = opt.seed});
  pipeline::StepStats total;
  CpuTotals cpu;
  cpu.stages.assign(static_cast<size_t>(pipe.numStages()), 0.0);
  cpu.stagesCompute.assign(static_cast<size_t>(pipe.numStages()), 0.0);
  int64_t trainImages = 0;
  double accuracy = 0;
  for (int64_t epoch = 1; epoch <= opt.epochs; ++epoch) {
    const std::string label = "epoch " + std::to_string(epoch) + "/" + std::to_string(opt.epochs);
    examples::Progress progress(label, loader.numBatches());
    examples::RunningLoss runningLoss;
    pipeline::StepStats epochStats;
    int64_t done = 0;
    int64_t images = 0;
    const double driverCpuStart = processCpuSeconds();
    for (const auto& batch : loader) {
      const pipeline::StepResult r = pipe.step(batch.inputs, batch.labels);
      epochStats.accumulate(r.stats);
      for (size_t s = 0; s < cpu.stages.size(); ++s) {
        cpu.stages[s] += pipe.lastStageStats()[s].cpuSeconds;
        cpu.stagesCompute[s] += pipe.lastStageStats()[s].computeCpuSeconds;
      }
      images += r.samples;
      const double smoothed = runningLoss.add(r.loss, label + " batch " + std::to_string(done + 1));
      progress.update(++done, images, smoothed);
    }
    cpu.driver += processCpuSeconds() - driverCpuStart;
    total.accumulate(epochStats);
    trainImages += images;
    accuracy = examples::testAccuracy([&](const Tensor& x) { return pipe.predict(x); }, data.test);
    std::printf("epoch %lld: test accuracy %.2f%%, %.0f images/s, compute %s, bubble %s, RPC overhead %s\n",
                static_cast<long long>(epoch), 100.0 * accuracy, static_cast<double>(images) / epochStats.wallSeconds,
                percent(epochStats.computeShare()).c_str(), percent(epochStats.bubbleShare()).c_str(),
                percent(epochStats.overheadShare()).c_str());
    std::fflush(stdout);
  }
  printOverheadSummary(total, cpu, pipe.workers());

  // Every process's peak RSS: the stages report theirs.
  double peakMax = examples::peakRssMiB();
  const std::vector<pipeline::StageStats> finalStats = pipe.stageStats();
  for (const auto& st : finalStats) peakMax = std::max(peakMax, st.peakRssMiB);
  examples::JsonLine json("rpc_pipeline");
  examples::addRunFields(json, "rpc_pipeline", agent.worldSize(), opt, spec.name, data.train.size())
      .add("stages", pipe.numStages())
      .add("micro_batches", opt.microBatches)
      .add("schedule", opt.schedule)
      .add("balance", opt.balance)
      .add("compute_share", total.computeShare())
      .add("bubble_share", total.bubbleShare())
      .add("overhead_share", total.overheadShare())
      .add("rpc_overhead_share", total.overheadShare())
      .add("stage_cpu_ms_per_step", 1e3 * cpu.stagesTotal() / static_cast<double>(std::max<int64_t>(total.steps, 1)))
      .add("stage_cpu_noncompute_share",
           cpu.stagesTotal() > 0 ? std::max(0.0, 1.0 - cpu.computeTotal() / cpu.stagesTotal()) : 0.0)
      .add("driver_cpu_ms_per_step", 1e3 * cpu.driver / static_cast<double>(std::max<int64_t>(total.steps, 1)))
      .add("images_per_s", static_cast<double>(trainImages) / total.wallSeconds)
      .add("test_accuracy", accuracy)
      .add("peak_rss_mib", examples::peakRssMiB())
      .add("peak_rss_mib_max", peakMax);
  for (int64_t s = 0; s < total.numStages(); ++s) {
    json.add("peak_activation_bytes_stage" + std::to_string(s), total.peakActivationBytes[s]);
    json.add("peak_rss_mib_stage" + std::to_string(s), finalStats[static_cast<size_t>(s)].peakRssMiB);
  }
  json.print();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  examples::PipelineFlags opt;
  examples::Flags flags("rpc_pipeline", "pipeline-parallel training over RPC: stages on worker processes");
  examples::parsePipelineFlags(flags, opt, argc, argv, "--stage-workers",
                               "pipeline stages, one per worker process (--nproc = this + 1)", /*pipelined=*/true,
                               /*perStageDevices=*/true);
  try {
    tensor::setNumThreads(opt.threads);
    rpc::Options rpcOptions = rpc::Options::fromEnv();
    if (!opt.traceDir.empty()) rpcOptions.traceDir = opt.traceDir;  // on every worker: the flags are the same
    if (rpcOptions.worldSize != opt.stages + 1) {
      std::cerr << "rpc_pipeline: " << opt.stages << " stage workers need " << opt.stages + 1
                << " processes (a driver and the stages), got " << rpcOptions.worldSize
                << ": run it as distgrad-run --nproc " << opt.stages + 1 << " -- rpc_pipeline ...\n";
      return 2;
    }
    // A stage process that cannot use its --device stops here, before joining (the others then fail to
    // rendezvous with it and the launcher reports it).
    if (rpcOptions.rank > 0) examples::checkStageDeviceOrExit(flags, opt, rpcOptions.rank - 1);
    // Every worker serves the same functions: the RRef protocol, distributed autograd, the optimizer's
    // parts and the pipeline stages.
    rpc::Registry reg;
    rref::RRefContext::install(reg);
    autograd::distributed::install(reg);
    models::optim::DistributedOptimizer::install(reg);
    pipeline::installPipeline(reg);
    auto agent = rpc::Agent::start(rpcOptions, reg);

    int status = 0;
    if (agent->rank() == 0) status = runDriver(*agent, opt);
    const std::string traceFile = trace::workerFile(agent->traceWorker());
    // Graceful: a barrier of every process. A stage worker serves the pipeline here until the driver is done
    // (the first barrier waits while the driver is alive; it fails at once if the driver dies).
    agent->shutdown();  // writes the trace file
    if (!traceFile.empty())
      std::printf("rpc_pipeline: %s's trace written to %s\n", agent->name().c_str(), traceFile.c_str());
    return status;
  } catch (const std::exception& e) {
    std::cerr << "rpc_pipeline: error: " << e.what() << "\n";
    return 1;
  }
}
