// All-reduce bus bandwidth of rpc::collectives against the raw loopback limit, in one run: N processes
// (fork) on 127.0.0.1 over tcp, for N in the `procs` list.
//   collectives raw_ring_link_SIZE   plain blocking sockets in a ring of N processes: each sends SIZE bytes
//                                    to its successor while receiving SIZE from its predecessor (a writer
//                                    thread and the reading main thread); GB/s per link = SIZE / time. This
//                                    is what the transport can move per link when every link is busy at
//                                    once, which is exactly the load a ring all-reduce puts on it.
//   collectives allreduce_SIZE       ProcessGroup::allReduce (sum, float32, kAuto: recursive doubling up to
//                                    64 KB, ring above) of a SIZE-byte tensor: busbw = 2(N-1)/N x SIZE / time
//                                    (nccl-tests' definition: the bytes each link carries in a ring), with
//                                    ratio_vs_raw = busbw / raw_ring_link of the same SIZE and N, and
//                                    algbw = SIZE / time.
//   collectives allreduce_fp16_64MB  the same at 64 MB with float16 on the wire (busbw counted in float32
//                                    bytes, i.e. the rate of the job's data, not of the wire)
// Times are rank 0's, from the end of a barrier to the end of the all-reduce. Every line carries the load
// average (loadavg_1m) at its start: the machine is shared.
// JSON lines (bench/bench_util.h). Usage:
//   bench_collectives [procs=2,4] [max_mb=256] [segment_kb=1024] [window=8] [seconds=1.5]
// procs: world sizes to run; max_mb: the largest size (sizes are 4 KB, 64 KB, 1 MB, 16 MB, 64 MB, 256 MB up
// to it); segment_kb / window: ProcessGroupOptions::segmentBytes / maxSegmentsInFlight; seconds: sets the
// repetitions per size as seconds x 1 GB/s / size, at least 3 and at most 200.
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include "bench/socket_bench_util.h"
#include "rpc/agent.h"
#include "rpc/collectives/process_group.h"
#include "rpc/store.h"

namespace distgrad::bench {
namespace {

using rpc::collectives::AllReduceOptions;
using rpc::collectives::ProcessGroup;
using rpc::collectives::ProcessGroupOptions;
using rpc::collectives::WireCompression;
using tensor::Tensor;

struct Config {
  std::vector<int> procs{2, 4};
  size_t maxBytes = size_t{256} << 20;
  size_t segmentBytes = size_t{1} << 20;
  size_t window = 8;
  double seconds = 1.5;
};

std::vector<size_t> sizes(const Config& config) {
  std::vector<size_t> out;
  for (size_t s : {size_t{4} << 10, size_t{64} << 10, size_t{1} << 20, size_t{16} << 20, size_t{64} << 20,
                   size_t{256} << 20}) {
    if (s <= config.maxBytes) out.push_back(s);
  }
  return out;
}

std::string sizeName(size_t bytes) {
  if (bytes >= (1u << 20)) return std::to_string(bytes >> 20) + "MB";
  return std::to_string(bytes >> 10) + "KB";
}

int repetitions(const Config& config, size_t bytes) {
  // A guess from ~1 GB/s; the loop stops at `seconds` anyway.
  const double guess = config.seconds * 1e9 / static_cast<double>(bytes);
  return static_cast<int>(std::clamp(guess, 3.0, 200.0));
}

double loadAverage() {
  double load[1] = {0};
  return getloadavg(load, 1) == 1 ? load[0] : -1;
}

// ---- raw ring ----

// Rank r of a raw ring: connect to the successor's listener, accept the predecessor, then per size and
// repetition write SIZE to the successor (thread) while reading SIZE from the predecessor. Rank 0 returns
// per-size GB/s samples.
std::vector<std::vector<double>> rawRingRank(int rank, int n, std::vector<int>& listeners, const std::vector<int>& ports,
                                             const Config& config) {
  const int next = (rank + 1) % n;
  int out = connectLoopback(ports[static_cast<size_t>(next)]);
  int in = ::accept(listeners[static_cast<size_t>(rank)], nullptr, nullptr);
  check(in >= 0, "accept");
  setNoDelay(in);
  std::vector<std::vector<double>> samples;
  std::vector<uint8_t> sendBuffer(config.maxBytes, 1);
  std::vector<uint8_t> receiveBuffer(config.maxBytes);
  for (size_t bytes : sizes(config)) {
    std::vector<double> rates;
    const int reps = repetitions(config, bytes);
    for (int i = 0; i < reps + 1; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      std::thread writer([&] { writeFully(out, sendBuffer.data(), bytes); });
      readFully(in, receiveBuffer.data(), bytes);
      writer.join();
      // A one-byte token around the ring keeps the ranks in step (the next round starts together).
      char token = 0;
      writeFully(out, &token, 1);
      readFully(in, &token, 1);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i > 0) rates.push_back(static_cast<double>(bytes) / s / 1e9);
    }
    samples.push_back(std::move(rates));
  }
  ::close(out);
  ::close(in);
  return samples;
}

std::vector<Stats> rawRing(int n, const Config& config) {
  std::vector<int> listeners(static_cast<size_t>(n)), ports(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) listeners[static_cast<size_t>(r)] = listenEphemeral(ports[static_cast<size_t>(r)]);
  std::vector<pid_t> children;
  for (int r = 1; r < n; ++r) {
    children.push_back(forkChild(false, [&, r] { rawRingRank(r, n, listeners, ports, config); }));
  }
  auto samples = rawRingRank(0, n, listeners, ports, config);
  for (pid_t child : children) reap(child);
  for (int fd : listeners) ::close(fd);
  std::vector<Stats> out;
  for (auto& s : samples) out.push_back(statsOf(std::move(s)));
  return out;
}

// ---- collectives ----

rpc::Registry registry() {
  rpc::Registry reg;
  rpc::collectives::install(reg);
  return reg;
}

rpc::Options options(int rank, int n, int storePort) {
  rpc::Options o;
  o.rank = rank;
  o.worldSize = n;
  o.transport = "tcp";
  o.storeAddr = "127.0.0.1:" + std::to_string(storePort);
  o.executorThreads = 2;
  o.secret = "bench";
  o.defaultTimeout = std::chrono::milliseconds(120'000);
  return o;
}

struct Timing {
  std::vector<double> seconds;
};

// One all-reduce pass over the sizes on every rank (same calls everywhere); rank 0 keeps the times.
std::vector<std::pair<std::string, Timing>> runCollectives(rpc::Agent& agent, const Config& config) {
  ProcessGroupOptions groupOptions;
  groupOptions.segmentBytes = config.segmentBytes;
  groupOptions.maxSegmentsInFlight = config.window;
  ProcessGroup group = ProcessGroup::world(agent, groupOptions);
  std::vector<std::pair<std::string, Timing>> out;
  auto measure = [&](const std::string& name, size_t bytes, AllReduceOptions options) {
    Tensor t = Tensor::zeros({static_cast<int64_t>(bytes / 4)});
    group.allReduceSync(t, options);  // warm-up
    Timing timing;
    const int reps = repetitions(config, bytes);
    // Every rank must run the same number of collectives, so the count is fixed up front from the size.
    for (int i = 0; i < reps; ++i) {
      group.barrierSync();
      auto t0 = std::chrono::steady_clock::now();
      group.allReduceSync(t, options);
      timing.seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    out.emplace_back(name, std::move(timing));
  };
  for (size_t bytes : sizes(config)) measure("allreduce_" + sizeName(bytes), bytes, {});
  if (config.maxBytes >= (size_t{64} << 20)) {
    measure("allreduce_fp16_64MB", size_t{64} << 20, {rpc::collectives::ReduceOp::kSum, WireCompression::kFloat16});
  }
  group.barrierSync();
  return out;
}

void collectivesChild(int rank, int n, int portPipe, const Config& config) {
  int storePort = 0;
  check(::read(portPipe, &storePort, sizeof storePort) == sizeof storePort, "read store port");
  auto agent = rpc::Agent::start(options(rank, n, storePort), registry());
  runCollectives(*agent, config);
  agent->shutdown();
}

void runWorld(int n, const Config& config) {
  const double rawLoad = loadAverage();
  std::vector<Stats> raw = rawRing(n, config);
  std::vector<size_t> sizeList = sizes(config);
  for (size_t i = 0; i < sizeList.size(); ++i) {
    emit("collectives", "raw_ring_link_" + sizeName(sizeList[i]), "GB/s", raw[i],
         {{"procs", std::to_string(n)}, {"size_bytes", std::to_string(sizeList[i])}, {"impl", quoted("raw_socket")},
          {"loadavg_1m", number(rawLoad)}});
  }
  // Children are forked before this process starts any thread (the store, the agent).
  std::vector<int> pipes;
  std::vector<pid_t> children;
  for (int r = 1; r < n; ++r) {
    int fds[2];
    check(pipe(fds) == 0, "pipe");
    children.push_back(forkChild(false, [&, r, fds] {
      ::close(fds[1]);
      collectivesChild(r, n, fds[0], config);
    }));
    ::close(fds[0]);
    pipes.push_back(fds[1]);
  }
  auto store = rpc::StoreServer::start("127.0.0.1:0");
  const int storePort = store->port();
  for (int fd : pipes) {
    check(::write(fd, &storePort, sizeof storePort) == sizeof storePort, "write store port");
    ::close(fd);
  }
  const double load = loadAverage();
  auto agent = rpc::Agent::start(options(0, n, storePort), registry());
  auto timings = runCollectives(*agent, config);
  agent->shutdown();
  agent.reset();
  store.reset();
  for (pid_t child : children) reap(child);
  for (auto& [name, timing] : timings) {
    size_t bytes = 0;
    Stats rawStats{};
    for (size_t i = 0; i < sizeList.size(); ++i) {
      if (name == "allreduce_" + sizeName(sizeList[i]) ||
          (name == "allreduce_fp16_64MB" && sizeList[i] == (size_t{64} << 20))) {
        bytes = sizeList[i];
        rawStats = raw[i];
      }
    }
    const double factor = 2.0 * (n - 1) / n;
    std::vector<double> busbw, algbw;
    for (double s : timing.seconds) {
      busbw.push_back(factor * static_cast<double>(bytes) / s / 1e9);
      algbw.push_back(static_cast<double>(bytes) / s / 1e9);
    }
    Stats bus = statsOf(busbw);
    Stats alg = statsOf(algbw);
    Stats time = statsOf(timing.seconds);
    emit("collectives", name, "GB/s", bus,
         {{"procs", std::to_string(n)},
          {"size_bytes", std::to_string(bytes)},
          {"impl", quoted("distgrad")},
          {"metric_kind", quoted("busbw")},
          {"algbw_median", number(alg.median)},
          {"time_ms_median", number(time.median * 1e3)},
          {"raw_ring_link_median", number(rawStats.median)},
          {"ratio_vs_raw", number(bus.median / rawStats.median)},
          {"segment_bytes", std::to_string(config.segmentBytes)},
          {"window", std::to_string(config.window)},
          {"loadavg_1m", number(load)}});
  }
}

Config parse(int argc, char** argv) {
  Config config;
  if (argc > 1) {
    config.procs.clear();
    std::stringstream list(argv[1]);
    std::string item;
    while (std::getline(list, item, ',')) config.procs.push_back(std::atoi(item.c_str()));
  }
  if (argc > 2) config.maxBytes = static_cast<size_t>(std::atof(argv[2]) * 1048576.0);
  if (argc > 3) config.segmentBytes = static_cast<size_t>(std::atof(argv[3]) * 1024.0);
  if (argc > 4) config.window = static_cast<size_t>(std::atoi(argv[4]));
  if (argc > 5) config.seconds = std::atof(argv[5]);
  for (int n : config.procs) check(n >= 2 && n <= 16, "procs must be in [2, 16]");
  check(config.maxBytes >= 4096, "max_mb too small");
  return config;
}

}  // namespace
}  // namespace distgrad::bench

int main(int argc, char** argv) {
  const auto config = distgrad::bench::parse(argc, argv);
  for (int n : config.procs) distgrad::bench::runWorld(n, config);
  return 0;
}
