// What tracing costs (rpc/trace.h, docs/tracing.md), in one run:
//   trace span_off         ns per DG_TRACE_SCOPE with tracing off (one relaxed load, nothing else)
//   trace span_on          ns per DG_TRACE_SCOPE with tracing on (two clock reads and an append to the
//                          thread's buffer; the buffer is written between reps, untimed)
//   trace rpc_record_on    CPU ns per RPC site record (trace::recordRpc) into fresh memory, as a traced run
//                          stores them (page faults included)
//   trace flush_per_event  ns per event to write buffered events to the trace file (JSON lines)
//   trace rpcsync_rtt_noop_MODE          rpcSync of a no-op i64(i64) between two processes on 127.0.0.1
//                                        (tcp, two executor threads each): median round trip (us)
//   trace rpcasync_throughput_wW_MODE    rpcAsync calls/s with W = 8 and 64 in flight
//   trace stage_throughput_w8_MODE       rpcAsync calls/s, 8 in flight, of a pipeline-stage-like call: a
//                                        [32, 256] float32 activation (32 KB each way) times a [256, 256]
//                                        weight on the callee
// for MODE = off, on and on_writing. The on* lines carry ratio_vs_off and cost_percent (the bound:
// at most 3% throughput with tracing on), cpu_us_per_call(_off) and cpu_cost_percent (CPU time of both
// processes per call: what the load of a shared machine moves least), events_per_call_worker0 and
// records_per_call_worker0 (the records they took: an RPC site's events are one record, rpc/trace.h).
// Modes: off = recording paused (exactly what every site sees without a trace directory: enabled() is
// false); on = recording, events kept in memory (a traced run below the flush threshold, 256 MiB: the
// files are written at shutdown); on_writing = recording while the background writer writes everything
// buffered every 50 ms (what a run beyond the threshold pays while it writes). Both processes start with a
// trace directory (temporary, removed at the end); each comparison alternates blocks of off and the mode
// in both processes (the child through an RPC), and its cost is the median over the block pairs of the
// ratio mode / off, so a drift of the machine's load over the run biases neither.
// Usage: bench_trace [rounds=4000] [calls=40000] [blocks=20] [spans=200000]
// rounds: rpcSync calls per mode and comparison; calls: rpcAsync calls per mode, window and comparison;
// blocks: (off, mode) block pairs they are split into; spans: spans per rep of the span cost (10 reps).
#include "rpc/trace.h"

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "autograd/ops.h"
#include "bench/agent_pair.h"
#include "bench/bench_util.h"
#include "rpc/agent.h"

namespace distgrad::bench {
namespace {

namespace fs = std::filesystem;

inline const rpc::Function<int64_t(int64_t)> kPing{"ping"};
// A pipeline-stage-like call: a [32, 256] float32 activation times a [256, 256] weight held by the callee.
inline const rpc::Function<tensor::Tensor(tensor::Tensor)> kStage{"stage"};
constexpr int64_t kStageRows = 32;
constexpr int64_t kStageWidth = 256;
inline const rpc::Function<void(int64_t)> kSetMode{"bench.trace.set_mode"};

// The three ways a phase runs, in both processes at once.
enum Mode : int64_t {
  kOff = 0,      // recording paused: every site sees trace::enabled() false
  kOn = 1,       // recording, events kept in memory (the default below the flush threshold)
  kWriting = 2,  // recording, and the background writer writes everything buffered every 50 ms
};
const char* modeName(int64_t mode) { return mode == kOff ? "off" : mode == kOn ? "on" : "on_writing"; }

void applyMode(int64_t mode) {
  trace::setPaused(mode == kOff);
  trace::setFlushThreshold(mode == kWriting ? 0 : trace::kDefaultFlushThresholdBytes);
}

struct Config {
  int rounds = 4000;   // rpcSync calls per mode and comparison
  int calls = 40000;   // rpcAsync calls per mode, window and comparison
  int blocks = 20;     // pairs of (off, on) blocks they are split into
  int spans = 200000;  // spans per rep of the span cost
};

double threadCpuSeconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

std::string loadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one;
  in >> one;
  return one.empty() ? "null" : one;
}

// A template, not a std::function: the body is inlined, so the loop measures the recording site alone.
template <typename Body>
double nsPerIteration(Body body, int iterations) {
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
  // An RPC site's record (trace::recordRpc: a call's send, 3 events), as a traced run stores it: into memory
  // not touched before (its records stay in memory up to the flush threshold). CPU time of this thread
  // (page faults included) per record, measured before the spans so that the memory is fresh as in a traced
  // run (rep 0 is a warm-up). The records go to a worker without a file, so the flush after the reps drops
  // them instead of writing them.
  std::vector<double> rpcRecord;
  {
    const trace::WorkerSlot sink = trace::registerWorker("rpc-record-bench", 0);
    trace::RpcRecord record;
    record.site = trace::RpcSite::kClientSend;
    record.flags = trace::kRpcToTransport;
    record.function = trace::intern("ping");
    record.peer = 1;
    record.bytes = 236;
    record.worker = sink;
    int64_t t = trace::nowNs();
    for (int rep = 0; rep < 11; ++rep) {
      const double cpu0 = threadCpuSeconds();
      for (int i = 0; i < config.spans; ++i) {
        record.call = static_cast<uint64_t>(rep * config.spans + i);
        record.flow = trace::callFlowId(0, record.call);
        record.t[0] = t;
        record.t[1] = t + 900;
        record.t[2] = t + 1700;
        t += 5000;
        trace::recordRpc(record);
      }
      if (rep > 0) rpcRecord.push_back(1e9 * (threadCpuSeconds() - cpu0) / config.spans);
    }
    trace::flush();
    trace::unregisterWorker(sink);
  }
  // The trace clock turns to the time-stamp counter at the writer's second pass (Note [TSC trace clock]).
  for (int i = 0; i < 40 && std::string(trace::clockName()) != "tsc"; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const std::string spanClock = trace::clockName();
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
  emit("trace", "rpc_record_on", "ns", statsOf(rpcRecord),
       {{"records_per_rep", std::to_string(config.spans)}, {"memory", quoted("fresh")}});
  const Stats offStats = statsOf(off);
  emit("trace", "span_off", "ns", offStats, {{"spans_per_rep", std::to_string(config.spans * 10)}});
  emit("trace", "span_on", "ns", statsOf(on),
       {{"spans_per_rep", std::to_string(config.spans)},
        {"event_bytes", std::to_string(sizeof(trace::Event))},
        {"clock", quoted(spanClock)}});
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
    registry.bind(kSetMode, [](int64_t mode) { applyMode(mode); });
    auto weight = std::make_shared<tensor::Tensor>(tensor::Tensor::ones({kStageWidth, kStageWidth}) * 0.01);
    registry.bind(kStage, [weight](tensor::Tensor x) { return matmul(x, *weight); });
  }
  return registry;
}

// One block of calls in one mode: what it measured.
struct Block {
  std::vector<double> rttUs;  // rpcSync round trips
  double callsPerSecond = 0;  // rpcAsync with `window` in flight
  double cpuUsPerCall = 0;    // CPU of both processes (every thread) per call
  uint64_t events = 0;        // events this process recorded
  uint64_t records = 0;       // records they took (an RPC site's events are one record, rpc/trace.h)
  uint64_t calls = 0;
};

void setModeEverywhere(rpc::Agent& agent, int64_t mode) {
  agent.rpcSync("worker1", kSetMode, mode);
  applyMode(mode);
}

// `calls` rpcSync calls (window 0) or rpcAsync calls with `window` in flight, in `mode`; no-op pings or,
// with `stage`, stage calls.
Block runBlock(AgentPair& pair, int64_t mode, int window, int calls, bool stage = false) {
  rpc::Agent& agent = pair.agent();
  setModeEverywhere(agent, mode);
  Block block;
  const trace::Stats stats0 = trace::stats();
  const double cpu0 = processCpuSeconds() + pair.childCpuSeconds();
  const auto t0 = std::chrono::steady_clock::now();
  if (window == 0) {
    for (int i = 0; i < calls; ++i) {
      const auto c0 = std::chrono::steady_clock::now();
      const int64_t r = agent.rpcSync("worker1", kPing, int64_t{i});
      block.rttUs.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - c0).count());
      check(r == i, "ping result");
    }
  } else {
    auto drive = [&](auto call) {
      std::deque<decltype(call(0))> inFlight;
      for (int i = 0; i < calls; ++i) {
        if (static_cast<int>(inFlight.size()) == window) {
          inFlight.front().get();
          inFlight.pop_front();
        }
        inFlight.push_back(call(i));
      }
      while (!inFlight.empty()) {
        inFlight.front().get();
        inFlight.pop_front();
      }
    };
    if (stage) {
      const tensor::Tensor x = tensor::Tensor::ones({kStageRows, kStageWidth});
      drive([&](int) { return agent.rpcAsync("worker1", kStage, x); });
    } else {
      drive([&](int i) { return agent.rpcAsync("worker1", kPing, int64_t{i}); });
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  block.callsPerSecond = calls / seconds;
  block.cpuUsPerCall = 1e6 * (processCpuSeconds() + pair.childCpuSeconds() - cpu0) / calls;
  const trace::Stats stats1 = trace::stats();
  block.events = stats1.recorded - stats0.recorded;
  block.records = stats1.records - stats0.records;
  block.calls = static_cast<uint64_t>(calls);
  return block;
}

// Off and `mode` alternate block by block (which goes first alternates too), so both see the same load of
// a shared machine; a figure's cost is the median over the pairs of (mode block / the off block beside it),
// which a drift of the load over the run does not bias.
void compareModes(AgentPair& pair, const Config& config, int64_t mode) {
  const std::string load = loadAverage();
  struct Figure {
    std::string metric, unit;
    int window;
    int callsPerBlock;
    bool higherIsBetter;
    bool stage = false;
  };
  const std::vector<Figure> figures = {
      {"rpcsync_rtt_noop", "us", 0, std::max(config.rounds / config.blocks, 20), false},
      {"rpcasync_throughput_w8", "calls/s", 8, std::max(config.calls / config.blocks, 100), true},
      {"rpcasync_throughput_w64", "calls/s", 64, std::max(config.calls / config.blocks, 100), true},
      {"stage_throughput_w8", "calls/s", 8, std::max(config.calls / config.blocks / 10, 20), true, true},
  };
  for (const Figure& figure : figures) {
    std::vector<double> offValues, onValues, ratios, offCpu, onCpu, cpuRatios;
    uint64_t events = 0, records = 0, calls = 0;
    for (int b = 0; b < config.blocks; ++b) {
      Block off, on;
      if (b % 2 == 0) {
        off = runBlock(pair, kOff, figure.window, figure.callsPerBlock, figure.stage);
        on = runBlock(pair, mode, figure.window, figure.callsPerBlock, figure.stage);
      } else {
        on = runBlock(pair, mode, figure.window, figure.callsPerBlock, figure.stage);
        off = runBlock(pair, kOff, figure.window, figure.callsPerBlock, figure.stage);
      }
      const double offValue = figure.window == 0 ? statsOf(off.rttUs).median : off.callsPerSecond;
      const double onValue = figure.window == 0 ? statsOf(on.rttUs).median : on.callsPerSecond;
      offValues.push_back(offValue);
      onValues.push_back(onValue);
      ratios.push_back(onValue / offValue);
      offCpu.push_back(off.cpuUsPerCall);
      onCpu.push_back(on.cpuUsPerCall);
      cpuRatios.push_back(on.cpuUsPerCall / off.cpuUsPerCall);
      events += on.events;
      records += on.records;
      calls += on.calls;
    }
    const double ratio = statsOf(ratios).median;
    const double cpuRatio = statsOf(cpuRatios).median;
    const std::string name = modeName(mode);
    emit("trace", figure.metric + "_off", figure.unit, statsOf(offValues),
         {{"tracing", quoted("off")}, {"blocks", std::to_string(config.blocks)}, {"loadavg", load}});
    emit("trace", figure.metric + "_" + name, figure.unit, statsOf(onValues),
         {{"tracing", quoted(name)},
          {"blocks", std::to_string(config.blocks)},
          {"ratio_vs_off", number(ratio)},
          {"cost_percent", number(100.0 * (figure.higherIsBetter ? 1.0 - ratio : ratio - 1.0))},
          {"cpu_us_per_call_off", number(statsOf(offCpu).median)},
          {"cpu_us_per_call", number(statsOf(onCpu).median)},
          {"cpu_cost_percent", number(100.0 * (cpuRatio - 1.0))},
          {"events_per_call_worker0", number(static_cast<double>(events) / static_cast<double>(calls))},
          {"records_per_call_worker0", number(static_cast<double>(records) / static_cast<double>(calls))},
          {"clock", quoted(trace::clockName())},
          {"loadavg", load}});
  }
}

void measureRpc(const Config& config, const std::string& dir) {
  {
    AgentPair pair(
        /*pinned=*/false, [&dir](int rank, const std::string& store) { return pairOptions(rank, store, dir); },
        pairRegistry, [] { applyMode(kOff); });
    rpc::Agent& agent = pair.agent();
    setModeEverywhere(agent, kOff);
    for (int i = 0; i < 500; ++i) agent.rpcSync("worker1", kPing, int64_t{i});  // warm-up
    compareModes(pair, config, kOn);
    compareModes(pair, config, kWriting);
    setModeEverywhere(agent, kOn);  // the shutdown writes both files completely
  }
  // The files the two agents wrote: each must be complete (a broken trace would make "on" look cheap).
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
  emit("trace", "trace_lines_written", "lines",
       Stats{static_cast<double>(lines), static_cast<double>(lines), static_cast<double>(lines), 1});
}

}  // namespace
}  // namespace distgrad::bench

int main(int argc, char** argv) {
  using namespace distgrad::bench;
  Config config;
  if (argc > 1) config.rounds = std::max(std::atoi(argv[1]), 10);
  if (argc > 2) config.calls = std::max(std::atoi(argv[2]), 100);
  if (argc > 3) config.blocks = std::max(std::atoi(argv[3]), 1);
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
