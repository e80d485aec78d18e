// Our tcp transport against the raw socket limits, in the same run: a 64 B-envelope frame ping-pong
// between two processes (round trip, us) and a 64 MB-payload frame stream (GB/s, each frame acknowledged
// by a small frame), unpinned and with both processes pinned to CPU 0. Prints the raw figures, ours, and
// the ratios ratio_vs_raw = transport / raw (for time, above 1 is overhead; for bandwidth, below 1 is).
// Usage: bench_transport [rounds=20000] [messages=20]
#include <condition_variable>
#include <cstdlib>
#include <future>
#include <mutex>

#include "bench/socket_bench_util.h"
#include "rpc/transport/transport.h"

namespace distgrad::bench {
namespace {

using namespace distgrad::rpc;             // NOLINT
using namespace distgrad::rpc::transport;  // NOLINT

// The child: listens, reports its port through `portPipe`, answers every frame with a frame carrying the
// same envelope (ping-pong) or a 1-byte envelope (stream ack), and exits when the parent hangs up.
void serveChild(int portPipe, bool echo) {
  auto context = createContext("tcp").value();
  std::promise<void> finished;
  std::shared_ptr<Connection> connection;
  std::vector<uint8_t> sink(kStreamBytes);  // reused destination: the stream measures the wire, not malloc
  auto listener = context
                      ->listen("127.0.0.1:0",
                               [&](std::shared_ptr<Connection> c) {
                                 connection = c;
                                 Connection* raw = c.get();
                                 c->start(
                                     [&](std::span<const uint8_t>, std::span<const uint64_t> sizes)
                                         -> Result<std::vector<PayloadBuffer>> {
                                       std::vector<PayloadBuffer> out;
                                       for (uint64_t s : sizes) {
                                         if (s > sink.size()) return Error::failed("payload larger than the sink");
                                         out.push_back({sink.data(), s, nullptr});
                                       }
                                       return out;
                                     },
                                     [raw, echo](IncomingFrame&& frame) {
                                       OutgoingFrame reply;
                                       reply.envelope = echo ? std::move(frame.envelope) : std::vector<uint8_t>{1};
                                       raw->send(std::move(reply), nullptr);
                                     },
                                     [&](const Error&) { finished.set_value(); });
                               })
                      .value();
  std::string address = listener->address();
  int port = std::atoi(address.substr(address.rfind(':') + 1).c_str());
  check(::write(portPipe, &port, sizeof(port)) == sizeof(port), "write port");
  finished.get_future().wait();
  context->close();
}

struct Client {
  std::unique_ptr<Context> context;
  std::shared_ptr<Connection> connection;
  std::mutex mutex;
  std::condition_variable replied;
  uint64_t replies = 0;

  explicit Client(int port) : context(createContext("tcp").value()) {
    std::promise<Result<std::shared_ptr<Connection>>> connected;
    context->connect("127.0.0.1:" + std::to_string(port),
                     [&](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
    connection = connected.get_future().get().value();
    connection->start(
        nullptr,
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
  ~Client() {
    connection->close();
    context->close();
  }
};

pid_t startServer(bool pinned, bool echo, int& port) {
  int fds[2];
  check(pipe(fds) == 0, "pipe");
  pid_t child = forkChild(pinned, [&] {
    ::close(fds[0]);
    serveChild(fds[1], echo);
  });
  ::close(fds[1]);
  check(::read(fds[0], &port, sizeof(port)) == sizeof(port), "read port");
  ::close(fds[0]);
  return child;
}

Measurement transportPingPong(int rounds, bool pinned) {
  int port = 0;
  pid_t child = startServer(pinned, /*echo=*/true, port);
  std::vector<double> us;
  {
    Client client(port);
    us.reserve(static_cast<size_t>(rounds));
    for (int i = 0; i < rounds; ++i) {
      OutgoingFrame frame;
      frame.envelope.assign(kPingBytes, 1);
      auto t0 = std::chrono::steady_clock::now();
      client.connection->send(std::move(frame), nullptr);
      client.waitReplies(static_cast<uint64_t>(i) + 1);
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  reap(child);
  us.erase(us.begin(), us.begin() + std::min<size_t>(us.size() / 10, 1000));
  return measurementOf(us);
}

Measurement transportStream(int messages, bool pinned) {
  int port = 0;
  pid_t child = startServer(pinned, /*echo=*/false, port);
  std::vector<double> rates;
  {
    Client client(port);
    auto data = std::make_shared<std::vector<uint8_t>>(kStreamBytes, 7);
    for (int i = 0; i < messages + 1; ++i) {
      OutgoingFrame frame;
      frame.envelope.assign(kPingBytes, 2);
      frame.payloads.push_back({data->data(), data->size(), std::shared_ptr<const void>(data, data->data())});
      auto t0 = std::chrono::steady_clock::now();
      client.connection->send(std::move(frame), nullptr);
      client.waitReplies(static_cast<uint64_t>(i) + 1);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (i > 0) rates.push_back(static_cast<double>(kStreamBytes) / s / 1e9);
    }
  }
  reap(child);
  return measurementOf(rates);
}

}  // namespace
}  // namespace distgrad::bench

int main(int argc, char** argv) {
  using namespace distgrad::bench;
  int rounds = argc > 1 ? std::atoi(argv[1]) : 20000;
  int messages = argc > 2 ? std::atoi(argv[2]) : 20;
  // Unpinned first: pinning the parent lasts for the rest of the process.
  for (bool pinned : {false, true}) {
    if (pinned) pinToCpu0();  // threads created from here on (our loop threads) inherit it
    Measurement rawRtt = rawPingPong(rounds, pinned);
    Measurement ourRtt = transportPingPong(rounds, pinned);
    Measurement rawBw = rawStream(messages, pinned);
    Measurement ourBw = transportStream(messages, pinned);
    emitMeasurement("raw_socket", "pingpong_rtt_64B", "us", rawRtt, pinned);
    emitMeasurement("transport_tcp", "pingpong_rtt_64B", "us", ourRtt, pinned,
                    {{"raw_median", number(rawRtt.stats.median)},
                     {"ratio_vs_raw", number(ourRtt.stats.median / rawRtt.stats.median)}});
    emitMeasurement("raw_socket", "stream_64MB", "GB/s", rawBw, pinned);
    emitMeasurement("transport_tcp", "stream_64MB", "GB/s", ourBw, pinned,
                    {{"raw_median", number(rawBw.stats.median)},
                     {"ratio_vs_raw", number(ourBw.stats.median / rawBw.stats.median)}});
  }
  return 0;
}
