// The RRef layer against plain RPC, measured in one run: three processes (fork) on 127.0.0.1 over tcp,
// worker0 (this process, the driver, hosting the store) and worker1, worker2 (children). The reference is
// our own no-op rpcSync round trip worker0 -> worker1, measured first in the same run:
//   rpc  rpcsync_rtt_noop         rpcSync of a no-op i64(i64) function (median/p99, us)
//   rref remote_tohere            remote("worker1", inc, i) then toHere(): the creating call and the fetch
//                                 travel back to back, so 1 round trip
//   rref fork_third_fetch         an RRef owned by worker1 sent to worker2, which fetches it from worker1
//                                 and answers: 2 round trips (worker0 -> worker2, worker2 -> worker1)
//   rref method_rpcsync           rpcSync of a method of an object behind an RRef (owned by worker1): 1
//   rref chain3_pipelined         a = remote(inc, 0); b = remote(incRef, a); c = remote(incRef, b);
//                                 c.toHere(): each call depends on the previous value, the calls wait at
//                                 the owner (promise pipelining), so 1 round trip
//   rref chain3_sequential        the same chain with toHere() after each remote: 3 round trips
//   rpc  rpcasync3_rtt_noop       three rpcAsync of a no-op function issued together, then their results:
//                                 the messages of the pipelined chain with no RRef, in one round trip of latency
// Each rref line carries round_trips (the round trips on the operation's critical path), rpc_rtt_median
// (the pings alternating with that figure's operations, in chunks of 50) and ratio_vs_rpc = ours / (round_trips x rpc
// rtt) (above 1: time beyond the network round trips), and calls_per_op (calls worker0 sent per operation, including
// the asynchronous fork/accept/delete control calls); mean, rpc_rtt_mean and mean_ratio_vs_rpc: the same from the
// means, which a loop of operations costs (the tails and the batched deletions running beside them included).
// chain3_pipelined adds round_trips_saved, speedup_vs_sequential (sequential / pipelined) and ratio_vs_rpc_async3 (ours
// / rpcasync3_rtt_noop: what the RRef layer adds to the three calls it sends). Every figure is taken
// twice: the three processes free to run anywhere ("placement":"free"), then all pinned to CPU 0 ("one_core"), where
// the ratios do not move with where the scheduler puts the threads. JSON lines (bench/bench_util.h). Usage: bench_rref
// [rounds=5000] [trace_dir] (trace_dir: every worker writes a trace there, for distgrad-trace; the figures then include
// the tracing cost).
#include "rref/rref.h"

#include <csignal>
#include <cstdlib>
#include <numeric>
#include <thread>

#include "bench/socket_bench_util.h"
#include "rpc/agent.h"
#include "rref/context.h"

namespace distgrad::bench {

// A registered class: its method is the "method through an RRef" figure.
class Box {
 public:
  explicit Box(int64_t value) : value_(value) {}
  int64_t get() const { return value_; }

 private:
  int64_t value_;
};

inline const rpc::Class<Box> kBox = rpc::Class<Box>("Box").method("get", &Box::get);

}  // namespace distgrad::bench

DG_RREF_CLASS(distgrad::bench::Box, distgrad::bench::kBox);

namespace distgrad::bench {
namespace {

using rref::RRef;

inline const rpc::Function<int64_t(int64_t)> kPing{"ping"};
inline const rpc::Function<int64_t(int64_t)> kInc{"inc"};
inline const rpc::Function<int64_t(RRef<int64_t>)> kIncRef{"inc_ref"};    // the argument's value + 1
inline const rpc::Function<int64_t(RRef<int64_t>)> kReadRef{"read_ref"};  // the argument's value

constexpr int kWorldSize = 3;

// bench_rref's second argument: every worker traces into this directory (distgrad-trace report/merge it).
std::string gTraceDir;

rpc::Options optionsFor(int rank, int storePort) {
  rpc::Options options;
  options.traceDir = gTraceDir;
  options.rank = rank;
  options.worldSize = kWorldSize;
  options.transport = "tcp";
  options.storeAddr = "127.0.0.1:" + std::to_string(storePort);
  options.executorThreads = 2;
  options.secret = "bench";
  return options;
}

rpc::Registry makeRegistry() {
  rpc::Registry registry;
  rref::RRefContext::install(registry);
  registry.bindClass(kBox).ctor<int64_t>();
  registry.bind(kPing, [](int64_t x) { return x; });
  registry.bind(kInc, [](int64_t x) { return x + 1; });
  registry.bind(kIncRef, [](RRef<int64_t> r) { return r.toHereAsync().then([](int64_t v) { return v + 1; }); });
  registry.bind(kReadRef, [](RRef<int64_t> r) { return r.toHereAsync(); });
  return registry;
}

// Three agents in three processes: the children (forked before any thread of this process exists) run
// worker1 and worker2 and wait on a pipe for the word to shut down; this process runs worker0 and hosts
// the store.
class AgentTrio {
 public:
  // Pin this process first when `pinned` (its agent's threads inherit the mask); the children pin themselves.
  explicit AgentTrio(bool pinned) {
    for (int rank = 1; rank < kWorldSize; ++rank) {
      int commands[2];
      check(pipe(commands) == 0, "pipe");
      children_.push_back(forkChild(pinned, [&] {
        ::close(commands[1]);
        runChild(rank, commands[0]);
      }));
      ::close(commands[0]);
      toChild_.push_back(commands[1]);
    }
    store_ = rpc::StoreServer::start("127.0.0.1:0");
    int storePort = store_->port();
    for (int fd : toChild_) check(::write(fd, &storePort, sizeof(storePort)) == sizeof(storePort), "write port");
    agent_ = rpc::Agent::start(optionsFor(0, storePort), makeRegistry());
  }
  AgentTrio(const AgentTrio&) = delete;
  AgentTrio& operator=(const AgentTrio&) = delete;

  ~AgentTrio() {
    for (int fd : toChild_) {
      check(::write(fd, "q", 1) == 1, "write quit");
      ::close(fd);
    }
    agent_->shutdown();  // meets the children's shutdown at the store barrier
    // The children leave the store only after their shutdown completed: keep it up until they exited.
    for (pid_t child : children_) reap(child);
    agent_.reset();
    store_.reset();
  }

  rpc::Agent& agent() { return *agent_; }

  // Sum of calls this process sent to every peer.
  uint64_t callsSent() {
    uint64_t total = 0;
    for (const char* peer : {"worker1", "worker2"}) total += agent_->metrics(peer).callsSent;
    return total;
  }

 private:
  static void runChild(int rank, int commands) {
    int storePort = 0;
    check(::read(commands, &storePort, sizeof(storePort)) == sizeof(storePort), "read store port");
    auto agent = rpc::Agent::start(optionsFor(rank, storePort), makeRegistry());
    char command = 0;
    while (::read(commands, &command, 1) == 1 && command != 'q') {
    }
    agent->shutdown();
  }

  std::vector<pid_t> children_;
  std::vector<int> toChild_;
  std::unique_ptr<rpc::StoreServer> store_;
  std::unique_ptr<rpc::Agent> agent_;
};

// Waits (bounded) until this worker's references and control calls settled (no more than `kept` user
// references, the ones the figure holds on purpose), so one figure's deletions do not run inside the next
// one's loop.
void settle(rref::RRefContext& rrefs, size_t kept = 0) {
  for (int i = 0; i < 5000; ++i) {
    if (rrefs.userCount() <= kept && rrefs.pendingChildCount() == 0 && rrefs.pendingControlCount() == 0) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::fprintf(stderr, "bench_rref: references did not settle within 5 s\n");
}

// One figure: `rounds` operations and as many no-op rpcSync round trips to worker1, alternating in chunks
// of kChunk, so both see the same machine load (the run shares its cores with whatever else runs) while a
// ping rarely overlaps the asynchronous tail (deletions, accepts) of the operation before it; a tenth (at
// most 200) of untimed warm-up operations first.
constexpr int kChunk = 50;

struct Figure {
  Measurement op;
  Measurement rtt;
  double opMean = 0, rttMean = 0;  // µs: what a loop of them costs, the tails and deferred work included
  double callsPerOp = 0;  // calls worker0 sent per operation (the reference pings not counted)
};

template <typename F>
Figure measure(AgentTrio& trio, rref::RRefContext& rrefs, int rounds, F&& op, size_t kept = 0) {
  rpc::Agent& agent = trio.agent();
  settle(rrefs, kept);
  const uint64_t calls0 = trio.callsSent();
  const int warmup = std::min(rounds / 10, 200);
  for (int i = 0; i < warmup; ++i) op(i);
  std::vector<double> opUs, rttUs;
  opUs.reserve(static_cast<size_t>(rounds));
  rttUs.reserve(static_cast<size_t>(rounds));
  for (int done = 0; done < rounds; done += kChunk) {
    const int n = std::min(kChunk, rounds - done);
    for (int i = 0; i < n; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      check(agent.rpcSync("worker1", kPing, int64_t{i}) == i, "ping result");
      rttUs.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    for (int i = done; i < done + n; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      op(warmup + i);
      opUs.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  // Deferred deletions and accepts are part of an operation's cost: count them before reading the calls.
  settle(rrefs, kept);
  Figure f;
  auto mean = [](const std::vector<double>& us) { return std::accumulate(us.begin(), us.end(), 0.0) / us.size(); };
  f.opMean = mean(opUs);
  f.rttMean = mean(rttUs);
  f.op = measurementOf(std::move(opUs));
  f.rtt = measurementOf(std::move(rttUs));
  const auto total = static_cast<double>(trio.callsSent() - calls0) - rounds;
  f.callsPerOp = total / (warmup + rounds);
  return f;
}

// One rref line: ratio_vs_rpc = ours / (round trips on the critical path x the rpc round trip measured
// beside it); mean_ratio_vs_rpc the same from the means.
void emitRRef(const std::string& metric, const Figure& f, int roundTrips, bool pinned,
              std::map<std::string, std::string> extra = {}) {
  extra["round_trips"] = std::to_string(roundTrips);
  extra["rpc_rtt_median"] = number(f.rtt.stats.median);
  extra["rpc_rtt_p99"] = number(f.rtt.p99);
  extra["ratio_vs_rpc"] = number(f.op.stats.median / (roundTrips * f.rtt.stats.median));
  extra["p99_ratio_vs_rpc"] = number(f.op.p99 / (roundTrips * f.rtt.p99));
  extra["mean"] = number(f.opMean);
  extra["rpc_rtt_mean"] = number(f.rttMean);
  extra["mean_ratio_vs_rpc"] = number(f.opMean / (roundTrips * f.rttMean));
  extra["calls_per_op"] = number(f.callsPerOp);
  emitMeasurement("rref", metric, "us", f.op, pinned, std::move(extra));
}

// Every figure, with the three processes free to run anywhere or all pinned to CPU 0.
void measureAll(int rounds, bool pinned) {
  AgentTrio trio(pinned);
  rpc::Agent& agent = trio.agent();
  auto rrefs = rref::RRefContext::of(agent);
  {
    // The reference alone (each figure below also carries the one measured beside it).
    Figure f = measure(trio, *rrefs, rounds, [&](int i) {
      check(agent.rpcSync("worker1", kPing, int64_t{i}) == i, "ping result");
    });
    emitMeasurement("rpc", "rpcsync_rtt_noop", "us", f.op, pinned);
  }
  emitRRef("remote_tohere",
           measure(trio, *rrefs, rounds,
                   [&](int i) {
                     RRef<int64_t> r = rrefs->remote("worker1", kInc, int64_t{i});
                     check(r.toHere() == i + 1, "remote result");
                   }),
           1, pinned);
  {
    RRef<int64_t> r = rrefs->remote("worker1", kInc, int64_t{41});
    check(r.toHere() == 42, "remote result");
    emitRRef("fork_third_fetch",
             measure(
                 trio, *rrefs, rounds,
                 [&](int) { check(agent.rpcSync("worker2", kReadRef, r) == 42, "third worker result"); }, /*kept=*/1),
             2, pinned);
  }
  {
    RRef<Box> box = rrefs->remote<Box>("worker1", int64_t{7});
    check(box.rpcSync(&Box::get) == 7, "method result");
    emitRRef("method_rpcsync",
             measure(
                 trio, *rrefs, rounds, [&](int) { check(box.rpcSync(&Box::get) == 7, "method result"); }, /*kept=*/1),
             1, pinned);
  }
  {
    Figure seq = measure(trio, *rrefs, rounds, [&](int i) {
      RRef<int64_t> a = rrefs->remote("worker1", kInc, int64_t{i});
      (void)a.toHere();
      RRef<int64_t> b = rrefs->remote("worker1", kIncRef, a);
      (void)b.toHere();
      RRef<int64_t> c = rrefs->remote("worker1", kIncRef, b);
      check(c.toHere() == i + 3, "sequential chain result");
    });
    Figure pipe = measure(trio, *rrefs, rounds, [&](int i) {
      RRef<int64_t> a = rrefs->remote("worker1", kInc, int64_t{i});
      RRef<int64_t> b = rrefs->remote("worker1", kIncRef, a);
      RRef<int64_t> c = rrefs->remote("worker1", kIncRef, b);
      check(c.toHere() == i + 3, "pipelined chain result");
    });
    // The plain RPC floor of the pipelined chain: its three calls and their answers, in flight together.
    Figure async3 = measure(trio, *rrefs, rounds, [&](int i) {
      auto x = agent.rpcAsync("worker1", kInc, int64_t{i});
      auto y = agent.rpcAsync("worker1", kInc, int64_t{i + 1});
      auto z = agent.rpcAsync("worker1", kInc, int64_t{i + 2});
      check(x.get() + y.get() + z.get() == 3 * i + 6, "three calls' results");
    });
    emitMeasurement("rpc", "rpcasync3_rtt_noop", "us", async3.op, pinned);
    emitRRef("chain3_sequential", seq, 3, pinned);
    emitRRef("chain3_pipelined", pipe, 1, pinned,
             {{"round_trips_saved", "2"},
              {"sequential_median", number(seq.op.stats.median)},
              {"speedup_vs_sequential", number(seq.op.stats.median / pipe.op.stats.median)},
              {"rpc_async3_median", number(async3.op.stats.median)},
              {"ratio_vs_rpc_async3", number(pipe.op.stats.median / async3.op.stats.median)}});
  }
  settle(*rrefs);
}

}  // namespace
}  // namespace distgrad::bench

int main(int argc, char** argv) {
  using namespace distgrad::bench;
  using namespace distgrad;
  int rounds = 5000;
  if (argc > 1) rounds = std::max(std::atoi(argv[1]), 10);
  if (argc > 2) gTraceDir = argv[2];  // set before the children are forked: they trace too
  std::signal(SIGPIPE, SIG_IGN);

  // Free placement first; then all three processes on CPU 0, where the figures do not move with where
  // the scheduler puts the threads (on this 2-vCPU machine a no-op round trip measured 31-90 us free,
  // within one run). The agents of the first trio have stopped (threads joined) before the second forks.
  const cpu_set_t freeAffinity = currentAffinity();
  measureAll(rounds, /*pinned=*/false);
  pinToCpu0();
  measureAll(rounds, /*pinned=*/true);
  restoreAffinity(freeAffinity);
  return 0;
}
