// bench_pipeline_trace: what tracing costs an RpcPipeline's throughput (docs/tracing.md, Cost; issue 7's
// "<= 3% when on"). rpc_pipeline's quick job (ResNet-18 of base width 8, Fashion-MNIST-sized 1x28x28
// images, batch 32, 4 micro-batches, 1F1B, two stages balanced by parameters, Adam) on a driver and two
// stage workers over tcp on loopback, all three agents in this process, every agent tracing into a
// temporary directory. Steps alternate between recording and trace::setPaused(true) (A B B A ..., so slow
// drifts of a shared machine's load hit both alike), and the two sets of step times are compared: on a
// loaded machine separate off/on runs differ by far more than tracing costs, paired steps do not.
//
//   bench_pipeline_trace [steps=120] [width=8]
//
// Lines: step_ms and cpu_ms_per_step (this process: all three workers) with "trace":"off"/"on" (median,
// p10, p90); throughput_cost: 1 - (images/s on) / (images/s off) from the median step times, from_p10 from
// the p10s (the steps other processes disturbed least), cpu_cost (CPU per step on / off - 1);
// events_per_step (recorded while on, all three workers) with pipeline_events_per_step.
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "bench/bench_util.h"
#include "models/optim/distributed_optimizer.h"
#include "models/pipeline/model_spec.h"
#include "models/pipeline/partition.h"
#include "models/pipeline/rpc_pipeline.h"
#include "rpc/agent.h"
#include "rpc/store.h"
#include "rpc/trace.h"
#include "rref/context.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/random.h"

using namespace distgrad;
namespace pipeline = distgrad::models::pipeline;

namespace {

constexpr int kWorkers = 3;  // the driver and two stages

rpc::Registry pipelineRegistry() {
  rpc::Registry reg;
  rref::RRefContext::install(reg);
  autograd::distributed::install(reg);
  models::optim::DistributedOptimizer::install(reg);
  pipeline::installPipeline(reg);
  return reg;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 120;
  const int64_t width = argc > 2 ? std::atoll(argv[2]) : 8;
  if (steps < 4 || width < 1) {
    std::fprintf(stderr, "usage: bench_pipeline_trace [steps>=4] [width>=1]\n");
    return 2;
  }
  tensor::setNumThreads(1);
  std::string pattern = (std::filesystem::temp_directory_path() / "dg-bench-trace-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    std::fprintf(stderr, "bench_pipeline_trace: cannot create a temporary directory\n");
    return 1;
  }
  const std::string traceDir = pattern;

  auto store = rpc::StoreServer::start("127.0.0.1:0");
  const rpc::Registry reg = pipelineRegistry();
  std::vector<std::unique_ptr<rpc::Agent>> agents(kWorkers);
  {
    std::vector<std::thread> starting;
    for (int rank = 0; rank < kWorkers; ++rank) {
      starting.emplace_back([&, rank] {
        rpc::Options options;
        options.rank = rank;
        options.worldSize = kWorkers;
        options.transport = "tcp";
        options.storeAddr = store->address();
        options.secret = "bench";
        options.traceDir = traceDir;
        agents[static_cast<size_t>(rank)] = rpc::Agent::start(options, reg);
      });
    }
    for (auto& t : starting) t.join();
  }

  pipeline::ModelSpec spec;
  spec.baseWidth = width;
  const int64_t batch = 32;
  {
    auto model = pipeline::buildModel(spec);
    const auto units = pipeline::modelUnits(spec, model);
    tensor::Generator gen(1);
    const Tensor sample = tensor::uniform({batch / 4, 1, 28, 28}, -1.0, 1.0, gen);
    const pipeline::Partition partition = pipeline::balance(units, 2, pipeline::BalanceBy::kParameters, sample);
    const std::vector<pipeline::StageSpec> specs = pipeline::stageSpecs(spec, partition);
    pipeline::RpcPipeline pipe(*agents[0], {{"worker1", specs[0]}, {"worker2", specs[1]}},
                               {.microBatches = 4,
                                .schedule = pipeline::Schedule::k1F1B,
                                .optimizer = models::optim::OptimizerSpec::adam({.learningRate = 1e-3})});
    tensor::Generator data(2);
    const Tensor images = tensor::uniform({batch, 1, 28, 28}, -1.0, 1.0, data);
    std::vector<int64_t> classes;
    for (int64_t i = 0; i < batch; ++i) classes.push_back(static_cast<int64_t>(data.below(10)));
    const Tensor labels = Tensor::fromVector(classes, {batch});

    for (int i = 0; i < 5; ++i) (void)pipe.step(images, labels);  // warm: connections, pools, oneDNN
    std::vector<double> off, on, cpuOff, cpuOn;
    uint64_t eventsOn = 0;
    for (int i = 0; i < steps; ++i) {
      const bool traced = (i % 4 == 0) || (i % 4 == 3);  // A B B A
      trace::setPaused(!traced);
      const uint64_t before = trace::stats().recorded;
      const double cpu0 = bench::processCpuSeconds();
      const auto t0 = std::chrono::steady_clock::now();
      (void)pipe.step(images, labels);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      (traced ? on : off).push_back(seconds);
      (traced ? cpuOn : cpuOff).push_back(bench::processCpuSeconds() - cpu0);
      if (traced) eventsOn += trace::stats().recorded - before;
    }
    trace::setPaused(false);
    auto toMs = [](std::vector<double> v) {
      for (double& x : v) x *= 1e3;
      return v;
    };
    const bench::Stats offMs = bench::statsOf(toMs(off));
    const bench::Stats onMs = bench::statsOf(toMs(on));
    const std::map<std::string, std::string> config{{"width", std::to_string(width)},
                                                    {"batch", std::to_string(batch)},
                                                    {"micro_batches", "4"},
                                                    {"schedule", bench::quoted("1f1b")},
                                                    {"stages", "2"}};
    auto with = [&](std::map<std::string, std::string> extra) {
      extra.insert(config.begin(), config.end());
      return extra;
    };
    bench::emit("pipeline_trace", "step_ms", "ms", offMs, with({{"trace", bench::quoted("off")}}));
    bench::emit("pipeline_trace", "step_ms", "ms", onMs, with({{"trace", bench::quoted("on")}}));
    // CPU of all three workers per step: on a loaded machine it moves far less than wall time.
    const bench::Stats cpuOffMs = bench::statsOf(toMs(cpuOff));
    const bench::Stats cpuOnMs = bench::statsOf(toMs(cpuOn));
    bench::emit("pipeline_trace", "cpu_ms_per_step", "ms", cpuOffMs, with({{"trace", bench::quoted("off")}}));
    bench::emit("pipeline_trace", "cpu_ms_per_step", "ms", cpuOnMs, with({{"trace", bench::quoted("on")}}));
    // 1 - (images/s on) / (images/s off), from the medians and from the p10s (the steps least disturbed by
    // other processes), and the CPU cost, from the medians.
    bench::Stats cost;
    cost.median = 1.0 - offMs.median / onMs.median;
    cost.p10 = cost.p90 = cost.median;
    cost.n = 1;
    bench::emit("pipeline_trace", "throughput_cost", "fraction", cost,
                with({{"from_p10", bench::number(1.0 - offMs.p10 / onMs.p10)},
                      {"cpu_cost", bench::number(cpuOnMs.median / cpuOffMs.median - 1.0)}}));
    bench::Stats events;
    events.median = events.p10 = events.p90 = static_cast<double>(eventsOn) / static_cast<double>(on.size());
    events.n = on.size();
    bench::emit("pipeline_trace", "events_per_step", "events", events,
                with({{"pipeline_events_per_step", std::to_string(2 * 2 * 4 + 1)}}));
  }

  std::vector<std::thread> stopping;
  for (auto& a : agents) stopping.emplace_back([&a] { a->shutdown(); });
  for (auto& t : stopping) t.join();
  agents.clear();
  std::error_code ec;
  std::filesystem::remove_all(traceDir, ec);
  return 0;
}
