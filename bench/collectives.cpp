// All-reduce bus bandwidth of rpc::collectives against the raw loopback limit, in one run: N processes
// (fork) on 127.0.0.1 over tcp, for N in the `procs` list.
//   collectives raw_ring_link_SIZE   plain blocking sockets in a ring of N processes: each sends SIZE bytes
//                                    to its successor while receiving SIZE from its predecessor (a writer
//                                    thread and the reading main thread); GB/s per link = SIZE / time. This
//                                    is what the transport can move per link when every link is busy at
//                                    once, which is exactly the load a ring all-reduce puts on it.
//   collectives raw_stream_64MB      one link alone: 2 processes, 64 MB one way, 1-byte ack (GB/s), as in
//                                    bench_rpc; printed once, for context
//   collectives allreduce_SIZE       ProcessGroup::allReduce (sum, float32, kAuto: recursive doubling up to
//                                    64 KB, ring above) of a SIZE-byte tensor: busbw = 2(N-1)/N x SIZE / time
//                                    (nccl-tests' definition: the bytes each link carries in a ring), with
//                                    ratio_vs_raw = busbw / raw_ring_link of the same SIZE and N, and
//                                    algbw = SIZE / time.
//                                    The largest size adds peak_extra_mib_rank0: the most tensor memory
//                                    rank 0's process held beyond the tensor during those all-reduces
//                                    (tensor::cpuBytesInUse sampled every ms), bounded by the segment window.
//   collectives allreduce_fp16_64MB  the same at 64 MB with float16 on the wire (busbw counted in float32
//                                    bytes, i.e. the rate of the job's data, not of the wire)
// Times are rank 0's, from the end of a barrier to the end of the all-reduce. The raw rounds and the
// all-reduces of one size run in the same processes, interleaved in 3 blocks, so both see the same load
// (the machine is shared); every line carries the load average at the start and end of its world size.
// JSON lines (bench/bench_util.h). Usage:
//   bench_collectives [procs=2,4] [max_mb=256] [segment_kb=1024] [window=8] [seconds=1.5]
// procs: world sizes to run; max_mb: the largest size (sizes are 4 KB, 64 KB, 1 MB, 16 MB, 64 MB, 256 MB up
// to it); segment_kb / window: ProcessGroupOptions::segmentBytes / maxSegmentsInFlight; seconds: sets the
// repetitions per size as seconds x 1 GB/s / size, at least 3 and at most 200.
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <atomic>
#include <condition_variable>
#include <mutex>
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

// This process's place in a raw socket ring: a connection to the successor (written by a writer thread
// that lives as long as the ring) and one from the predecessor.
class RawRing {
 public:
  RawRing(int rank, int n, const std::vector<int>& listeners, const std::vector<int>& ports, size_t maxBytes)
      : rank_(rank), sendBuffer_(maxBytes, 1), receiveBuffer_(maxBytes) {
    out_ = connectLoopback(ports[static_cast<size_t>((rank + 1) % n)]);
    in_ = ::accept(listeners[static_cast<size_t>(rank)], nullptr, nullptr);
    check(in_ >= 0, "accept");
    setNoDelay(in_);
    writer_ = std::thread([this] { writerLoop(); });
  }
  ~RawRing() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      quit_ = true;
    }
    changed_.notify_all();
    writer_.join();
    ::close(out_);
    ::close(in_);
  }

  // One round: send `bytes` to the successor while receiving as many from the predecessor, then pass a
  // one-byte token around so the next round starts together on every rank. Returns this rank's seconds
  // for the transfer (the token excluded).
  double round(size_t bytes) {
    auto t0 = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      toWrite_ = bytes;
      written_ = false;
    }
    changed_.notify_all();
    readFully(in_, receiveBuffer_.data(), bytes);
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return written_; });
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    char token = 0;
    if (rank_ == 0) {
      writeFully(out_, &token, 1);
      readFully(in_, &token, 1);
    } else {
      readFully(in_, &token, 1);
      writeFully(out_, &token, 1);
    }
    return seconds;
  }

 private:
  void writerLoop() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      changed_.wait(lock, [&] { return quit_ || toWrite_ > 0; });
      if (quit_) return;
      const size_t bytes = toWrite_;
      lock.unlock();
      writeFully(out_, sendBuffer_.data(), bytes);
      lock.lock();
      toWrite_ = 0;
      written_ = true;
      changed_.notify_all();
    }
  }

  int rank_;
  int out_ = -1, in_ = -1;
  std::vector<uint8_t> sendBuffer_, receiveBuffer_;
  std::mutex mutex_;
  std::condition_variable changed_;
  size_t toWrite_ = 0;  // GUARDED_BY(mutex_): bytes of the current round, 0 when idle
  bool written_ = false, quit_ = false;
  std::thread writer_;
};

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

struct Samples {
  std::vector<double> raw;        // seconds per raw ring round
  std::vector<double> allReduce;  // seconds per all-reduce
  double peakExtraBytes = -1;     // largest size only: tensor bytes in use beyond the tensor, sampled
};

// The measurement every rank runs in the same order: per size, kBlocks blocks, each of `reps` raw ring
// rounds followed by `reps` all-reduces, so the raw limit and our figure see the same machine load
// (the machine is shared: load moves on the scale of seconds). Rank 0's times are kept.
constexpr int kBlocks = 3;

std::vector<std::pair<std::string, Samples>> measure(rpc::Agent& agent, RawRing& ring, const Config& config) {
  ProcessGroupOptions groupOptions;
  groupOptions.segmentBytes = config.segmentBytes;
  groupOptions.maxSegmentsInFlight = config.window;
  ProcessGroup group = ProcessGroup::world(agent, groupOptions);
  std::vector<std::pair<std::string, Samples>> out;
  auto run = [&](const std::string& name, size_t bytes, AllReduceOptions options) {
    Tensor t = Tensor::zeros({static_cast<int64_t>(bytes / 4)});
    group.allReduceSync(t, options);  // warm-up
    ring.round(bytes);
    Samples samples;
    const int reps = std::max(1, repetitions(config, bytes) / kBlocks);
    // For the largest size, rank 0 samples the tensor bytes its process holds (tensor::cpuBytesInUse: the
    // tensor, received segments, compressed copies) every millisecond while it all-reduces: the memory a
    // collective costs beyond the tensor itself.
    const bool sampleMemory = agent.rank() == 0 && bytes == sizes(config).back();
    const size_t baseline = tensor::cpuBytesInUse();
    std::atomic<size_t> peak{baseline};
    std::atomic<bool> sampling{false};
    std::atomic<bool> stop{false};
    std::thread sampler;
    if (sampleMemory) {
      sampler = std::thread([&] {
        while (!stop.load()) {
          if (sampling.load()) peak.store(std::max(peak.load(), tensor::cpuBytesInUse()));
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      });
    }
    for (int block = 0; block < kBlocks; ++block) {
      for (int i = 0; i < reps; ++i) samples.raw.push_back(ring.round(bytes));
      for (int i = 0; i < reps; ++i) {
        group.barrierSync();
        sampling.store(true);
        auto t0 = std::chrono::steady_clock::now();
        group.allReduceSync(t, options);
        samples.allReduce.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        sampling.store(false);
      }
    }
    if (sampleMemory) {
      stop.store(true);
      sampler.join();
      samples.peakExtraBytes = static_cast<double>(peak.load() - baseline);
    }
    out.emplace_back(name, std::move(samples));
  };
  for (size_t bytes : sizes(config)) run("allreduce_" + sizeName(bytes), bytes, {});
  if (config.maxBytes >= (size_t{64} << 20)) {
    run("allreduce_fp16_64MB", size_t{64} << 20, {rpc::collectives::ReduceOp::kSum, WireCompression::kFloat16});
  }
  group.barrierSync();
  return out;
}

void child(int rank, int n, int portPipe, const std::vector<int>& listeners, const std::vector<int>& ports,
           const Config& config) {
  RawRing ring(rank, n, listeners, ports, config.maxBytes);
  int storePort = 0;
  check(::read(portPipe, &storePort, sizeof storePort) == sizeof storePort, "read store port");
  auto agent = rpc::Agent::start(options(rank, n, storePort), registry());
  measure(*agent, ring, config);
  agent->shutdown();
}

void runWorld(int n, const Config& config) {
  const double startLoad = loadAverage();
  if (n == config.procs.front() && config.maxBytes >= kStreamBytes) {
    // A second reference: one link alone (2 processes, one direction, 64 MB messages), bench_rpc's figure.
    emit("collectives", "raw_stream_64MB", "GB/s", rawStream(5, false).stats,
         {{"procs", "2"}, {"impl", quoted("raw_socket")}, {"loadavg_1m", number(startLoad)}});
  }
  std::vector<int> listeners(static_cast<size_t>(n)), ports(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) listeners[static_cast<size_t>(r)] = listenEphemeral(ports[static_cast<size_t>(r)]);
  // Children are forked before this process starts any thread (the ring's writer, the store, the agent).
  std::vector<int> pipes;
  std::vector<pid_t> children;
  for (int r = 1; r < n; ++r) {
    int fds[2];
    check(pipe(fds) == 0, "pipe");
    children.push_back(forkChild(false, [&, r, fds] {
      ::close(fds[1]);
      child(r, n, fds[0], listeners, ports, config);
    }));
    ::close(fds[0]);
    pipes.push_back(fds[1]);
  }
  std::vector<std::pair<std::string, Samples>> results;
  {
    RawRing ring(0, n, listeners, ports, config.maxBytes);
    auto store = rpc::StoreServer::start("127.0.0.1:0");
    const int storePort = store->port();
    for (int fd : pipes) {
      check(::write(fd, &storePort, sizeof storePort) == sizeof storePort, "write store port");
      ::close(fd);
    }
    auto agent = rpc::Agent::start(options(0, n, storePort), registry());
    results = measure(*agent, ring, config);
    agent->shutdown();
    agent.reset();
    // The children finish their own shutdown against the store: it goes last.
    for (pid_t c : children) reap(c);
  }
  for (int fd : listeners) ::close(fd);
  const double endLoad = loadAverage();
  for (auto& [name, samples] : results) {
    size_t bytes = 0;
    for (size_t b : sizes(config)) {
      if (name == "allreduce_" + sizeName(b)) bytes = b;
    }
    if (name == "allreduce_fp16_64MB") bytes = size_t{64} << 20;
    const double factor = 2.0 * (n - 1) / n;
    std::vector<double> busbw, algbw, raw;
    for (double s : samples.allReduce) {
      busbw.push_back(factor * static_cast<double>(bytes) / s / 1e9);
      algbw.push_back(static_cast<double>(bytes) / s / 1e9);
    }
    for (double s : samples.raw) raw.push_back(static_cast<double>(bytes) / s / 1e9);
    Stats bus = statsOf(busbw);
    Stats alg = statsOf(algbw);
    Stats rawStats = statsOf(raw);
    Stats time = statsOf(samples.allReduce);
    const std::map<std::string, std::string> common{{"procs", std::to_string(n)},
                                                     {"size_bytes", std::to_string(bytes)},
                                                     {"loadavg_1m_start", number(startLoad)},
                                                     {"loadavg_1m_end", number(endLoad)}};
    if (name.rfind("allreduce_fp16", 0) != 0) {
      auto extra = common;
      extra["impl"] = quoted("raw_socket");
      emit("collectives", "raw_ring_link_" + sizeName(bytes), "GB/s", rawStats, extra);
    }
    auto extra = common;
    extra["impl"] = quoted("distgrad");
    extra["metric_kind"] = quoted("busbw");
    extra["algbw_median"] = number(alg.median);
    extra["time_ms_median"] = number(time.median * 1e3);
    extra["raw_ring_link_median"] = number(rawStats.median);
    extra["ratio_vs_raw"] = number(bus.median / rawStats.median);
    extra["segment_bytes"] = std::to_string(config.segmentBytes);
    extra["window"] = std::to_string(config.window);
    if (samples.peakExtraBytes >= 0) extra["peak_extra_mib_rank0"] = number(samples.peakExtraBytes / 1048576.0);
    emit("collectives", name, "GB/s", bus, extra);
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
