// tcp-only tests: hostile bytes from a raw socket close that connection with an error, and the listener
// keeps serving well-behaved clients afterwards.
#include <arpa/inet.h>
#include <signal.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <future>

#include "rpc/transport/tcp/context.h"
#include "tests/rpc/transport_test_util.h"

namespace distgrad::rpc::transport {
namespace {

using namespace testing;  // NOLINT

// A blocking client socket connected to "127.0.0.1:port".
class RawSocket {
 public:
  explicit RawSocket(const std::string& address) {
    std::string host;
    int port = 0;
    EXPECT_TRUE(tcp::splitHostPort(address, host, port));
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in target{};
    target.sin_family = AF_INET;
    target.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, host.c_str(), &target.sin_addr);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&target), sizeof(target)), 0);
  }
  ~RawSocket() { closeNow(); }
  void write(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (size > 0) {
      ssize_t n = ::send(fd_, p, size, MSG_NOSIGNAL);
      if (n <= 0) return;  // the server may already have closed on us
      p += n;
      size -= static_cast<size_t>(n);
    }
  }
  void closeNow() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

class TcpHostileInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    context_ = createContext("tcp").value();
    auto listening = context_->listen("127.0.0.1:0", [this](std::shared_ptr<Connection> c) {
      std::lock_guard lock(mutex_);
      collectors_.push_back(std::make_unique<Collector>());
      collectors_.back()->start(c);
      connections_.push_back(std::move(c));
      accepted_.notify_all();
    });
    ASSERT_TRUE(listening.ok());
    listener_ = std::move(listening).value();
  }
  void TearDown() override {
    context_->close();
    std::lock_guard lock(mutex_);
    collectors_.clear();
  }
  // Waits for the n-th accepted connection (1-based) and returns its collector.
  Collector& acceptedCollector(size_t n) {
    std::unique_lock lock(mutex_);
    EXPECT_TRUE(accepted_.wait_for(lock, kWait, [&] { return collectors_.size() >= n; }));
    return *collectors_.at(n - 1);
  }
  // Sends `bytes` (then optionally hangs up) and expects that connection to close with an error.
  Error expectClosedAfter(const std::vector<uint8_t>& bytes, bool hangUp, size_t n) {
    RawSocket raw(listener_->address());
    raw.write(bytes.data(), bytes.size());
    if (hangUp) raw.closeNow();
    Collector& collector = acceptedCollector(n);
    EXPECT_TRUE(collector.waitClosed());
    std::lock_guard lock(collector.mutex);
    EXPECT_TRUE(collector.frames.empty());
    return collector.closed.value_or(Error::failed("not closed"));
  }
  // A normal client still gets a frame through the same listener.
  void expectWellBehavedClientServed(size_t n) {
    auto client = createContext("tcp").value();
    std::promise<Result<std::shared_ptr<Connection>>> connected;
    client->connect(listener_->address(),
                    [&](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
    auto connection = connected.get_future().get();
    ASSERT_TRUE(connection.ok());
    Collector atClient;
    atClient.start(connection.value());
    Bytes payload = patternBytes(1000, 3);
    OutgoingFrame frame;
    frame.envelope = envelopeWithIndex(42);
    frame.payloads = {payload.buffer()};
    connection.value()->send(std::move(frame), nullptr);
    Collector& atServer = acceptedCollector(n);
    ASSERT_TRUE(atServer.waitFrames(1));
    std::lock_guard lock(atServer.mutex);
    EXPECT_EQ(indexOf(atServer.frames[0]), 42u);
    EXPECT_EQ(std::memcmp(atServer.frames[0].payloads[0].data, payload.data->data(), 1000), 0);
  }

  static std::vector<uint8_t> bytesOf(const FramePrefix& prefix, const std::vector<uint64_t>& sizes = {}) {
    std::vector<uint8_t> out(sizeof(prefix) + 8 * sizes.size());
    std::memcpy(out.data(), &prefix, sizeof(prefix));
    if (!sizes.empty()) std::memcpy(out.data() + sizeof(prefix), sizes.data(), 8 * sizes.size());
    return out;
  }

  std::unique_ptr<Context> context_;
  std::unique_ptr<Listener> listener_;
  std::mutex mutex_;
  std::condition_variable accepted_;
  std::vector<std::unique_ptr<Collector>> collectors_;
  std::vector<std::shared_ptr<Connection>> connections_;
};

TEST_F(TcpHostileInputTest, BadMagic) {
  FramePrefix prefix;
  prefix.magic = 0x12345678;
  Error error = expectClosedAfter(bytesOf(prefix), false, 1);
  EXPECT_EQ(error.kind, ErrorKind::kFailed);
  EXPECT_NE(error.message.find("bad magic"), std::string::npos) << error.message;
  expectWellBehavedClientServed(2);
}

TEST_F(TcpHostileInputTest, WrongProtocolVersion) {
  FramePrefix prefix;
  prefix.version = 77;
  Error error = expectClosedAfter(bytesOf(prefix), false, 1);
  EXPECT_NE(error.message.find("protocol version 77"), std::string::npos) << error.message;
  expectWellBehavedClientServed(2);
}

TEST_F(TcpHostileInputTest, GiantDeclaredEnvelope) {
  FramePrefix prefix;
  prefix.envelopeBytes = 0xFFFFFFFFu;
  Error error = expectClosedAfter(bytesOf(prefix), false, 1);
  EXPECT_NE(error.message.find("envelope of 4294967295 bytes"), std::string::npos) << error.message;
  expectWellBehavedClientServed(2);
}

TEST_F(TcpHostileInputTest, GiantDeclaredPayloadCountAndBytes) {
  FramePrefix prefix;
  prefix.payloadCount = 0xFFFFFFFFu;
  Error count = expectClosedAfter(bytesOf(prefix), false, 1);
  EXPECT_NE(count.message.find("payloads exceed"), std::string::npos) << count.message;
  FramePrefix bytes;
  bytes.payloadCount = 1;
  bytes.payloadBytes = 1ull << 62;
  Error total = expectClosedAfter(bytesOf(bytes, {1ull << 62}), false, 2);
  EXPECT_NE(total.message.find("payload bytes exceed"), std::string::npos) << total.message;
  expectWellBehavedClientServed(3);
}

TEST_F(TcpHostileInputTest, SizeTableThatDisagreesWithThePrefix) {
  FramePrefix prefix;
  prefix.payloadCount = 2;
  prefix.payloadBytes = 100;
  // Each size fits the limits, but together they overflow the declared total (and 64 bits).
  Error overflow = expectClosedAfter(bytesOf(prefix, {~0ull - 10, 50}), false, 1);
  EXPECT_NE(overflow.message.find("payload 0 declares"), std::string::npos) << overflow.message;
  Error shortSum = expectClosedAfter(bytesOf(prefix, {10, 20}), false, 2);
  EXPECT_NE(shortSum.message.find("sum to 30 bytes"), std::string::npos) << shortSum.message;
  expectWellBehavedClientServed(3);
}

TEST_F(TcpHostileInputTest, TruncatedFrameThenDisconnect) {
  FramePrefix prefix;
  prefix.envelopeBytes = 100;
  prefix.payloadCount = 1;
  prefix.payloadBytes = 5000;
  auto bytes = bytesOf(prefix, {5000});
  bytes.resize(bytes.size() + 100 + paddingTo64(24 + 8 + 100) + 1000, 0xAB);  // 1000 of the 5000 payload bytes
  Error error = expectClosedAfter(bytes, true, 1);
  EXPECT_EQ(error.kind, ErrorKind::kDisconnected);
  EXPECT_NE(error.message.find("in the middle of a frame"), std::string::npos) << error.message;
  expectWellBehavedClientServed(2);
}

TEST_F(TcpHostileInputTest, GarbageStream) {
  std::vector<uint8_t> garbage = *patternBytes(100000, 77).data;
  Error error = expectClosedAfter(garbage, false, 1);
  EXPECT_EQ(error.kind, ErrorKind::kFailed);
  expectWellBehavedClientServed(2);
}

// A write to a peer that has gone raises SIGPIPE, whose default action would kill the process: a tcp
// context leaves it ignored, so the write fails with EPIPE and only that connection closes.
TEST(TcpSignals, AContextLeavesSigpipeIgnoredSoADeadPeerCannotKillTheProcess) {
  auto context = createContext("tcp").value();
  struct sigaction current {};
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &current), 0);
  EXPECT_EQ(current.sa_handler, SIG_IGN);
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  ::close(fds[1]);
  const char byte = 1;
  EXPECT_EQ(::write(fds[0], &byte, 1), -1) << "the process is still alive to see the error";
  EXPECT_EQ(errno, EPIPE);
  ::close(fds[0]);
}

TEST(TcpAddress, ListenerReportsTheRealPortAndMalformedAddressesAreErrors) {
  auto context = createContext("tcp").value();
  auto listener = context->listen("127.0.0.1:0", [](std::shared_ptr<Connection>) {});
  ASSERT_TRUE(listener.ok());
  std::string host;
  int port = 0;
  ASSERT_TRUE(tcp::splitHostPort(listener.value()->address(), host, port));
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_GT(port, 0);
  EXPECT_FALSE(context->listen("127.0.0.1", [](std::shared_ptr<Connection>) {}).ok());
  EXPECT_FALSE(context->listen("not-an-ip:0", [](std::shared_ptr<Connection>) {}).ok());
  std::promise<Result<std::shared_ptr<Connection>>> connected;
  context->connect("127.0.0.1:99999", [&](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
  auto result = connected.get_future().get();
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.error().message.find("127.0.0.1:99999"), std::string::npos);
}

}  // namespace
}  // namespace distgrad::rpc::transport
