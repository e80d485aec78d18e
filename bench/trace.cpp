// What tracing costs (rpc/trace.h, docs/tracing.md), in one run:
//   trace span_off        ns per DG_TRACE_SCOPE with tracing off (one relaxed load, nothing else)
//   trace span_on         ns per DG_TRACE_SCOPE with tracing on (two clock reads and an append to the
//                         thread's buffer; the buffer is written between reps, untimed)
//   trace flush_per_event ns per event to write buffered events to the trace file
//   trace rpcsync_rtt_noop_{off,on}          rpcSync of a no-op i64(i64) between two processes on
//                                            127.0.0.1 (tcp), tracing off and on in both; the "on" line
//                                            has ratio_on_off and cost_percent
//   trace rpcasync_throughput_wW_{off,on}    rpcAsync calls/s with W = 8 and 64 in flight, same layout:
//                                            the bound is cost_percent <= 3 with tracing on
// Both processes start with a trace directory (a temporary one, removed at the end) and pause recording;
// the driver then alternates phases with recording paused and resumed in both (the child through an RPC),
// so "off" and "on" see the same machine load, and every "on" phase pays what tracing really costs:
// recording in both processes and the agents' own early flushes of their buffers to the files. Paused is
// exactly "off" for every recording site (trace::enabled() is false).
// Usage: bench_trace [rounds=3000] [calls=20000] [alternations=4] [spans=200000]
// rounds: rpcSync round trips per phase; calls: rpcAsync calls per phase and window; spans: spans per rep
// of the span cost (10 reps).
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench/agent_pair.h"
#include "bench/bench_util.h"
#include "rpc/agent.h"
#include "rpc/trace.h"

namespace distgrad::bench {
namespace {

namespace fs = std::filesystem;

inline const rpc::Function<int64_t(int64_t)> kPing{"ping"};
inline const rpc::Function<void(bool)> kSetPaused{"bench.trace.set_paused"};

struct Config {
  int rounds = 3000;
  int calls = 20000;
  int alternations = 4;
  int spans = 200000;
};

std::string loadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  in >> one;
  return one.empty() ? "null" : one;
}

double nsPerIteration(const std::function<void()>& body, int iterations) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) body();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / iterations;
}

// The cost of a span off and on, and of writing events, on this thread (before any agent thread exists).
void measureSpans(const Config& config, const std::string& dir) {
  std::vector<double> off, on, flushed;
  // Off: the only work is the load of trace::enabled().
  for (int rep = 0; rep < 10; ++rep) {
    off.push_back(nsPerIteration([] { DG_TRACE_SCOPE("bench span"); }, config.spans * 10));
  }
  const trace::WorkerSlot slot = trace::registerWorker("span-bench", 0, dir);
  trace::setCurrentWorker(slot);
  for (int rep = 0; rep < 11; ++rep) {
    const double ns = nsPerIteration([] { DG_TRACE_SCOPE("bench span"); }, config.spans);
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t lines = trace::flush();
    const double flushNs = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    if (rep == 0) continue;  // warm-up: the first chunks are fresh memory
    on.push_back(ns);
    flushed.push_back(flushNs / static_cast<double>(std::max<uint64_t>(lines, 1)));
  }
  trace::setCurrentWorker(trace::kNoWorker);
  trace::unregisterWorker(slot);
  const Stats offStats = statsOf(off);
  emit("trace", "span_off", "ns", offStats, {{"spans_per_rep", std::to_string(config.spans * 10)}});
  emit("trace", "span_on", "ns", statsOf(on),
       {{"spans_per_rep", std::to_string(config.spans)}, {"event_bytes", std::to_string(sizeof(trace::Event))}});
  emit("trace", "flush_per_event", "ns", statsOf(flushed), {{"events_per_flush", std::to_string(config.spans)}});
}

rpc::Options pairOptions(int rank, const std::string& storeAddress, const std::string& traceDir) {
  rpc::Options options = AgentPair::tcpOptions(rank, storeAddress, /*executorThreads=*/2);
  options.traceDir = traceDir;
  return options;
}

rpc::Registry pairRegistry(int rank) {
  rpc::Registry registry;
  if (rank == 1) {
    registry.bind(kPing, [](int64_t x) { return x; });
    registry.bind(kSetPaused, [](bool paused) { trace::setPaused(paused); });
  }
  return registry;
}

struct Phase {
  std::vector<double> rttUs;
  std::map<int, std::vector<double>> callsPerSecond;  // by window
  uint64_t eventsRecorded = 0;                         // in this process
  uint64_t calls = 0;
};

void runPhase(rpc::Agent& agent, const Config& config, Phase& phase) {
  const uint64_t recorded0 = trace::stats().recorded;
  for (int i = 0; i < config.rounds; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t r = agent.rpcSync("worker1", kPing, int64_t{i});
    phase.rttUs.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    check(r == i, "ping result");
  }
  phase.calls += static_cast<uint64_t>(config.rounds);
  for (int window : {8, 64}) {
    std::deque<rpc::Future<int64_t>> inFlight;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < config.calls; ++i) {
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
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    phase.callsPerSecond[window].push_back(config.calls / s);
    phase.calls += static_cast<uint64_t>(config.calls);
  }
  phase.eventsRecorded += trace::stats().recorded - recorded0;
}

void setPausedEverywhere(rpc::Agent& agent, bool paused) {
  agent.rpcSync("worker1", kSetPaused, paused);
  trace::setPaused(paused);
}

void measureRpc(const Config& config, const std::string& dir) {
  Phase off, on;
  {
    AgentPair pair(
        /*pinned=*/false, [&dir](int rank, const std::string& store) { return pairOptions(rank, store, dir); },
        pairRegistry, [] { trace::setPaused(true); });
    rpc::Agent& agent = pair.agent();
    setPausedEverywhere(agent, true);
    for (int i = 0; i < 500; ++i) agent.rpcSync("worker1", kPing, int64_t{i});  // warm-up
    for (int round = 0; round < config.alternations; ++round) {
      // Alternate which goes first so that a drift in the machine's load does not favour one side.
      const bool onFirst = round % 2 == 1;
      for (int part = 0; part < 2; ++part) {
        const bool tracing = (part == 0) == onFirst;
        setPausedEverywhere(agent, !tracing);
        runPhase(agent, config, tracing ? on : off);
      }
    }
    setPausedEverywhere(agent, false);  // the shutdown writes both files completely
  }
  // The files the two agents wrote: every line must be there (a broken trace would make "on" cheap).
  uint64_t lines = 0;
  for (const char* worker : {"worker0", "worker1"}) {
    std::ifstream in(dir + "/" + worker + ".trace.jsonl");
    std::string line, last;
    while (std::getline(in, line)) {
      ++lines;
      last = line;
    }
    check(last.rfind("{\"type\":\"end\"", 0) == 0, "a trace file without its end line");
  }
  const std::string load = loadAverage();
  auto compare = [&](const std::string& metric, const std::string& unit, const std::vector<double>& offSamples,
                     const std::vector<double>& onSamples, bool higherIsBetter) {
    const Stats offStats = statsOf(offSamples);
    const Stats onStats = statsOf(onSamples);
    const double ratio = onStats.median / offStats.median;
    const double costPercent = 100.0 * (higherIsBetter ? 1.0 - ratio : ratio - 1.0);
    emit("trace", metric + "_off", unit, offStats, {{"tracing", quoted("off")}, {"loadavg", load}});
    emit("trace", metric + "_on", unit, onStats,
         {{"tracing", quoted("on")},
          {"off_median", number(offStats.median)},
          {"ratio_on_off", number(ratio)},
          {"cost_percent", number(costPercent)},
          {"events_per_call_worker0", number(static_cast<double>(on.eventsRecorded) / static_cast<double>(on.calls))},
          {"trace_lines_written", std::to_string(lines)},
          {"loadavg", load}});
  };
  compare("rpcsync_rtt_noop", "us", off.rttUs, on.rttUs, /*higherIsBetter=*/false);
  for (int window : {8, 64}) {
    compare("rpcasync_throughput_w" + std::to_string(window), "calls/s", off.callsPerSecond[window],
            on.callsPerSecond[window], /*higherIsBetter=*/true);
  }
}

}  // namespace
}  // namespace distgrad::bench

int main(int argc, char** argv) {
  using namespace distgrad::bench;
  Config config;
  if (argc > 1) config.rounds = std::max(std::atoi(argv[1]), 10);
  if (argc > 2) config.calls = std::max(std::atoi(argv[2]), 100);
  if (argc > 3) config.alternations = std::max(std::atoi(argv[3]), 1);
  if (argc > 4) config.spans = std::max(std::atoi(argv[4]), 1000);
  std::signal(SIGPIPE, SIG_IGN);
  std::string pattern = (fs::temp_directory_path() / "dg-bench-trace-XXXXXX").string();
  check(::mkdtemp(pattern.data()) != nullptr, "mkdtemp");
  const std::string dir = pattern;
  // The span figures first: no thread may exist when the pair forks its child.
  measureSpans(config, dir + "/spans");
  measureRpc(config, dir + "/rpc");
  std::error_code ec;
  fs::remove_all(dir, ec);
  return 0;
}
