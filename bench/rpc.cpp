// The RPC agent against the raw loopback limit, measured in one run: two processes (fork) on 127.0.0.1,
// rank 0 (this process, hosting the store) calling rank 1 (the child) over tcp.
//   raw_socket pingpong_rtt_64B        blocking sockets, 64 B each way (the floor of a round trip)
//   raw_socket stream_64MB             blocking sockets, 64 MB messages one way, 1-byte ack (GB/s)
//   raw_socket echo_SIZE               blocking sockets, SIZE bytes there and the same back (GB/s, both ways)
//   rpc        rpcsync_rtt_noop        rpcSync of a no-op i64(i64) function, median/p99 round trip, with the
//                                      ratios to the raw ping-pong of the same placement
//   rpc        rpcsync_rtt_noop_inline the same, the function bound with Dispatch::kInline (its handler runs
//                                      on the callee's loop thread: Note [Inline handlers] in rpc/agent.cpp)
//   rpc        ..._loop_reads          each rpcSync figure again with the caller's loop thread reading the
//                                      reply (AgentConfig::syncReadWindow 0) instead of the waiting caller
//                                      (Note [Waiting reader] in rpc/transport/tcp/connection.cpp),
//   rpc        ..._loop_serves         and again with the callee's loop thread reading every call and
//                                      handing it to a worker (AgentConfig::serveReadWindow 0) instead of the
//                                      worker that answered the last one reading it (Note [Serving reader] in
//                                      rpc/agent.cpp); the three interleaved in blocks of 250 calls
//   rpc        rpcasync_throughput_wW  rpcAsync calls/s with W = 1, 8, 64 calls in flight
//   rpc        tensor_echo_SIZE        rpcSync of tensor(tensor) returning its float32 argument, SIZE = 1KB,
//                                      64KB, 1MB, 16MB, 64MB: GB/s counting both directions (2 x bytes per
//                                      round trip), with the ratio to raw_socket echo_SIZE (target at 64MB:
//                                      >= 0.8); cpu_busy_workerN = CPU seconds of that process per wall
//                                      second of the echo loop
//   rpc        idle_cpu_percent        CPU time of each agent's process over an idle stretch (heartbeats
//                                      only) / wall time, right after start and again after the traffic:
//                                      ~0 unless something polls
// Every figure is taken with both processes free to run anywhere ("placement":"free"); the ping-pong,
// rpcSync and rpcAsync figures again with both processes pinned to CPU 0 ("placement":"one_core"), where
// every wake-up of the other side is a context switch. Ratios: ratio_vs_raw = ours / raw (time: above 1 is
// our overhead; bandwidth: below 1 is).
// Transports: every agent figure is taken for each transport of --transport (default tcp; issue 8 compares
// tcp,ucx,ucx-poll in one run): tcp, ucx (event mode) or ucx-poll (ucx with both processes' loops spinning:
// DISTGRAD_UCX_BUSY_POLL=1). Each rpc line has "transport", and a non-tcp line ratio_vs_tcp (its median
// over tcp's of the same metric and placement, when tcp ran first in the same run); ucx lines also carry
// ucx_transports (the lanes ucp chose, e.g. sysv/memory for messages, cma/memory for rendezvous).
// JSON lines (bench/bench_util.h). Usage:
//   bench_rpc [--transport tcp[,ucx[,ucx-poll]]] [rounds=5000] [calls=20000] [echo_mb=512] [idle_s=2]
//             [sections=all] [windows=1,8,64]
// rounds: ping-pong and rpcSync round trips; calls: rpcAsync calls per window size (5 reps); echo_mb: MB
// sent per echo size (1 KB and 64 KB stop at 2000 round trips, large sizes do at least 5); idle_s: seconds
// of each idle stretch. sections: "all", or "pinned" (only the one-core ping-pong, rpcSync and rpcAsync
// figures: a quick check of the per-call CPU cost, where every call's CPU time is on the one core).
// windows: the rpcAsync in-flight window sizes, comma-separated (e.g. "64" to profile one of them).
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "bench/agent_pair.h"
#include "bench/socket_bench_util.h"
#include "rpc/agent.h"
#include "rpc/transport/transport.h"

namespace distgrad::bench {
namespace {

using tensor::Tensor;

inline const rpc::Function<int64_t(int64_t)> kPing{"ping"};
inline const rpc::Function<int64_t(int64_t)> kPingInline{"ping_inline"};
inline const rpc::Function<Tensor(Tensor)> kEcho{"echo"};
// Sets the callee's serveReadWindow (µs); returns it.
inline const rpc::Function<int64_t(int64_t)> kSetServeWindow{"set_serve_window"};

struct Config {
  int rounds = 5000;
  int calls = 20000;
  double echoMegabytes = 512;
  double idleSeconds = 2;
  bool pinnedOnly = false;
  std::vector<int> windows{1, 8, 64};
};

constexpr size_t kEchoSizes[] = {1u << 10, 64u << 10, 1u << 20, 16u << 20, 64u << 20};

std::string sizeName(size_t bytes) {
  if (bytes >= (1u << 20)) return std::to_string(bytes >> 20) + "MB";
  return std::to_string(bytes >> 10) + "KB";
}

int echoRounds(const Config& config, size_t bytes) {
  double rounds = config.echoMegabytes * 1048576.0 / static_cast<double>(bytes);
  return static_cast<int>(std::clamp(rounds, 5.0, 2000.0));
}

// The transport the agent figures are taken over now, and tcp's medians of this run for ratio_vs_tcp.
struct TransportRun {
  std::string name = "tcp";
  std::string lanes;                         // ucx: what ucp chose for the pair's connection
  std::map<std::string, double> tcpMedians;  // "metric placement" -> median
};
TransportRun currentTransport;

// One agent figure: emitted with its transport, remembered when it is tcp's, compared with tcp's otherwise.
void emitRpc(const std::string& metric, const std::string& unit, const Measurement& m, bool pinned,
             std::map<std::string, std::string> extra = {}) {
  TransportRun& run = currentTransport;
  std::string key = metric + (pinned ? " one_core" : " free");
  for (const char* distinguishing : {"agent", "phase"}) {
    if (auto it = extra.find(distinguishing); it != extra.end()) key += " " + it->second;
  }
  extra["transport"] = quoted(run.name);
  if (run.name == "tcp") {
    run.tcpMedians[key] = m.stats.median;
  } else if (auto tcp = run.tcpMedians.find(key); tcp != run.tcpMedians.end() && tcp->second > 0) {
    extra["ratio_vs_tcp"] = number(m.stats.median / tcp->second);
  }
  if (!run.lanes.empty()) extra["ucx_transports"] = quoted(run.lanes);
  emitMeasurement("rpc", metric, unit, m, pinned, std::move(extra));
}

// Makes `name` the transport of the next AgentPair (ucx-poll: busy polling in both processes, which the
// child inherits through the environment); false, with a skipped line, when it cannot run here.
bool useTransport(const std::string& name) {
  currentTransport.name = name;
  currentTransport.lanes.clear();
  if (name == "ucx-poll") {
    ::setenv("DISTGRAD_UCX_BUSY_POLL", "1", 1);
  } else {
    ::unsetenv("DISTGRAD_UCX_BUSY_POLL");
  }
  if (name == "tcp") return true;
  std::string reason = rpc::transport::ucxUnavailableReason();
  if (reason.empty()) return true;
  std::printf("{\"bench\":\"rpc\",\"transport\":%s,\"skipped\":%s}\n", quoted(name).c_str(), quoted(reason).c_str());
  return false;
}

rpc::Options pairOptions(int rank, const std::string& storeAddress) {
  rpc::Options options = AgentPair::tcpOptions(rank, storeAddress, /*executorThreads=*/2);
  options.transport = currentTransport.name == "ucx-poll" ? "ucx" : currentTransport.name;
  return options;
}

// worker1 (the child) serves ping and echo; worker0 only calls.
rpc::Registry pairRegistry(int rank) {
  rpc::Registry registry;
  if (rank == 1) {
    registry.bind(kPing, [](int64_t x) { return x; });
    registry.bind(kPingInline, [](int64_t x) { return x; }, rpc::Dispatch::kInline);
    registry.bind(kEcho, [](Tensor t) { return t; });
    registry.bind(
        kSetServeWindow,
        [](const rpc::CallContext& ctx, int64_t us) {
          ctx.agent->setServeReadWindow(std::chrono::microseconds(us));
          return us;
        },
        rpc::Dispatch::kInline);
  }
  return registry;
}

Measurement single(double value) {
  Measurement m;
  m.stats = Stats{value, value, value, 1};
  m.p99 = value;
  return m;
}

// CPU-% of each process over `seconds` of no calls (heartbeats only).
void measureIdle(AgentPair& pair, double seconds, const char* phase, bool pinned) {
  double parent0 = processCpuSeconds();
  double child0 = pair.childCpuSeconds();
  auto wall0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  double parent1 = processCpuSeconds();
  double child1 = pair.childCpuSeconds();
  double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  emitRpc("idle_cpu_percent", "%", single(100 * (parent1 - parent0) / wall), pinned,
          {{"agent", quoted("worker0 (hosts the store)")}, {"phase", quoted(phase)}, {"idle_s", number(wall)}});
  emitRpc("idle_cpu_percent", "%", single(100 * (child1 - child0) / wall), pinned,
          {{"agent", quoted("worker1")}, {"phase", quoted(phase)}, {"idle_s", number(wall)}});
}

// No-op rpcSync round trips, the caller reading its reply itself (Note [Waiting reader]) and the callee's
// worker reading the next call (Note [Serving reader]), and, interleaved in blocks of 250 so that all see
// the same load, the same with the caller's loop thread reading the reply (`metric`_loop_reads) and with the
// callee's loop thread reading the call (`metric`_loop_serves).
void measureRpcSync(rpc::Agent& agent, const rpc::Function<int64_t(int64_t)>& fn, const std::string& metric,
                    int rounds, const Measurement& raw, bool pinned) {
  const auto window = agent.syncReadWindow();
  const int64_t serveWindowUs = rpc::AgentConfig{}.serveReadWindow.count();
  const char* suffixes[] = {"", "_loop_reads", "_loop_serves"};
  std::vector<double> us[3];
  int mode = -1;
  for (int i = 0; i < 3 * rounds; ++i) {
    if ((i / 250) % 3 != mode) {
      mode = (i / 250) % 3;
      agent.setSyncReadWindow(mode == 1 ? std::chrono::microseconds{0} : window);
      const int64_t serve = mode == 2 ? 0 : serveWindowUs;
      check(agent.rpcSync("worker1", kSetServeWindow, serve) == serve, "set_serve_window");
    }
    auto t0 = std::chrono::steady_clock::now();
    int64_t r = agent.rpcSync("worker1", fn, int64_t{i});
    us[mode].push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    check(r == i, "ping result");
  }
  agent.setSyncReadWindow(window);
  check(agent.rpcSync("worker1", kSetServeWindow, serveWindowUs) == serveWindowUs, "set_serve_window");
  for (int m = 0; m < 3; ++m) {
    auto& v = us[m];
    v.erase(v.begin(), v.begin() + std::min<size_t>(v.size() / 10, 500));  // warm-up
    Measurement measured = measurementOf(std::move(v));
    emitRpc(metric + suffixes[m], "us", measured, pinned,
            {{"raw_median", number(raw.stats.median)},
             {"raw_p99", number(raw.p99)},
             {"ratio_vs_raw", number(measured.stats.median / raw.stats.median)},
             {"p99_ratio_vs_raw", number(measured.p99 / raw.p99)}});
  }
}

void measureRpcAsync(AgentPair& pair, int calls, const std::vector<int>& windows, bool pinned) {
  rpc::Agent& agent = pair.agent();
  for (int window : windows) {
    std::vector<double> rates;
    const double cpu0 = processCpuSeconds() + pair.childCpuSeconds();
    int total = 0;
    for (int rep = 0; rep < 5; ++rep) {
      std::deque<rpc::Future<int64_t>> inFlight;
      const int n = std::max(calls / 5, 1);
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) {
        if (static_cast<int>(inFlight.size()) == window) {
          inFlight.front().get();
          inFlight.pop_front();
        }
        inFlight.push_back(agent.rpcAsync("worker1", kPing, int64_t{i}));
      }
      while (!inFlight.empty()) {
        inFlight.front().get();
        inFlight.pop_front();
      }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rates.push_back(n / s);
      total += n;
    }
    // CPU of both processes per call: with both pinned to one core this is what bounds the throughput.
    const double cpuUs = (processCpuSeconds() + pair.childCpuSeconds() - cpu0) * 1e6 / total;
    emitRpc("rpcasync_throughput_w" + std::to_string(window), "calls/s", measurementOf(rates), pinned,
            {{"in_flight", std::to_string(window)}, {"cpu_us_per_call", number(cpuUs)}});
  }
}

void measureTensorEcho(AgentPair& pair, const Config& config, size_t bytes, const Measurement& raw, bool pinned) {
  rpc::Agent& agent = pair.agent();
  const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
  Tensor t = Tensor::empty({n});
  float* data = t.data<float>();
  for (int64_t i = 0; i < n; ++i) data[i] = static_cast<float>(i % 65521);
  // The warm-up round trip is checked in full; the timed ones by size and a few elements.
  Tensor first = agent.rpcSync("worker1", kEcho, t);
  check(first.numel() == n && std::memcmp(first.rawData(), data, bytes) == 0, "echo result");
  const int rounds = echoRounds(config, bytes);
  std::vector<double> rates;
  const double parentCpu0 = processCpuSeconds();
  const double childCpu0 = pair.childCpuSeconds();
  const auto wall0 = std::chrono::steady_clock::now();
  for (int i = 0; i < rounds; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    Tensor back = agent.rpcSync("worker1", kEcho, t);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    check(back.numel() == n && back.data<float>()[n - 1] == data[n - 1] && back.data<float>()[n / 2] == data[n / 2],
          "echo result");
    rates.push_back(2.0 * static_cast<double>(bytes) / s / 1e9);
  }
  // CPU time of each process per wall second of the loop: well below 1 + 1 while the bandwidth is below raw
  // means time is lost waiting (wake-ups, stalls), not copying.
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
  const double parentCpu = (processCpuSeconds() - parentCpu0) / wall;
  const double childCpu = (pair.childCpuSeconds() - childCpu0) / wall;
  Measurement m = measurementOf(std::move(rates));
  emitRpc("tensor_echo_" + sizeName(bytes), "GB/s", m, pinned,
          {{"bytes", std::to_string(bytes)},
           {"cpu_busy_worker0", number(parentCpu)},
           {"cpu_busy_worker1", number(childCpu)},
           {"raw_median", number(raw.stats.median)},
           {"ratio_vs_raw", number(m.stats.median / raw.stats.median)}});
}

}  // namespace
}  // namespace distgrad::bench

int main(int argc, char** argv) {
  using namespace distgrad::bench;
  Config config;
  std::vector<std::string> transports{"tcp"};
  // --transport LIST may come anywhere; the rest are positional.
  std::vector<char*> positional{argv[0]};
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    const std::string flag = "--transport";
    if (arg == flag || arg.rfind(flag + "=", 0) == 0) {
      std::string list = arg == flag ? (i + 1 < argc ? argv[++i] : "") : arg.substr(flag.size() + 1);
      transports.clear();
      for (size_t start = 0; start <= list.size();) {
        size_t comma = std::min(list.find(',', start), list.size());
        transports.push_back(list.substr(start, comma - start));
        check(transports.back() == "tcp" || transports.back() == "ucx" || transports.back() == "ucx-poll",
              "--transport takes a comma-separated list of tcp, ucx, ucx-poll");
        start = comma + 1;
      }
    } else {
      positional.push_back(argv[i]);
    }
  }
  argc = static_cast<int>(positional.size());
  argv = positional.data();
  if (argc > 1) config.rounds = std::max(std::atoi(argv[1]), 10);
  if (argc > 2) config.calls = std::max(std::atoi(argv[2]), 5);
  if (argc > 3) config.echoMegabytes = std::atof(argv[3]);
  if (argc > 4) config.idleSeconds = std::atof(argv[4]);
  if (argc > 5) {
    const std::string sections = argv[5];
    check(sections == "all" || sections == "pinned", "sections must be 'all' or 'pinned'");
    config.pinnedOnly = sections == "pinned";
  }
  if (argc > 6) {
    // A comma-separated list of in-flight window sizes, e.g. "64" (profiling one of them).
    config.windows.clear();
    for (const char* p = argv[6]; *p != '\0';) {
      char* end = nullptr;
      const long window = std::strtol(p, &end, 10);
      check(end != p && window >= 1 && window <= 4096, "windows must be a comma-separated list of 1..4096");
      check(*end == ',' || *end == '\0', "windows must be a comma-separated list of 1..4096");
      config.windows.push_back(static_cast<int>(window));
      p = *end == ',' ? end + 1 : end;
    }
  }
  const cpu_set_t freeAffinity = currentAffinity();
  std::signal(SIGPIPE, SIG_IGN);  // a dead child shows as a failed write (check() names it), not a silent exit

  // Free placement. Every raw figure forks its own child before any agent thread exists in this process
  // (fork and threads do not mix), so the raw references come first.
  if (!config.pinnedOnly) {
    const bool pinned = false;
    Measurement rawRtt = rawPingPong(config.rounds, pinned);
    emitMeasurement("raw_socket", "pingpong_rtt_64B", "us", rawRtt, pinned);
    emitMeasurement("raw_socket", "stream_64MB", "GB/s", rawStream(echoRounds(config, kStreamBytes), pinned), pinned);
    std::vector<Measurement> rawEcho;
    for (size_t bytes : kEchoSizes) {
      rawEcho.push_back(rawExchange(bytes, bytes, echoRounds(config, bytes), pinned));
      emitMeasurement("raw_socket", "echo_" + sizeName(bytes), "GB/s", rawEcho.back(), pinned,
                      {{"bytes", std::to_string(bytes)}});
    }
    for (const std::string& transport : transports) {
      if (!useTransport(transport)) continue;
      AgentPair pair(pinned, pairOptions, pairRegistry);
      currentTransport.lanes = pair.agent().metrics("worker1").lanes;
      measureIdle(pair, config.idleSeconds, "after_start", pinned);
      measureRpcSync(pair.agent(), kPing, "rpcsync_rtt_noop", config.rounds, rawRtt, pinned);
      measureRpcSync(pair.agent(), kPingInline, "rpcsync_rtt_noop_inline", config.rounds, rawRtt, pinned);
      measureRpcAsync(pair, config.calls, config.windows, pinned);
      for (size_t i = 0; i < std::size(kEchoSizes); ++i) {
        measureTensorEcho(pair, config, kEchoSizes[i], rawEcho[i], pinned);
      }
      measureIdle(pair, config.idleSeconds, "after_traffic", pinned);
    }
  }

  // Both processes on CPU 0: this process is pinned before the agent starts its threads (they inherit the
  // mask), the child right after fork; the original mask is restored afterwards.
  {
    const bool pinned = true;
    pinToCpu0();
    Measurement rawRtt = rawPingPong(config.rounds, pinned);
    emitMeasurement("raw_socket", "pingpong_rtt_64B", "us", rawRtt, pinned);
    for (const std::string& transport : transports) {
      // Two spinning loops on one core would measure the scheduler only.
      if (transport == "ucx-poll" || !useTransport(transport)) continue;
      AgentPair pair(pinned, pairOptions, pairRegistry);
      currentTransport.lanes = pair.agent().metrics("worker1").lanes;
      measureRpcSync(pair.agent(), kPing, "rpcsync_rtt_noop", config.rounds, rawRtt, pinned);
      measureRpcSync(pair.agent(), kPingInline, "rpcsync_rtt_noop_inline", config.rounds, rawRtt, pinned);
      measureRpcAsync(pair, config.calls, config.windows, pinned);
    }
    useTransport("tcp");  // leaves no DISTGRAD_UCX_BUSY_POLL behind
    restoreAffinity(freeAffinity);
  }
  return 0;
}
