// Our transports against the raw socket limits, in the same run: a 64 B-envelope frame ping-pong between
// two processes (round trip, us) and an echo of one payload of 1 KB to 64 MB (the frame comes back with the
// same payload; GB/s counting both directions), for tcp, ucx (event-driven: the loop sleeps on the
// worker's event fd) and ucx-poll (ContextOptions::ucxBusyPoll: the loop spins), each line with the CPU
// both processes burned per wall second (`cpu_busy_client` / `cpu_busy_server`) and, for ucx, the
// transports ucp chose for the connection (`ucx_transports`, from ucp_ep_print_info). The ping-pong also
// runs with both processes pinned to CPU 0 for tcp (the ucx busy-poll loops cannot share one core).
// Ratios: ratio_vs_raw = ours / raw (above 1 is overhead for a time, below 1 for a bandwidth);
// ratio_vs_tcp likewise against our tcp transport in the same run.
// Usage: bench_transport [rounds=20000] [messages=20] [transports=tcp,ucx,ucx-poll]

#include <condition_variable>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <sstream>

#include "bench/socket_bench_util.h"
#include "rpc/transport/transport.h"
#ifdef DG_HAVE_UCX
#include "rpc/transport/ucx/context.h"
#endif

namespace distgrad::bench {
namespace {

using namespace distgrad::rpc;             // NOLINT
using namespace distgrad::rpc::transport;  // NOLINT

// "tcp", "ucx" or "ucx-poll" (ucx with ucxBusyPoll).
std::unique_ptr<Context> makeContext(const std::string& transport) {
  ContextOptions options;
  options.ucxBusyPoll = transport == "ucx-poll";
  auto created = createContext(transport == "ucx-poll" ? "ucx" : transport, options);
  if (!created.ok()) {
    std::fprintf(stderr, "bench_transport: %s\n", created.error().message.c_str());
    std::exit(1);
  }
  return std::move(created).value();
}

// A payload allocator over one reused buffer: the figures measure the wire, not malloc and page faults.
PayloadAllocator sinkAllocator(std::vector<uint8_t>& sink) {
  return [&sink](std::span<const uint8_t>, std::span<const uint64_t> sizes) -> Result<std::vector<PayloadBuffer>> {
    std::vector<PayloadBuffer> out;
    if (sizes.size() > 1) return Error::failed("one payload per frame");
    for (uint64_t s : sizes) {
      if (s > sink.size()) return Error::failed("payload larger than the sink");
      out.push_back({sink.data(), s, nullptr});
    }
    return out;
  };
}

// The child: listens, reports its port through `portPipe`, answers every frame with the same envelope and
// payloads (an echo), and exits when the parent hangs up.
void serveChild(const std::string& transport, int portPipe) {
  auto context = makeContext(transport);
  std::promise<void> finished;
  std::shared_ptr<Connection> connection;
  std::vector<uint8_t> sink(kStreamBytes);
  // CPU seconds of this process from the first frame to the hang-up: reported back through the pipe.
  double firstFrameCpu = -1, closedCpu = 0;
  auto listener = context
                      ->listen("127.0.0.1:0",
                               [&](std::shared_ptr<Connection> c) {
                                 connection = c;
                                 Connection* raw = c.get();
                                 c->start(sinkAllocator(sink),
                                          [raw, &firstFrameCpu](IncomingFrame&& frame) {
                                            if (firstFrameCpu < 0) firstFrameCpu = processCpuSeconds();
                                            OutgoingFrame reply;
                                            reply.envelope = std::move(frame.envelope);
                                            for (auto& p : frame.payloads) reply.payloads.push_back({p.data, p.size, p.owner});
                                            raw->send(std::move(reply), nullptr);
                                          },
                                          [&](const Error&) {
                                            closedCpu = processCpuSeconds();
                                            finished.set_value();
                                          });
                               })
                      .value();
  std::string address = listener->address();
  int port = std::atoi(address.substr(address.rfind(':') + 1).c_str());
  check(::write(portPipe, &port, sizeof(port)) == sizeof(port), "write port");
  finished.get_future().wait();
  context->close();
  double busy = firstFrameCpu < 0 ? 0.0 : closedCpu - firstFrameCpu;
  check(::write(portPipe, &busy, sizeof(busy)) == sizeof(busy), "write cpu");
}

struct Client {
  std::unique_ptr<Context> context;
  std::shared_ptr<Connection> connection;
  std::vector<uint8_t> sink = std::vector<uint8_t>(kStreamBytes);
  std::mutex mutex;
  std::condition_variable replied;
  uint64_t replies = 0;

  Client(const std::string& transport, int port) : context(makeContext(transport)) {
    std::promise<Result<std::shared_ptr<Connection>>> connected;
    context->connect("127.0.0.1:" + std::to_string(port),
                     [&](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
    connection = connected.get_future().get().value();
    connection->start(
        sinkAllocator(sink),
        [this](IncomingFrame&&) {
          std::lock_guard lock(mutex);
          ++replies;
          replied.notify_one();
        },
        [](const Error&) {});
  }
  void waitReplies(uint64_t n) {
    std::unique_lock lock(mutex);
    replied.wait(lock, [&] { return replies >= n; });
  }
  std::string transports() { return connection->lanes(); }
  ~Client() {
    connection->close();
    context->close();
  }
};

// Forks the echo server; `pipeFd` then gives its CPU seconds of the traffic once the client hung up.
pid_t startServer(const std::string& transport, bool pinned, int& port, int& pipeFd) {
  int fds[2];
  check(pipe(fds) == 0, "pipe");
  std::fflush(stdout);  // the child must not print what the parent buffered
  pid_t child = forkChild(pinned, [&] {
    ::close(fds[0]);
    serveChild(transport, fds[1]);
  });
  ::close(fds[1]);
  check(::read(fds[0], &port, sizeof(port)) == sizeof(port), "read port");
  pipeFd = fds[0];
  return child;
}

double reapCpu(pid_t pid, int pipeFd) {
  double busy = 0;
  if (::read(pipeFd, &busy, sizeof(busy)) != sizeof(busy)) busy = -1;
  ::close(pipeFd);
  reap(pid);
  return busy;
}

struct Result2 {
  Measurement m;
  double cpuClient = 0, cpuServer = 0;  // CPU seconds per wall second
  std::string transports;
};

// One connection to a fresh server: `rounds` frames of a 64 B envelope and a payload of `bytes` (none when
// 0), each echoed before the next; samples are us per round trip (bytes == 0) or GB/s of both directions.
Result2 exchange(const std::string& transport, size_t bytes, int rounds, bool pinned) {
  int port = 0, pipeFd = -1;
  pid_t child = startServer(transport, pinned, port, pipeFd);
  Result2 out;
  std::vector<double> samples;
  double wall = 0, cpu = 0;
  {
    Client client(transport, port);
    auto data = std::make_shared<std::vector<uint8_t>>(std::max<size_t>(bytes, 1), 7);
    int warmup = bytes == 0 ? std::min(rounds / 10, 1000) : 1;
    double cpu0 = 0;
    auto wall0 = std::chrono::steady_clock::now();
    for (int i = 0; i < rounds + warmup; ++i) {
      if (i == warmup) {
        cpu0 = processCpuSeconds();
        wall0 = std::chrono::steady_clock::now();
      }
      OutgoingFrame frame;
      frame.envelope.assign(kPingBytes, 1);
      if (bytes > 0) frame.payloads.push_back({data->data(), bytes, std::shared_ptr<const void>(data, data->data())});
      auto t0 = std::chrono::steady_clock::now();
      client.connection->send(std::move(frame), nullptr);
      client.waitReplies(static_cast<uint64_t>(i) + 1);
      auto t1 = std::chrono::steady_clock::now();
      if (i < warmup) continue;
      if (bytes == 0) {
        samples.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      } else {
        samples.push_back(2.0 * static_cast<double>(bytes) / std::chrono::duration<double>(t1 - t0).count() / 1e9);
      }
    }
    wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
    cpu = processCpuSeconds() - cpu0;
    out.transports = client.transports();
  }
  double childCpu = reapCpu(child, pipeFd);
  out.m = measurementOf(samples);
  out.cpuClient = cpu / wall;
  // From the server's first frame (the client's warm-up) to the hang-up, over the timed stretch: a slight
  // overestimate.
  out.cpuServer = childCpu / wall;
  return out;
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string sizeName(size_t bytes) {
  return bytes >= (1u << 20) ? std::to_string(bytes >> 20) + "MB" : std::to_string(bytes >> 10) + "KB";
}

}  // namespace
}  // namespace distgrad::bench

int main(int argc, char** argv) {
  using namespace distgrad::bench;
  int rounds = argc > 1 ? std::atoi(argv[1]) : 20000;
  int messages = argc > 2 ? std::atoi(argv[2]) : 20;
  std::vector<std::string> transports = split(argc > 3 ? argv[3] : "tcp,ucx,ucx-poll");
  {
    std::string reason = distgrad::rpc::transport::ucxUnavailableReason();
    if (!reason.empty()) {
      std::vector<std::string> kept;
      for (const auto& t : transports) {
        if (t.rfind("ucx", 0) == 0) {
          std::printf("{\"bench\":\"transport_%s\",\"impl\":\"distgrad\",\"skipped\":%s}\n", t.c_str(),
                      quoted(reason).c_str());
        } else {
          kept.push_back(t);
        }
      }
      transports = kept;
    }
  }
#ifdef DG_HAVE_UCX
  if (distgrad::rpc::transport::ucxUnavailableReason().empty()) {
    std::printf("{\"bench\":\"transport_ucx\",\"info\":\"memory_types\",\"memory_types\":%s,\"cuda\":%s}\n",
                quoted(distgrad::rpc::transport::ucx::ucxMemoryTypes()).c_str(),
                distgrad::rpc::transport::ucx::ucxSupportsCudaMemory() ? "true" : "false");
    std::fflush(stdout);
  }
#endif
  auto extras = [](const Result2& r, double raw, double tcp) {
    std::map<std::string, std::string> e{{"raw_median", number(raw)},
                                         {"ratio_vs_raw", number(r.m.stats.median / raw)},
                                         {"cpu_busy_client", number(r.cpuClient)},
                                         {"cpu_busy_server", number(r.cpuServer)}};
    if (tcp > 0) e["ratio_vs_tcp"] = number(r.m.stats.median / tcp);
    if (!r.transports.empty()) e["ucx_transports"] = quoted(r.transports);
    return e;
  };
  // Free placement: every transport, ping-pong and echo sizes.
  Measurement rawRtt = rawPingPong(rounds, false);
  emitMeasurement("raw_socket", "pingpong_rtt_64B", "us", rawRtt, false);
  double tcpRtt = 0;
  for (const auto& t : transports) {
    Result2 r = exchange(t, 0, rounds, false);
    if (t == "tcp") tcpRtt = r.m.stats.median;
    emitMeasurement("transport_" + t, "pingpong_rtt_64B", "us", r.m, false,
                    extras(r, rawRtt.stats.median, t == "tcp" ? 0 : tcpRtt));
  }
  for (size_t bytes : {size_t{1} << 10, size_t{64} << 10, size_t{1} << 20, size_t{16} << 20, size_t{64} << 20}) {
    int n = bytes <= (64u << 10) ? std::max(rounds / 10, 20) : bytes <= (1u << 20) ? std::max(rounds / 50, 20) : messages;
    Measurement raw = rawExchange(bytes, bytes, n, false);
    std::string metric = "echo_" + sizeName(bytes);
    emitMeasurement("raw_socket", metric, "GB/s", raw, false);
    double tcp = 0;
    for (const auto& t : transports) {
      Result2 r = exchange(t, bytes, n, false);
      if (t == "tcp") tcp = r.m.stats.median;
      emitMeasurement("transport_" + t, metric, "GB/s", r.m, false, extras(r, raw.stats.median, t == "tcp" ? 0 : tcp));
    }
  }
  // Both processes on CPU 0: the tcp ping-pong (and ucx in event mode; busy polling on one core would only
  // measure the scheduler).
  pinToCpu0();
  Measurement rawPinned = rawPingPong(rounds, true);
  emitMeasurement("raw_socket", "pingpong_rtt_64B", "us", rawPinned, true);
  double tcpPinned = 0;
  for (const auto& t : transports) {
    if (t == "ucx-poll") continue;
    Result2 r = exchange(t, 0, rounds, true);
    if (t == "tcp") tcpPinned = r.m.stats.median;
    emitMeasurement("transport_" + t, "pingpong_rtt_64B", "us", r.m, true,
                    extras(r, rawPinned.stats.median, t == "tcp" ? 0 : tcpPinned));
  }
  return 0;
}
