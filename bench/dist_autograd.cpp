// Distributed training step against the same step in one process (issue 5), measured in one run: two
// processes (fork) on 127.0.0.1 over tcp, worker0 (this process, the driver, hosting the store) and worker1
// (the child), each agent with one executor thread and one compute thread.
// The model: an MLP of 4 Linear layers 1024 -> 1024 with ReLU between them, float32, batch 64, MSE loss
// against a fixed target. Split in two halves: layers 1-2 (+ the ReLU after layer 2) on worker0, layers 3-4
// on worker1 as a RemoteModule. One distributed iteration is
//   { DistContext ctx; loss = mse(half2.forward(relu(half1(x))), y); ctx.backward(loss); opt.step(ctx); }
// with a DistributedOptimizer (SGD, lr 0.01, momentum 0.9) over worker1's parameters (RRefs) and worker0's
// (local); the local iteration is zeroGrad + forward + backward + SGD step of the same model in this
// process. Both backward modes (kExact, kFast) are measured. The three variants alternate in chunks of 5
// iterations so they see the same machine load.
//   dist_autograd local_ms_per_iter        ms per local iteration (median, p10, p90)
//   dist_autograd distributed_ms_per_iter  ms per distributed iteration, one line per mode, with
//                                          ratio_vs_local (median distributed / median local; target <=
//                                          1.10), p90_ratio_vs_local, the calls and bytes worker0 sent to
//                                          and received from worker1 per iteration (rpc::Agent::metrics),
//                                          and cpu_ms_per_iter_worker0/worker1 (process CPU per iteration)
// Every line carries forward_ms / backward_ms / step_ms (medians of each phase).
// JSON lines (bench/bench_util.h). Usage: bench_dist_autograd [iters=100] [warmup=10]   (about 10 s)
#include <algorithm>
#include <chrono>
#include <csignal>
#include <map>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "bench/agent_pair.h"
#include "models/optim/distributed_optimizer.h"
#include "models/optim/sgd.h"
#include "models/zoo/mlp.h"
#include "rpc/agent.h"
#include "rref/context.h"
#include "rref/remote_module.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/random.h"

namespace distgrad::bench {

inline const rpc::Class<models::MLP>& halfClass() {
  static const rpc::Class<models::MLP> cls = rref::moduleClass<models::MLP>("bench.MLPHalf");
  return cls;
}

}  // namespace distgrad::bench

DG_REMOTE_MODULE(distgrad::models::MLP, distgrad::bench::halfClass());

namespace distgrad::bench {
namespace {

using autograd::distributed::BackwardMode;
using autograd::distributed::DistContext;
using models::optim::DistributedOptimizer;
using models::optim::OptimizerSpec;

constexpr int64_t kWidth = 1024;
constexpr int64_t kBatch = 64;
constexpr uint64_t kSeedHalf1 = 1;
constexpr uint64_t kSeedHalf2 = 2;
constexpr int kChunk = 5;
const models::optim::SgdOptions kSgd{.learningRate = 0.01, .momentum = 0.9};

std::vector<int64_t> halfSizes() { return {kWidth, kWidth, kWidth}; }

std::shared_ptr<models::MLP> makeHalf(uint64_t seed) {
  tensor::Generator gen(seed);
  return std::make_shared<models::MLP>(halfSizes(), gen);
}

rpc::Registry makeRegistry(int) {
  rpc::Registry registry;
  rref::RRefContext::install(registry);
  autograd::distributed::install(registry);
  DistributedOptimizer::install(registry);
  rref::bindRemoteModule(registry, halfClass()).factory<uint64_t>(&makeHalf);
  return registry;
}


// Per-phase milliseconds of a variant's iterations, and what it cost beyond them.
struct Samples {
  std::vector<double> total, forward, backward, step;
  rpc::PeerMetrics traffic;  // sums over the timed iterations (calls, bytes)
  double cpuWorker0 = 0, cpuWorker1 = 0;
  int timed = 0;
};

double msSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::map<std::string, std::string> phases(const Samples& s) {
  return {{"forward_ms", number(statsOf(s.forward).median)},
          {"backward_ms", number(statsOf(s.backward).median)},
          {"step_ms", number(statsOf(s.step).median)}};
}

}  // namespace
}  // namespace distgrad::bench

int main(int argc, char** argv) {
  using namespace distgrad;
  using namespace distgrad::bench;
  int iters = 100;
  int warmup = 10;
  if (argc > 1) iters = std::max(std::atoi(argv[1]), kChunk);
  if (argc > 2) warmup = std::max(std::atoi(argv[2]), 0);
  std::signal(SIGPIPE, SIG_IGN);

  // Forks first: no thread may exist in this process before. One executor thread and one compute thread
  // per worker.
  AgentPair pair(
      false, [](int rank, const std::string& store) { return AgentPair::tcpOptions(rank, store, 1); }, makeRegistry,
      [] { tensor::setNumThreads(1); });
  tensor::setNumThreads(1);
  rpc::Agent& agent = pair.agent();

  tensor::Generator dataGen(7);
  const Tensor x = tensor::uniform({kBatch, kWidth}, -1.0, 1.0, dataGen);
  const Tensor y = tensor::uniform({kBatch, kWidth}, -1.0, 1.0, dataGen);

  // The local model and its optimizer.
  auto localHalf1 = makeHalf(kSeedHalf1);
  auto localHalf2 = makeHalf(kSeedHalf2);
  std::vector<Tensor> localParams = localHalf1->parameters();
  for (const auto& p : localHalf2->parameters()) localParams.push_back(p);
  models::optim::SGD localOpt(localParams, kSgd);

  // The split model: half 1 here, half 2 on worker1.
  auto half1 = makeHalf(kSeedHalf1);
  auto half2 = rref::RemoteModule<models::MLP>::create(agent, "worker1", kSeedHalf2);
  DistributedOptimizer distOpt(agent, OptimizerSpec::sgd(kSgd), half2.remoteParameters(), half1->parameters());

  auto localIteration = [&](Samples& s, bool timed) {
    const auto t0 = std::chrono::steady_clock::now();
    localOpt.zeroGrad();
    Tensor loss = mseLoss(localHalf2->forward(relu(localHalf1->forward(x))), y);
    const double forward = msSince(t0);
    const auto t1 = std::chrono::steady_clock::now();
    distgrad::backward(loss);
    const double backward = msSince(t1);
    const auto t2 = std::chrono::steady_clock::now();
    localOpt.step();
    const double step = msSince(t2);
    if (!timed) return;
    s.total.push_back(msSince(t0));
    s.forward.push_back(forward);
    s.backward.push_back(backward);
    s.step.push_back(step);
  };
  auto distributedIteration = [&](BackwardMode mode, Samples& s, bool timed) {
    const rpc::PeerMetrics m0 = agent.metrics("worker1");
    const double cpu0 = timed ? processCpuSeconds() : 0;
    const double cpu1 = timed ? pair.childCpuSeconds() : 0;
    const auto t0 = std::chrono::steady_clock::now();
    double forward = 0, backward = 0, step = 0;
    {
      DistContext ctx(agent);
      Tensor loss = mseLoss(half2.forward(relu(half1->forward(x))), y);
      forward = msSince(t0);
      const auto t1 = std::chrono::steady_clock::now();
      autograd::distributed::BackwardOptions options;
      options.mode = mode;
      ctx.backward({loss}, options);
      backward = msSince(t1);
      const auto t2 = std::chrono::steady_clock::now();
      distOpt.step(ctx);
      step = msSince(t2);
    }  // the context's release is part of the iteration
    const double total = msSince(t0);
    if (!timed) return;
    s.cpuWorker1 += pair.childCpuSeconds() - cpu1;
    s.cpuWorker0 += processCpuSeconds() - cpu0;
    const rpc::PeerMetrics m1 = agent.metrics("worker1");
    s.traffic.callsSent += m1.callsSent - m0.callsSent;
    s.traffic.callsReceived += m1.callsReceived - m0.callsReceived;
    s.traffic.bytesSent += m1.bytesSent - m0.bytesSent;
    s.traffic.bytesReceived += m1.bytesReceived - m0.bytesReceived;
    s.total.push_back(total);
    s.forward.push_back(forward);
    s.backward.push_back(backward);
    s.step.push_back(step);
    ++s.timed;
  };

  Samples local, exact, fast;
  for (int i = 0; i < warmup; ++i) {
    localIteration(local, false);
    distributedIteration(BackwardMode::kExact, exact, false);
    distributedIteration(BackwardMode::kFast, fast, false);
  }
  for (int done = 0; done < iters; done += kChunk) {
    const int n = std::min(kChunk, iters - done);
    for (int i = 0; i < n; ++i) localIteration(local, true);
    for (int i = 0; i < n; ++i) distributedIteration(BackwardMode::kExact, exact, true);
    for (int i = 0; i < n; ++i) distributedIteration(BackwardMode::kFast, fast, true);
  }

  const std::map<std::string, std::string> common = {{"impl", quoted("distgrad")},
                                                     {"model", quoted("mlp_4x1024_relu")},
                                                     {"batch", std::to_string(kBatch)},
                                                     {"dtype", quoted("float32")},
                                                     {"optimizer", quoted("sgd_momentum")},
                                                     {"transport", quoted("tcp")},
                                                     {"executor_threads", "1"},
                                                     {"compute_threads", "1"}};
  const Stats localStats = statsOf(local.total);
  {
    auto extra = common;
    extra["placement"] = quoted("one_process");
    for (auto& [k, v] : phases(local)) extra[k] = v;
    emit("dist_autograd", "local_ms_per_iter", "ms", localStats, extra);
  }
  for (const auto& [mode, s] : std::vector<std::pair<const char*, Samples*>>{{"exact", &exact}, {"fast", &fast}}) {
    const Stats stats = statsOf(s->total);
    auto extra = common;
    extra["placement"] = quoted("2_workers_2_processes");
    extra["mode"] = quoted(mode);
    for (auto& [k, v] : phases(*s)) extra[k] = v;
    const double perIter = 1.0 / std::max(s->timed, 1);
    extra["ratio_vs_local"] = number(stats.median / localStats.median);
    extra["p90_ratio_vs_local"] = number(stats.p90 / localStats.p90);
    extra["target_ratio"] = "1.1";
    extra["calls_sent_per_iter"] = number(static_cast<double>(s->traffic.callsSent) * perIter);
    extra["calls_received_per_iter"] = number(static_cast<double>(s->traffic.callsReceived) * perIter);
    extra["bytes_sent_per_iter"] = number(static_cast<double>(s->traffic.bytesSent) * perIter);
    extra["bytes_received_per_iter"] = number(static_cast<double>(s->traffic.bytesReceived) * perIter);
    extra["cpu_ms_per_iter_worker0"] = number(1000.0 * s->cpuWorker0 * perIter);
    extra["cpu_ms_per_iter_worker1"] = number(1000.0 * s->cpuWorker1 * perIter);
    emit("dist_autograd", "distributed_ms_per_iter", "ms", stats, extra);
  }
  return 0;
}
