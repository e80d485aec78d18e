// RPC overhead against the raw loopback limit, two processes (fork) over tcp on 127.0.0.1:
//   raw_socket pingpong_rtt_64B        blocking sockets, 64 B each way (the floor)
//   rpc        rpcsync_rtt_noop        rpcSync of a no-op i64(i64) function, median/p99 round trip
//   rpc        rpcasync_throughput_wW  rpcAsync calls/s with W = 1, 8, 64 calls in flight
// JSON lines (bench/bench_util.h). Usage: bench_rpc [rounds=5000] [calls=20000]
#include <cstdlib>
#include <deque>

#include "bench/socket_bench_util.h"
#include "rpc/agent.h"

namespace {

using namespace distgrad;
inline const rpc::Function<int64_t(int64_t)> kPing{"ping"};

rpc::Options optionsFor(int rank, int storePort) {
  rpc::Options options;
  options.rank = rank;
  options.worldSize = 2;
  options.transport = "tcp";
  options.storeAddr = "127.0.0.1:" + std::to_string(storePort);
  options.executorThreads = 2;
  options.secret = "bench";
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace distgrad::bench;
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5000;
  const int calls = argc > 2 ? std::atoi(argv[2]) : 20000;
  emitMeasurement("raw_socket", "pingpong_rtt_64B", "us", rawPingPong(rounds, false), false);

  int ports[2];
  check(pipe(ports) == 0, "pipe");
  pid_t child = forkChild(false, [&] {
    int storePort = 0;
    check(::read(ports[0], &storePort, sizeof(storePort)) == sizeof(storePort), "read store port");
    rpc::Registry reg;
    reg.bind(kPing, [](int64_t x) { return x; });
    auto agent = rpc::Agent::start(optionsFor(1, storePort), reg);
    agent->shutdown();  // returns once the parent shuts down too
  });
  auto store = rpc::StoreServer::start("127.0.0.1:0");
  int storePort = store->port();
  check(::write(ports[1], &storePort, sizeof(storePort)) == sizeof(storePort), "write store port");
  rpc::Registry reg;
  auto agent = rpc::Agent::start(optionsFor(0, storePort), reg);

  std::vector<double> us;
  us.reserve(static_cast<size_t>(rounds));
  for (int i = 0; i < rounds; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    int64_t r = agent->rpcSync("worker1", kPing, int64_t{i});
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    check(r == i, "ping result");
  }
  us.erase(us.begin(), us.begin() + std::min<size_t>(us.size() / 10, 500));  // warm-up
  emitMeasurement("rpc", "rpcsync_rtt_noop", "us", measurementOf(us), false);

  for (int window : {1, 8, 64}) {
    std::vector<double> rates;
    for (int rep = 0; rep < 5; ++rep) {
      std::deque<rpc::Future<int64_t>> inFlight;
      const int n = calls / 5;
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < n; ++i) {
        if (static_cast<int>(inFlight.size()) == window) {
          inFlight.front().get();
          inFlight.pop_front();
        }
        inFlight.push_back(agent->rpcAsync("worker1", kPing, int64_t{i}));
      }
      while (!inFlight.empty()) {
        inFlight.front().get();
        inFlight.pop_front();
      }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rates.push_back(n / s);
    }
    emitMeasurement("rpc", "rpcasync_throughput_w" + std::to_string(window), "calls/s", measurementOf(rates), false,
                    {{"in_flight", std::to_string(window)}});
  }
  agent->shutdown();
  agent.reset();
  reap(child);
  return 0;
}
