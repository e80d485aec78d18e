#include "rpc/store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "rpc/error.h"
#include "tensor/error.h"

namespace distgrad::rpc {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kLong = 10s;  // bounds every wait that should succeed quickly

// Waits (bounded) until `condition` holds; the server's counters change on its own thread.
bool eventually(const std::function<bool()>& condition, std::chrono::milliseconds limit = 5000ms) {
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(1ms);
  }
  return condition();
}

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override { server_ = StoreServer::start("127.0.0.1:0"); }
  std::unique_ptr<StoreClient> client() { return StoreClient::connect(server_->address(), 5000ms); }
  std::unique_ptr<StoreServer> server_;
};

// A raw TCP connection to the server, to send bytes no StoreClient would.
class RawSocket {
 public:
  explicit RawSocket(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  }
  ~RawSocket() {
    if (fd_ >= 0) ::close(fd_);
  }
  void send(const std::vector<uint8_t>& bytes) {
    ASSERT_EQ(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  }
  // True when the server closes the connection within the limit (any error response is drained first).
  bool closedByPeer(std::chrono::milliseconds limit = 5000ms) {
    const auto deadline = Clock::now() + limit;
    uint8_t buffer[4096];
    while (Clock::now() < deadline) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
      if (n == 0 || (n < 0 && errno == ECONNRESET)) return true;
    }
    return false;
  }
  void close() {
    ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

std::vector<uint8_t> u32le(uint32_t v) {
  return {uint8_t(v), uint8_t(v >> 8), uint8_t(v >> 16), uint8_t(v >> 24)};
}
std::vector<uint8_t> concat(std::initializer_list<std::vector<uint8_t>> parts) {
  std::vector<uint8_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}
// A length-prefixed request body.
std::vector<uint8_t> frame(const std::vector<uint8_t>& body) { return concat({u32le(uint32_t(body.size())), body}); }

TEST_F(StoreTest, ReportsTheRealPort) {
  EXPECT_GT(server_->port(), 0);
  EXPECT_EQ(server_->address(), "127.0.0.1:" + std::to_string(server_->port()));
}

TEST_F(StoreTest, SetGet) {
  auto c = client();
  c->set("alpha", std::string_view("one"));
  EXPECT_EQ(c->getString("alpha", kLong), "one");
  c->set("alpha", std::string_view("two"));  // overwrite
  EXPECT_EQ(c->getString("alpha", kLong), "two");
  const std::vector<uint8_t> binary{0, 1, 0, 255, 7};
  c->set("bin", binary);
  EXPECT_EQ(c->get("bin", kLong), binary);
  c->set("empty", std::string_view(""));
  EXPECT_EQ(c->get("empty", kLong).size(), 0u);
  std::vector<uint8_t> big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 31);
  c->set("big", big);
  EXPECT_EQ(c->get("big", kLong), big);
  EXPECT_EQ(c->numKeys(), 4u);
  // Another client sees the same data.
  auto d = client();
  EXPECT_EQ(d->getString("alpha", kLong), "two");
}

TEST_F(StoreTest, GetWaitsForALaterSetFromAnotherClient) {
  auto waiter = client();
  auto setter = client();
  auto result = std::async(std::launch::async, [&] { return waiter->getString("late", kLong); });
  // Only set once the get is parked on the server, so the waiting path is what is exercised.
  ASSERT_TRUE(eventually([&] { return server_->parkedRequests() == 1; }));
  EXPECT_FALSE(setter->check({"late"}));
  setter->set("late", std::string_view("here"));
  ASSERT_EQ(result.wait_for(kLong), std::future_status::ready);
  EXPECT_EQ(result.get(), "here");
  EXPECT_EQ(server_->parkedRequests(), 0u);
}

TEST_F(StoreTest, WaitForSeveralKeysCreatedByAdd) {
  auto waiter = client();
  auto setter = client();
  auto done = std::async(std::launch::async, [&] { waiter->wait({"k1", "k2"}, kLong); });
  ASSERT_TRUE(eventually([&] { return server_->parkedRequests() == 1; }));
  setter->set("k1", std::string_view("x"));
  EXPECT_EQ(done.wait_for(20ms), std::future_status::timeout);  // k2 still missing
  EXPECT_EQ(setter->add("k2", 5), 5);
  ASSERT_EQ(done.wait_for(kLong), std::future_status::ready);
  done.get();
}

TEST_F(StoreTest, GetTimeoutNamesTheKey) {
  auto c = client();
  const auto start = Clock::now();
  try {
    c->get("never-set", 60ms);
    FAIL() << "expected a timeout";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
    EXPECT_NE(std::string(e.what()).find("'never-set'"), std::string::npos) << e.what();
  }
  const auto elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, 60ms);
  EXPECT_LT(elapsed, 5s);
  // The connection is still usable after a timeout.
  c->set("never-set", std::string_view("now"));
  EXPECT_EQ(c->getString("never-set", 0ms), "now");
}

TEST_F(StoreTest, WaitTimeoutNamesOnlyTheMissingKeys) {
  auto c = client();
  c->set("present", std::string_view("1"));
  try {
    c->wait({"present", "absent"}, 30ms);
    FAIL() << "expected a timeout";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'absent'"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("'present'"), std::string::npos) << msg;
  }
  EXPECT_THROW(c->get("absent", 0ms), RpcError);  // zero timeout: answer now
}

TEST_F(StoreTest, AddIsAtomicUnderConcurrentClients) {
  constexpr int kThreads = 8;
  constexpr int kAddsEach = 200;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto c = client();
      for (int i = 0; i < kAddsEach; ++i) seen[t].push_back(c->add("counter", 1));
    });
  }
  for (auto& t : threads) t.join();
  std::set<int64_t> all;
  for (const auto& s : seen) {
    EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));  // one client's adds are ordered
    all.insert(s.begin(), s.end());
  }
  // Every result 1..N exactly once: no two adds observed the same value.
  ASSERT_EQ(all.size(), size_t{kThreads * kAddsEach});
  EXPECT_EQ(*all.begin(), 1);
  EXPECT_EQ(*all.rbegin(), kThreads * kAddsEach);
  auto c = client();
  EXPECT_EQ(c->add("counter", 0), kThreads * kAddsEach);
  EXPECT_EQ(c->getString("counter", kLong), std::to_string(kThreads * kAddsEach));
  EXPECT_EQ(c->add("counter", -kThreads * kAddsEach - 5), -5);
}

TEST_F(StoreTest, AddOnANonIntegerFailsAndTheClientLivesOn) {
  auto c = client();
  c->set("text", std::string_view("abc"));
  try {
    c->add("text", 1);
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFailed);
    EXPECT_NE(std::string(e.what()).find("'text'"), std::string::npos) << e.what();
  }
  c->set("max", std::to_string(INT64_MAX));
  EXPECT_THROW(c->add("max", 1), RpcError);
  EXPECT_EQ(c->add("fresh", 2), 2);
}

TEST_F(StoreTest, CompareSetCheckDelete) {
  auto c = client();
  // Missing key and empty expectation: created.
  EXPECT_EQ(c->compareSet("cas", "", "v1"), "v1");
  // Wrong expectation: unchanged, current value returned.
  EXPECT_EQ(c->compareSet("cas", "nope", "v2"), "v1");
  EXPECT_EQ(c->getString("cas", kLong), "v1");
  // Right expectation: swapped.
  EXPECT_EQ(c->compareSet("cas", "v1", "v2"), "v2");
  EXPECT_EQ(c->getString("cas", kLong), "v2");
  // Missing key with a non-empty expectation: stays missing.
  EXPECT_EQ(c->compareSet("missing", "x", "y"), "");
  EXPECT_FALSE(c->check({"missing"}));
  EXPECT_TRUE(c->check({"cas"}));
  EXPECT_FALSE(c->check({"cas", "missing"}));
  EXPECT_TRUE(c->deleteKey("cas"));
  EXPECT_FALSE(c->deleteKey("cas"));
  EXPECT_FALSE(c->check({"cas"}));
  EXPECT_EQ(c->numKeys(), 0u);
}

TEST_F(StoreTest, ClientArgumentValidation) {
  auto c = client();
  EXPECT_THROW(c->set("", std::string_view("v")), ValueError);
  EXPECT_THROW(c->get("k", -1ms), ValueError);
  EXPECT_THROW(c->wait({}, 1ms), ValueError);
  EXPECT_THROW(c->barrier("b", 0, 1ms), ValueError);
  EXPECT_THROW(StoreClient::connect("no-port", 10ms), ValueError);
}

TEST_F(StoreTest, BarrierOfNClientsIsReusable) {
  constexpr int kClients = 6;
  std::atomic<int> arrivedRound1{0};
  std::atomic<int> arrivedRound2{0};
  std::atomic<int> violations{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&] {
      auto c = client();
      arrivedRound1.fetch_add(1);
      c->barrier("sync", kClients, kLong);
      if (arrivedRound1.load() != kClients) violations.fetch_add(1);  // someone passed early
      arrivedRound2.fetch_add(1);
      c->barrier("sync", kClients, kLong);
      if (arrivedRound2.load() != kClients) violations.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(violations.load(), 0);
  EXPECT_EQ(arrivedRound2.load(), kClients);
}

TEST_F(StoreTest, BarrierTimeoutSaysHowManyArrived) {
  auto c = client();
  try {
    c->barrier("lonely", 3, 30ms);
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
    EXPECT_NE(std::string(e.what()).find("1 of 3"), std::string::npos) << e.what();
  }
}

// Each malformed input closes only that client; an honest client connected before keeps working.
TEST_F(StoreTest, MalformedBytesCloseThatClientAndTheServerLivesOn) {
  auto honest = client();
  honest->set("before", std::string_view("1"));
  const std::vector<std::vector<uint8_t>> attacks = {
      u32le(0xffffffffu),                                          // giant declared request
      u32le(0),                                                    // empty request
      frame({0x7f}),                                               // unknown opcode
      frame({0x01}),                                               // set without fields
      frame(concat({{0x01}, u32le(100), {'a', 'b'}})),             // key longer than the body
      frame(concat({{0x01}, u32le(0), u32le(0)})),                 // empty key
      frame(concat({{0x01}, u32le(1), {'k'}, u32le(0), {0xEE}})),  // trailing garbage
      frame(concat({{0x06}, u32le(0), std::vector<uint8_t>(8, 0)})),          // wait on zero keys
      frame(concat({{0x05}, u32le(0xffffffffu)})),                             // absurd key count
      frame(concat({{0x01}, u32le(5000), std::vector<uint8_t>(5000, 'k'), u32le(0)})),  // key over the limit
  };
  size_t expectedRejections = 0;
  for (size_t i = 0; i < attacks.size(); ++i) {
    RawSocket raw(server_->port());
    raw.send(attacks[i]);
    EXPECT_TRUE(raw.closedByPeer()) << "attack " << i << " did not close the connection";
    ++expectedRejections;
    EXPECT_EQ(honest->getString("before", kLong), "1") << "after attack " << i;
  }
  EXPECT_EQ(server_->rejectedClients(), expectedRejections);
  // A new client works too, and the malformed connections are gone.
  auto late = client();
  late->set("after", std::string_view("2"));
  EXPECT_EQ(honest->getString("after", kLong), "2");
  EXPECT_TRUE(eventually([&] { return server_->clientCount() == 2; }));
}

TEST_F(StoreTest, TruncatedRequestThenHangupIsHarmless) {
  {
    RawSocket raw(server_->port());
    raw.send(concat({u32le(50), {0x01, 0x03, 0x00}}));  // promises 50 bytes, sends 3
    raw.close();
  }
  {
    // A client that hangs up while its get is parked is cleaned up.
    RawSocket raw(server_->port());
    raw.send(frame(concat({{0x02}, u32le(1), {'z'}, u32le(100000), u32le(0)})));
    ASSERT_TRUE(eventually([&] { return server_->parkedRequests() == 1; }));
    raw.close();
  }
  EXPECT_TRUE(eventually([&] { return server_->clientCount() == 0 && server_->parkedRequests() == 0; }));
  auto c = client();
  c->set("z", std::string_view("ok"));
  EXPECT_EQ(c->getString("z", kLong), "ok");
  EXPECT_EQ(server_->rejectedClients(), 0u);
}

TEST(StoreClient, ConnectToADeadAddressFailsWithinTheDeadline) {
  // A port nobody listens on: bind one, read its number, close it.
  int port = 0;
  {
    auto s = StoreServer::start("127.0.0.1:0");
    port = s->port();
  }
  const auto start = Clock::now();
  try {
    StoreClient::connect("127.0.0.1:" + std::to_string(port), 300ms);
    FAIL() << "connected to a closed port";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(port)), std::string::npos) << e.what();
  }
  const auto elapsed = Clock::now() - start;
  EXPECT_GE(elapsed, 300ms);  // it kept retrying until the deadline
  EXPECT_LT(elapsed, 3s);
}

TEST(StoreClient, ConnectRetriesUntilTheServerComesUp) {
  // Reserve a port, free it, and start the server there only after the client began retrying.
  int port = 0;
  {
    auto s = StoreServer::start("127.0.0.1:0");
    port = s->port();
  }
  auto connected = std::async(std::launch::async, [&] {
    return StoreClient::connect("127.0.0.1:" + std::to_string(port), 10000ms);
  });
  EXPECT_EQ(connected.wait_for(30ms), std::future_status::timeout);
  auto server = StoreServer::start("127.0.0.1:" + std::to_string(port));
  ASSERT_EQ(connected.wait_for(kLong), std::future_status::ready);
  auto c = connected.get();
  c->set("k", std::string_view("v"));
  EXPECT_EQ(c->getString("k", kLong), "v");
}

TEST(StoreClient, ServerShutdownDisconnectsAWaitingClient) {
  auto server = StoreServer::start("127.0.0.1:0");
  auto c = StoreClient::connect(server->address(), 5000ms);
  auto result = std::async(std::launch::async, [&] { c->get("never", 60000ms); });
  ASSERT_TRUE(eventually([&] { return server->parkedRequests() == 1; }));
  server.reset();
  ASSERT_EQ(result.wait_for(kLong), std::future_status::ready);
  try {
    result.get();
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDisconnected) << e.what();
  }
  // The client stays unusable with a clear error rather than touching a dead socket.
  try {
    c->set("k", std::string_view("v"));
    FAIL();
  } catch (const RpcError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDisconnected) << e.what();
  }
}

TEST(StoreServer, BindErrors) {
  auto first = StoreServer::start("127.0.0.1:0");
  EXPECT_THROW(StoreServer::start("127.0.0.1:" + std::to_string(first->port())), RpcError);  // in use
  EXPECT_THROW(StoreServer::start("not an address"), ValueError);
  EXPECT_THROW(StoreServer::start("256.256.256.256:0"), RpcError);
}

TEST(StoreServer, SmallLimitsAreEnforced) {
  StoreLimits limits;
  limits.maxValueBytes = 16;
  auto server = StoreServer::start("127.0.0.1:0", limits);
  auto c = StoreClient::connect(server->address(), 5000ms);
  c->set("k", std::string(16, 'v'));
  EXPECT_THROW(c->set("k", std::string(17, 'v')), RpcError);  // the server closes this client
  EXPECT_EQ(server->rejectedClients(), 1u);
  auto d = StoreClient::connect(server->address(), 5000ms);
  EXPECT_EQ(d->getString("k", kLong), std::string(16, 'v'));
}

}  // namespace
}  // namespace distgrad::rpc
