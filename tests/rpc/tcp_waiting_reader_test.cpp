// Note [Waiting reader] (rpc/transport/tcp/connection.cpp): a thread about to block for an answer reads its
// tcp connection itself. These tests hold the contract of Connection::beginWaitingRead / readWhileWaiting /
// endWaitingRead: frames read by the waiter reach onFrame on its thread, in order with the loop's; one
// reader at a time, never the loop thread; the window bounds the wait; a close, a hang-up or malformed bytes
// end the wait and close the connection once, with the error.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <thread>

#include "rpc/transport/tcp/context.h"
#include "tests/rpc/transport_test_util.h"

namespace distgrad::rpc::transport {
namespace {

using namespace testing;  // NOLINT
using std::chrono::milliseconds;

// What one end received: each frame's index and the thread onFrame ran on.
struct ThreadRecorder {
  struct State {
    std::mutex mutex;
    std::condition_variable changed;
    std::vector<std::pair<uint64_t, std::thread::id>> frames;
    std::optional<Error> closed;
    int closeCount = 0;
  };
  std::shared_ptr<State> state = std::make_shared<State>();

  void start(const std::shared_ptr<Connection>& connection) {
    connection->start(
        nullptr,
        [s = state](IncomingFrame&& frame) {
          std::lock_guard lock(s->mutex);
          s->frames.emplace_back(indexOf(frame), std::this_thread::get_id());
          s->changed.notify_all();
        },
        [s = state](const Error& error) {
          std::lock_guard lock(s->mutex);
          s->closed = error;
          ++s->closeCount;
          s->changed.notify_all();
        });
  }
  size_t count() const {
    std::lock_guard lock(state->mutex);
    return state->frames.size();
  }
  bool waitFrames(size_t n) const {
    std::unique_lock lock(state->mutex);
    return state->changed.wait_for(lock, kWait, [&] { return state->frames.size() >= n; });
  }
  bool waitClosed() const {
    std::unique_lock lock(state->mutex);
    return state->changed.wait_for(lock, kWait, [&] { return state->closed.has_value(); });
  }
};

void sendIndex(Connection& connection, uint64_t index) {
  OutgoingFrame frame;
  frame.envelope = envelopeWithIndex(index);
  connection.send(std::move(frame), nullptr);
}

// A tcp client connection and the server's end of it, each on its own Context (so each has its own loop).
class TcpWaitingReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = createContext("tcp").value();
    std::promise<std::shared_ptr<Connection>> accepted;
    auto listening = server_->listen("127.0.0.1:0", [&](std::shared_ptr<Connection> c) { accepted.set_value(c); });
    ASSERT_TRUE(listening.ok());
    listener_ = std::move(listening).value();
    client_ = createContext("tcp").value();
    std::promise<Result<std::shared_ptr<Connection>>> connected;
    client_->connect(listener_->address(),
                     [&](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
    auto connection = connected.get_future().get();
    ASSERT_TRUE(connection.ok());
    atClient_ = connection.value();
    atServer_ = accepted.get_future().get();
    fromServer_.start(atClient_);
    fromClient_.start(atServer_);
  }
  void TearDown() override {
    client_->close();
    server_->close();
  }
  // True once the client's connection is reading (start() runs on the loop): a waiting read can begin.
  bool beginOnceReading() {
    for (int i = 0; i < 2000; ++i) {
      if (atClient_->beginWaitingRead()) return true;
      std::this_thread::sleep_for(milliseconds(1));
    }
    return false;
  }

  // The client's thread waits (a 60 s window, for nothing) while `closing` (either end) is closed 50 ms in:
  // the wait must end early, and the client's connection report its close.
  void waitWhileClosing(Connection& closing) {
    auto closer = std::async(std::launch::async, [&] {
      std::this_thread::sleep_for(milliseconds(50));
      closing.close();
    });
    const auto t0 = std::chrono::steady_clock::now();
    atClient_->readWhileWaiting([] { return false; }, std::chrono::seconds(60));
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20)) << "the close must end the wait";
    atClient_->endWaitingRead();
    closer.get();
    ASSERT_TRUE(fromServer_.waitClosed());
    std::this_thread::sleep_for(milliseconds(20));  // a second close report would show by now
  }

  std::unique_ptr<Context> server_, client_;
  std::unique_ptr<Listener> listener_;
  std::shared_ptr<Connection> atClient_, atServer_;
  ThreadRecorder fromServer_, fromClient_;
};

TEST_F(TcpWaitingReaderTest, TheWaiterGetsFramesOnItsThreadThenTheLoopDoesInTheSameOrder) {
  ASSERT_TRUE(beginOnceReading());
  for (uint64_t i = 0; i < 10; ++i) sendIndex(*atServer_, i);
  atClient_->readWhileWaiting([&] { return fromServer_.count() >= 10; }, std::chrono::seconds(30));
  atClient_->endWaitingRead();
  ASSERT_EQ(fromServer_.count(), 10u);
  for (uint64_t i = 10; i < 20; ++i) sendIndex(*atServer_, i);
  ASSERT_TRUE(fromServer_.waitFrames(20));
  std::lock_guard lock(fromServer_.state->mutex);
  const auto& frames = fromServer_.state->frames;
  for (uint64_t i = 0; i < 20; ++i) {
    EXPECT_EQ(frames[i].first, i);
    if (i < 10) {
      EXPECT_EQ(frames[i].second, std::this_thread::get_id()) << "frame " << i;
    } else {
      EXPECT_NE(frames[i].second, std::this_thread::get_id()) << "frame " << i << " (the loop reads again)";
    }
  }
  EXPECT_FALSE(fromServer_.state->closed.has_value());
}

TEST_F(TcpWaitingReaderTest, BytesThatCameAfterTheWaitEndedWakeTheLoop) {
  // The waiter stops at its own frame; what is already in the socket behind it is the loop's to read.
  ASSERT_TRUE(beginOnceReading());
  sendIndex(*atServer_, 0);
  atClient_->readWhileWaiting([&] { return fromServer_.count() >= 1; }, std::chrono::seconds(30));
  for (uint64_t i = 1; i < 50; ++i) sendIndex(*atServer_, i);
  std::this_thread::sleep_for(milliseconds(20));  // let them land in the socket while it is out of the read set
  atClient_->endWaitingRead();
  ASSERT_TRUE(fromServer_.waitFrames(50));
  std::lock_guard lock(fromServer_.state->mutex);
  for (uint64_t i = 0; i < 50; ++i) EXPECT_EQ(fromServer_.state->frames[i].first, i);
}

// Note [Resume after letting go]: a reader resumes the socket in the loop's read set after it let go, unless
// a new reader paused it meanwhile (which then resumes it). Threads taking the reader role in turn while the
// peer sends must leave the socket to the loop in the end: every frame arrives, in order.
TEST_F(TcpWaitingReaderTest, ReadersTakingTurnsLeaveTheSocketToTheLoop) {
  ASSERT_TRUE(beginOnceReading());
  atClient_->endWaitingRead();
  constexpr uint64_t kFrames = 3000;
  auto sender = std::async(std::launch::async, [&] {
    for (uint64_t i = 0; i < kFrames; ++i) sendIndex(*atServer_, i);
  });
  std::vector<std::thread> readers;
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&] {
      for (int i = 0; i < 1000; ++i) {
        if (!atClient_->beginWaitingRead()) continue;
        atClient_->readWhileWaiting([] { return false; }, std::chrono::microseconds(20));
        atClient_->endWaitingRead();
      }
    });
  }
  for (auto& reader : readers) reader.join();
  sender.get();
  // Readers are gone: what comes now is the loop's to read.
  for (uint64_t i = kFrames; i < kFrames + 10; ++i) sendIndex(*atServer_, i);
  ASSERT_TRUE(fromServer_.waitFrames(kFrames + 10)) << "frames left in a socket nobody resumed";
  std::lock_guard lock(fromServer_.state->mutex);
  for (uint64_t i = 0; i < kFrames + 10; ++i) ASSERT_EQ(fromServer_.state->frames[i].first, i);
}

TEST_F(TcpWaitingReaderTest, OneReaderAtATimeAndNeverTheLoopThread) {
  ASSERT_TRUE(beginOnceReading());
  std::async(std::launch::async, [&] { EXPECT_FALSE(atClient_->beginWaitingRead()) << "a second reader"; }).get();
  atClient_->endWaitingRead();
  std::promise<bool> onLoop;
  client_->defer([&] { onLoop.set_value(atClient_->beginWaitingRead()); });
  EXPECT_FALSE(onLoop.get_future().get()) << "the loop thread must not wait on its own connection";
  std::async(std::launch::async, [&] {
    ASSERT_TRUE(atClient_->beginWaitingRead()) << "free again once the first reader let go";
    atClient_->endWaitingRead();
  }).get();
  // inproc hands frames over by reference: nothing to read, so no waiting reads.
  auto inproc = createContext("inproc").value();
  std::promise<std::shared_ptr<Connection>> accepted;
  auto listener = inproc->listen("waiting-reader", [&](std::shared_ptr<Connection> c) { accepted.set_value(c); });
  ASSERT_TRUE(listener.ok());
  std::promise<Result<std::shared_ptr<Connection>>> connected;
  inproc->connect("waiting-reader", [&](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
  auto connection = connected.get_future().get();
  ASSERT_TRUE(connection.ok());
  EXPECT_FALSE(connection.value()->beginWaitingRead());
  inproc->close();
}

TEST_F(TcpWaitingReaderTest, TheWindowBoundsTheWait) {
  ASSERT_TRUE(beginOnceReading());
  const auto t0 = std::chrono::steady_clock::now();
  atClient_->readWhileWaiting([] { return false; }, milliseconds(50));
  const auto waited = std::chrono::steady_clock::now() - t0;
  atClient_->endWaitingRead();
  EXPECT_GE(waited, milliseconds(50));
  EXPECT_LT(waited, std::chrono::seconds(10));
  sendIndex(*atServer_, 7);
  ASSERT_TRUE(fromServer_.waitFrames(1));
  std::lock_guard lock(fromServer_.state->mutex);
  EXPECT_EQ(fromServer_.state->frames[0].first, 7u);
}

TEST_F(TcpWaitingReaderTest, ClosingTheConnectionWakesTheWaiter) {
  ASSERT_TRUE(beginOnceReading());
  waitWhileClosing(*atClient_);
  std::lock_guard lock(fromServer_.state->mutex);
  EXPECT_EQ(fromServer_.state->closeCount, 1);
  EXPECT_EQ(fromServer_.state->closed->kind, ErrorKind::kDisconnected);
  EXPECT_FALSE(atClient_->beginWaitingRead()) << "a closed connection has nothing to read";
}

TEST_F(TcpWaitingReaderTest, APeerHangingUpEndsTheWaitAndClosesTheConnectionOnce) {
  ASSERT_TRUE(beginOnceReading());
  sendIndex(*atServer_, 1);
  waitWhileClosing(*atServer_);
  std::lock_guard lock(fromServer_.state->mutex);
  ASSERT_EQ(fromServer_.state->frames.size(), 1u) << "the frame before the hang-up was delivered";
  EXPECT_EQ(fromServer_.state->closeCount, 1);
  EXPECT_EQ(fromServer_.state->closed->kind, ErrorKind::kDisconnected);
  EXPECT_NE(fromServer_.state->closed->message.find("closed the connection"), std::string::npos)
      << fromServer_.state->closed->message;
}

TEST(TcpWaitingReader, MalformedBytesReadByTheWaiterCloseTheConnectionWithTheReason) {
  auto server = createContext("tcp").value();
  std::promise<std::shared_ptr<Connection>> accepted;
  auto listening = server->listen("127.0.0.1:0", [&](std::shared_ptr<Connection> c) { accepted.set_value(c); });
  ASSERT_TRUE(listening.ok());
  std::string host;
  int port = 0;
  ASSERT_TRUE(tcp::splitHostPort(listening.value()->address(), host, port));
  const int raw = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &target.sin_addr);
  ASSERT_EQ(::connect(raw, reinterpret_cast<sockaddr*>(&target), sizeof(target)), 0);
  auto connection = accepted.get_future().get();
  ThreadRecorder recorder;
  recorder.start(connection);
  bool reading = false;
  for (int i = 0; i < 2000 && !reading; ++i) {
    reading = connection->beginWaitingRead();
    if (!reading) std::this_thread::sleep_for(milliseconds(1));
  }
  ASSERT_TRUE(reading);
  FramePrefix prefix;
  prefix.magic = 0xBADBAD00;
  ASSERT_EQ(::send(raw, &prefix, sizeof(prefix), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(prefix)));
  const auto t0 = std::chrono::steady_clock::now();
  connection->readWhileWaiting([] { return false; }, std::chrono::seconds(60));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20)) << "the bad frame must end the wait";
  connection->endWaitingRead();
  ASSERT_TRUE(recorder.waitClosed());
  {
    std::lock_guard lock(recorder.state->mutex);
    EXPECT_TRUE(recorder.state->frames.empty());
    EXPECT_EQ(recorder.state->closed->kind, ErrorKind::kFailed);
    EXPECT_NE(recorder.state->closed->message.find("magic"), std::string::npos) << recorder.state->closed->message;
  }
  ::close(raw);
  server->close();
}

}  // namespace
}  // namespace distgrad::rpc::transport
