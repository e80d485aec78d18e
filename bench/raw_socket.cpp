// The raw limits of this machine's loopback TCP: blocking-socket 64 B ping-pong between two processes
// (median/p99 round trip, us) and a 64 MB message stream (GB/s), unpinned and with both processes on CPU 0.
// Usage: bench_raw_socket [rounds=20000] [messages=20]
#include <cstdlib>

#include "bench/socket_bench_util.h"

int main(int argc, char** argv) {
  using namespace distgrad::bench;
  int rounds = argc > 1 ? std::atoi(argv[1]) : 20000;
  int messages = argc > 2 ? std::atoi(argv[2]) : 20;
  for (bool pinned : {false, true}) {
    emitMeasurement("raw_socket", "pingpong_rtt_64B", "us", rawPingPong(rounds, pinned), pinned);
    emitMeasurement("raw_socket", "stream_64MB", "GB/s", rawStream(messages, pinned), pinned);
  }
  return 0;
}
