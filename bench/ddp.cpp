// bench_ddp: DistributedDataParallel training throughput against single-process training of the same model,
// in one run (issue 10's "DDP step on ResNet-18 with 2 processes >= 1.7x single-process images/s when each
// process has its own core"):
//   ddp single_images_per_s   one process trains ResNet-18 (CIFAR stem, base width W) with SGD + momentum on
//                             batches of B synthetic 1x28x28 images, one oneDNN thread: images/s per step
//   ddp ddp_images_per_s      N processes (fork; tcp on 127.0.0.1; DDP's default 25 MB buckets) each train a
//                             replica on their own B images per step (weak scaling, as DDP is used): images/s
//                             of all ranks per step (rank 0's step times, N x B images each), ratio_vs_single
//                             = median / the single-process median of the same round, and overhead_share =
//                             the part of a step not spent in forward + backward (waiting for the all-reduce
//                             that did not overlap, the optimizer)
// The two alternate for `rounds` rounds so both see the same machine load (the machine is shared); every line
// carries the load average at its start and end and the cores online. The target needs a free core per process
// (plus headroom for the all-reduce's executor threads): on a machine with fewer idle cores than processes the
// ratio measures core sharing, not DDP.
// This is its own program rather than a case of bench_collectives, which links dg_rpc only (no models).
// JSON lines (bench/bench_util.h). Usage:
//   bench_ddp [procs=2] [width=64] [batch=32] [steps=6] [rounds=2]
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "bench/bench_util.h"
#include "bench/socket_bench_util.h"
#include "models/optim/distributed_optimizer.h"
#include "models/parallel/ddp.h"
#include "models/pipeline/model_spec.h"
#include "rpc/agent.h"
#include "rpc/collectives/process_group.h"
#include "rpc/store.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/random.h"

namespace distgrad::bench {
namespace {

struct Config {
  int procs = 2;
  int64_t width = 64;
  int64_t batch = 32;
  int steps = 6;
  int rounds = 2;
  static constexpr int kWarmup = 2;
};

// Per timed step: wall seconds and forward + backward seconds; and the CPU seconds the timed steps cost
// (whole processes: compute, the all-reduce's executor and I/O threads; summed over the ranks).
struct StepTimes {
  std::vector<double> wall, compute;
  double cpuSeconds = 0;
};

double loadAverage() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : -1;
}

// Trains `config.steps` timed steps (after kWarmup untimed ones) on synthetic data; with `ddp`, through it.
StepTimes train(const Config& config, int rank, models::DistributedDataParallel* ddp, models::Module& model) {
  tensor::Generator gen(1000 + static_cast<uint64_t>(rank));
  const Tensor x = tensor::uniform({config.batch, 1, 28, 28}, -1.0, 1.0, gen);
  std::vector<int64_t> labels(static_cast<size_t>(config.batch));
  for (auto& l : labels) l = static_cast<int64_t>(gen.below(10));
  const Tensor y = Tensor::fromVector(labels, {config.batch});
  auto optimizer = models::optim::OptimizerSpec::sgd({.learningRate = 0.01, .momentum = 0.9}).make(model.parameters());
  StepTimes times;
  double cpuStart = 0;
  for (int step = 0; step < Config::kWarmup + config.steps; ++step) {
    if (step == Config::kWarmup) cpuStart = processCpuSeconds();
    const auto start = std::chrono::steady_clock::now();
    model.zeroGrad();
    Tensor logits = ddp != nullptr ? ddp->forward(x) : model.forward(x);
    autograd::backward(std::vector<Tensor>{crossEntropy(logits, y)});
    const double compute = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (ddp != nullptr) ddp->synchronize();
    optimizer->step();
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (step >= Config::kWarmup) {
      times.wall.push_back(wall);
      times.compute.push_back(compute);
    }
  }
  times.cpuSeconds = processCpuSeconds() - cpuStart;
  return times;
}

std::shared_ptr<models::Module> buildResNet(const Config& config) {
  models::pipeline::ModelSpec spec;
  spec.name = "resnet18";
  spec.baseWidth = config.width;
  spec.seed = 7;
  return models::pipeline::buildModel(spec);
}

// A connected pair of Unix sockets ([0] reads, [1] writes, by convention here): readFully / writeFully
// (socket_bench_util.h) use recv / send, which pipes do not support.
bool channel(int fds[2]) { return ::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0; }

void writeTimes(int fd, const StepTimes& t) {
  const auto n = static_cast<uint32_t>(t.wall.size());
  writeFully(fd, &n, sizeof n);
  writeFully(fd, t.wall.data(), n * sizeof(double));
  writeFully(fd, t.compute.data(), n * sizeof(double));
  writeFully(fd, &t.cpuSeconds, sizeof t.cpuSeconds);
}

StepTimes readTimes(int fd) {
  uint32_t n = 0;
  readFully(fd, &n, sizeof n);
  StepTimes t;
  t.wall.resize(n);
  t.compute.resize(n);
  readFully(fd, t.wall.data(), n * sizeof(double));
  readFully(fd, t.compute.data(), n * sizeof(double));
  readFully(fd, &t.cpuSeconds, sizeof t.cpuSeconds);
  return t;
}

// Every measurement runs in forked processes, so this one never starts a thread and can fork again.
StepTimes runSingle(const Config& config) {
  int fds[2];
  check(channel(fds), "socketpair");
  pid_t pid = forkChild(false, [&] {
    ::close(fds[0]);
    tensor::setNumThreads(1);
    auto model = buildResNet(config);
    writeTimes(fds[1], train(config, 0, nullptr, *model));
  });
  ::close(fds[1]);
  StepTimes t = readTimes(fds[0]);
  ::close(fds[0]);
  reap(pid);
  return t;
}

StepTimes runDdp(const Config& config) {
  // The rendezvous store lives in a process of its own until every rank is gone.
  int portPipe[2], holdPipe[2], resultPipe[2];
  check(channel(portPipe) && channel(holdPipe) && channel(resultPipe), "socketpair");
  pid_t storePid = forkChild(false, [&] {
    ::close(portPipe[0]);
    ::close(holdPipe[1]);
    ::close(resultPipe[0]);
    ::close(resultPipe[1]);
    auto store = rpc::StoreServer::start("127.0.0.1:0");
    const int port = store->port();
    writeFully(portPipe[1], &port, sizeof port);
    char byte = 0;
    (void)::read(holdPipe[0], &byte, 1);  // returns when the parent closes its end
  });
  ::close(portPipe[1]);
  ::close(holdPipe[0]);
  int storePort = 0;
  readFully(portPipe[0], &storePort, sizeof storePort);
  ::close(portPipe[0]);
  std::vector<pid_t> ranks;
  for (int rank = 0; rank < config.procs; ++rank) {
    ranks.push_back(forkChild(false, [&, rank] {
      ::close(resultPipe[0]);
      ::close(holdPipe[1]);
      tensor::setNumThreads(1);
      rpc::Options o;
      o.rank = rank;
      o.worldSize = config.procs;
      o.transport = "tcp";
      o.storeAddr = "127.0.0.1:" + std::to_string(storePort);
      o.executorThreads = 2;
      o.secret = "bench";
      o.defaultTimeout = std::chrono::milliseconds(300'000);
      rpc::Registry reg;
      rpc::collectives::install(reg);
      auto agent = rpc::Agent::start(o, reg);
      StepTimes times;
      {
        auto group = rpc::collectives::ProcessGroup::world(*agent);
        auto model = buildResNet(config);
        models::DistributedDataParallel ddp(*model, group);
        times = train(config, rank, &ddp, *model);
        Tensor cpu = Tensor::fromVector(std::vector<double>{times.cpuSeconds}, {1});
        group.allReduceSync(cpu);  // every rank's CPU time
        times.cpuSeconds = cpu.item();
      }
      agent->shutdown();
      if (rank == 0) writeTimes(resultPipe[1], times);
    }));
  }
  ::close(resultPipe[1]);
  StepTimes t = readTimes(resultPipe[0]);
  ::close(resultPipe[0]);
  for (pid_t pid : ranks) reap(pid);
  ::close(holdPipe[1]);
  reap(storePid);
  return t;
}

std::vector<double> imagesPerSecond(const std::vector<double>& seconds, double images) {
  std::vector<double> out;
  for (double s : seconds) out.push_back(images / s);
  return out;
}

double overheadShare(const StepTimes& t) {
  double wall = 0, compute = 0;
  for (size_t i = 0; i < t.wall.size(); ++i) {
    wall += t.wall[i];
    compute += t.compute[i];
  }
  return wall > 0 ? 1.0 - compute / wall : 0.0;
}

Config parse(int argc, char** argv) {
  Config c;
  if (argc > 1) c.procs = std::atoi(argv[1]);
  if (argc > 2) c.width = std::atoll(argv[2]);
  if (argc > 3) c.batch = std::atoll(argv[3]);
  if (argc > 4) c.steps = std::atoi(argv[4]);
  if (argc > 5) c.rounds = std::atoi(argv[5]);
  check(c.procs >= 2 && c.procs <= 16, "procs must be in [2, 16]");
  check(c.width >= 1 && c.batch >= 1 && c.steps >= 1 && c.rounds >= 1, "width, batch, steps, rounds must be >= 1");
  return c;
}

}  // namespace
}  // namespace distgrad::bench

int main(int argc, char** argv) {
  using namespace distgrad::bench;
  const Config config = parse(argc, argv);
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  for (int round = 1; round <= config.rounds; ++round) {
    const double load0 = loadAverage();
    const StepTimes single = runSingle(config);
    const double load1 = loadAverage();
    const StepTimes ddp = runDdp(config);
    const double load2 = loadAverage();
    const Stats singleRate = statsOf(imagesPerSecond(single.wall, static_cast<double>(config.batch)));
    const Stats ddpRate = statsOf(imagesPerSecond(ddp.wall, static_cast<double>(config.batch * config.procs)));
    const std::map<std::string, std::string> common{{"model", quoted("resnet18")},
                                                    {"width", std::to_string(config.width)},
                                                    {"batch_per_process", std::to_string(config.batch)},
                                                    {"round", std::to_string(round)},
                                                    {"cores_online", std::to_string(cores)}};
    auto singleExtra = common;
    singleExtra["procs"] = "1";
    singleExtra["overhead_share"] = number(overheadShare(single));
    singleExtra["loadavg_1m_start"] = number(load0);
    singleExtra["loadavg_1m_end"] = number(load1);
    emit("ddp", "single_images_per_s", "images/s", singleRate, singleExtra);
    auto ddpExtra = common;
    ddpExtra["procs"] = std::to_string(config.procs);
    ddpExtra["overhead_share"] = number(overheadShare(ddp));
    ddpExtra["ratio_vs_single"] = number(ddpRate.median / singleRate.median);
    // Images per CPU-second of all processes, against the single process's: what DDP costs in CPU
    // (communication threads included), independent of how many cores the load left free.
    const double singleCpuRate = static_cast<double>(config.batch * config.steps) / single.cpuSeconds;
    const double ddpCpuRate = static_cast<double>(config.batch * config.steps * config.procs) / ddp.cpuSeconds;
    ddpExtra["images_per_cpu_s"] = number(ddpCpuRate);
    ddpExtra["single_images_per_cpu_s"] = number(singleCpuRate);
    ddpExtra["cpu_efficiency_vs_single"] = number(ddpCpuRate / singleCpuRate);
    ddpExtra["loadavg_1m_start"] = number(load1);
    ddpExtra["loadavg_1m_end"] = number(load2);
    emit("ddp", "ddp_images_per_s", "images/s", ddpRate, ddpExtra);
  }
  return 0;
}
