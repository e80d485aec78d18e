// The ucx transport's wire validation: a raw ucp client (a client-server endpoint of its own on the
// process's worker) sends hand-made active messages to a ucx listener, and each malformed one must close that
// connection with a `malformed frame:` Error naming the problem, without touching the process. Also: the
// process's one ucp worker shared by its Contexts, and the lanes ucp picks on one host.
#ifdef DG_HAVE_UCX

#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "rpc/transport/ucx/context.h"
#include "tests/rpc/transport_test_util.h"
#include "tests/transport_params.h"

namespace distgrad::rpc::transport::ucx {
namespace {

using namespace testing;  // NOLINT

// A bare ucp endpoint driven by hand, for sending what our transport never would. It lives on the
// process's one worker (a second worker in the process is what Note [One worker per process] avoids), so
// every ucp call runs as a task on the ucx loop, which also progresses it; the server's goodbye to it
// reaches our active-message handlers, which drop messages for endpoints they do not know.
class RawUcpClient {
 public:
  explicit RawUcpClient(const std::string& address) : loop_(UcxLoop::create(ContextOptions{}).value()) {
    sockaddr_storage target{};
    socklen_t length = 0;
    std::string error;
    EXPECT_TRUE(resolveAddress(address, target, length, error)) << error;
    ucp_ep_params_t epParams{};
    epParams.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLER |
                          UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    epParams.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    epParams.sockaddr.addr = reinterpret_cast<const sockaddr*>(&target);
    epParams.sockaddr.addrlen = length;
    epParams.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    epParams.err_handler.cb = [](void*, ucp_ep_h, ucs_status_t) {};  // the server closing on us is expected
    EXPECT_EQ(onLoop([&] { return ucp_ep_create(loop_->workerFromLoop(), &epParams, &ep_); }), UCS_OK);
  }
  ~RawUcpClient() {
    if (ep_ != nullptr) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;
      complete(param, [this](const ucp_request_param_t* p) { return ucp_ep_close_nbx(ep_, p); });
    }
    loop_->shutdown();
  }

  // Sends one active message and waits until ucp completed it.
  void send(AmId id, const std::vector<uint8_t>& header, const std::vector<uint8_t>& data) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    complete(param, [&](const ucp_request_param_t* p) {
      return ucp_am_send_nbx(ep_, static_cast<unsigned>(id), header.empty() ? nullptr : header.data(), header.size(),
                             data.empty() ? nullptr : data.data(), data.size(), p);
    });
  }

 private:
  template <typename F>
  std::invoke_result_t<F> onLoop(F fn) {
    std::packaged_task<std::invoke_result_t<F>()> task(std::move(fn));
    auto result = task.get_future();
    if (!loop_->post([&task] { task(); })) {
      ADD_FAILURE() << "the raw client's loop refused a task";
      if constexpr (std::is_void_v<std::invoke_result_t<F>>) {
        return;
      } else {
        return {};
      }
    }
    return result.get();
  }
  // Starts a ucp operation on the loop with a completion callback and waits for its completion (the loop
  // progresses the worker). The callback owns what it signals: it may run after a failed wait.
  template <typename Start>
  void complete(ucp_request_param_t param, Start start) {
    using Signal = std::shared_ptr<std::promise<void>>;
    auto signal = std::make_shared<std::promise<void>>();
    auto completed = signal->get_future();
    onLoop([&] {
      Signal* owned = std::make_unique<Signal>(signal).release();  // user_data of a C callback
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.user_data = owned;
      param.cb.send = [](void* request, ucs_status_t, void* user) {
        ucp_request_free(request);
        std::unique_ptr<Signal> done(static_cast<Signal*>(user));
        (*done)->set_value();
      };
      ucs_status_ptr_t request = start(&param);
      if (request == nullptr || UCS_PTR_IS_ERR(request)) {  // done already: no callback
        std::unique_ptr<Signal> done(owned);
        (*done)->set_value();
      }
    });
    EXPECT_EQ(completed.wait_for(kWait), std::future_status::ready) << "a ucp operation of the raw client";
  }

  std::shared_ptr<UcxLoop> loop_;
  ucp_ep_h ep_ = nullptr;
};

std::vector<uint8_t> head(FramePrefix prefix, const std::vector<uint64_t>& sizes, size_t envelopeBytes) {
  std::vector<uint8_t> out(sizeof(FramePrefix) + 8 * sizes.size() + envelopeBytes, 0x5A);
  std::memcpy(out.data(), &prefix, sizeof(prefix));
  if (!sizes.empty()) std::memcpy(out.data() + sizeof(prefix), sizes.data(), 8 * sizes.size());
  return out;
}

// A raw client on a fresh listener of `server`, with its hello sent and the server's end of the connection
// accepted and started into `atServer`. open() is false (the failure recorded) when a step fails.
struct RawSession {
  std::promise<std::shared_ptr<Connection>> accepted;
  std::unique_ptr<Listener> listener;
  std::unique_ptr<RawUcpClient> client;
  Collector atServer;

  bool open(Context& server) {
    auto listening =
        server.listen("127.0.0.1:0", [this](std::shared_ptr<Connection> c) { accepted.set_value(std::move(c)); });
    if (!listening.ok()) {
      ADD_FAILURE() << "listen: " << listening.error().message;
      return false;
    }
    listener = std::move(listening).value();
    client = std::make_unique<RawUcpClient>(listener->address());
    client->send(AmId::kHello, {}, {});
    auto acceptedFuture = accepted.get_future();
    if (acceptedFuture.wait_for(kWait) != std::future_status::ready) {
      ADD_FAILURE() << "the ucx listener did not accept the raw client";
      return false;
    }
    atServer.start(acceptedFuture.get());
    return true;
  }
};

struct Case {
  const char* name;
  AmId id;
  std::vector<uint8_t> header;
  std::vector<uint8_t> data;
  const char* expected;  // in the close Error's message
};

std::vector<Case> malformedCases() {
  std::vector<Case> cases;
  FramePrefix ok;
  ok.envelopeBytes = 16;
  cases.push_back({"a header shorter than the prefix",
                   AmId::kFrame,
                   std::vector<uint8_t>(10, 1),
                   {},
                   "shorter than the 24-byte prefix"});
  FramePrefix badMagic = ok;
  badMagic.magic = 0x12345678;
  cases.push_back({"a bad magic", AmId::kFrame, head(badMagic, {}, 16), {}, "bad magic"});
  FramePrefix badVersion = ok;
  badVersion.version = kProtocolVersion + 1;
  cases.push_back({"another protocol version", AmId::kFrame, head(badVersion, {}, 16), {}, "protocol version"});
  cases.push_back(
      {"a header shorter than its envelope", AmId::kFrame, head(ok, {}, 8), {}, "where the prefix declares"});
  FramePrefix onePayload = ok;
  onePayload.payloadCount = 1;
  onePayload.payloadBytes = 100;
  cases.push_back({"data longer than the declared payloads", AmId::kFrame, head(onePayload, {100}, 16),
                   std::vector<uint8_t>(150, 7), "payload bytes where the prefix declares"});
  cases.push_back({"sizes that do not sum to the total", AmId::kFrame, head(onePayload, {60}, 16),
                   std::vector<uint8_t>(100, 7), "payload sizes sum to 60"});
  cases.push_back({"a payload larger than the total", AmId::kFrame, head(onePayload, {1000}, 16),
                   std::vector<uint8_t>(100, 7), "more than the frame's total"});
  cases.push_back({"payloads without a head",
                   AmId::kPayloads,
                   {},
                   std::vector<uint8_t>(64, 7),
                   "payload data without a frame head"});
  cases.push_back({"a head message whose header is not a prefix", AmId::kHead, head(ok, {}, 4),
                   std::vector<uint8_t>(16, 1), "a frame head of 16 bytes"});
  return cases;
}

TEST(UcxWire, MalformedActiveMessagesCloseTheConnectionWithANamedError) {
  if (!ucxUnavailableReason().empty()) GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
  auto server = createContext("ucx").value();
  for (const auto& c : malformedCases()) {
    SCOPED_TRACE(c.name);
    RawSession session;
    ASSERT_TRUE(session.open(*server));
    session.client->send(c.id, c.header, c.data);
    ASSERT_TRUE(session.atServer.waitClosed());
    auto& atServer = session.atServer;
    std::lock_guard lock(atServer.mutex);
    EXPECT_TRUE(atServer.frames.empty());
    EXPECT_EQ(atServer.closed->kind, ErrorKind::kFailed);
    EXPECT_NE(atServer.closed->message.find("malformed frame"), std::string::npos) << atServer.closed->message;
    EXPECT_NE(atServer.closed->message.find(c.expected), std::string::npos) << atServer.closed->message;
  }
  // The context is still serving: a well-formed frame from a fresh raw client arrives.
  RawSession session;
  ASSERT_TRUE(session.open(*server));
  FramePrefix prefix;
  prefix.envelopeBytes = 16;
  prefix.payloadCount = 2;
  prefix.payloadBytes = 5;
  session.client->send(AmId::kFrame, head(prefix, {2, 3}, 16), {1, 2, 3, 4, 5});
  ASSERT_TRUE(session.atServer.waitFrames(1));
  auto& atServer = session.atServer;
  std::lock_guard lock(atServer.mutex);
  ASSERT_EQ(atServer.frames[0].payloads.size(), 2u);
  EXPECT_EQ(std::memcmp(atServer.frames[0].payloads[1].data, "\x03\x04\x05", 3), 0);
  EXPECT_EQ(atServer.frames[0].envelope.size(), 16u);
}

// Ids this transport does not use are dropped by ucp (with a warning); the connection stays up and the
// frames around them arrive in order.
TEST(UcxWire, UnknownActiveMessageIdsAreDroppedAndTheConnectionStaysUp) {
  if (!ucxUnavailableReason().empty()) GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
  auto server = createContext("ucx").value();
  RawSession session;
  ASSERT_TRUE(session.open(*server));
  FramePrefix prefix;
  prefix.envelopeBytes = 16;
  session.client->send(AmId::kFrame, head(prefix, {}, 16), {});
  session.client->send(static_cast<AmId>(9), {1, 2, 3}, {});
  session.client->send(static_cast<AmId>(200), {1, 2, 3}, {4});
  prefix.flags = 7;
  session.client->send(AmId::kFrame, head(prefix, {}, 16), {});
  ASSERT_TRUE(session.atServer.waitFrames(2));
  auto& atServer = session.atServer;
  std::lock_guard lock(atServer.mutex);
  EXPECT_FALSE(atServer.closed.has_value());
  EXPECT_EQ(atServer.frames.size(), 2u);
  EXPECT_EQ(atServer.frames[0].flags, 0);
  EXPECT_EQ(atServer.frames[1].flags, 7);
}

// A head above the worker's maximum AM header travels as kHead + kPayloads: envelopes of 9 KB and 1 MB (the
// latter by rendezvous), with and without payloads, arrive intact and in order with the small frames
// around them.
TEST(UcxWire, HeadsLargerThanAnActiveMessageHeaderTakeTheTwoMessagePath) {
  if (!ucxUnavailableReason().empty()) GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
  auto server = createContext("ucx").value();
  auto client = createContext("ucx").value();
  std::promise<std::shared_ptr<Connection>> accepted;
  auto listener =
      server->listen("127.0.0.1:0", [&](std::shared_ptr<Connection> c) { accepted.set_value(std::move(c)); });
  ASSERT_TRUE(listener.ok());
  std::promise<Result<std::shared_ptr<Connection>>> connected;
  client->connect(listener.value()->address(),
                  [&](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
  auto connection = connected.get_future().get().value();
  Collector atServer;
  atServer.start(accepted.get_future().get());
  Collector atClient;
  atClient.start(connection);
  const std::vector<size_t> envelopes = {16, 9000, 1 << 20, 16, 9000};
  Bytes payload = patternBytes(300000, 4);
  SendTracker sends(envelopes.size());
  for (size_t i = 0; i < envelopes.size(); ++i) {
    OutgoingFrame frame;
    frame.flags = static_cast<uint16_t>(i);
    frame.envelope = envelopeWithIndex(i, envelopes[i]);
    if (i % 2 == 0) frame.payloads = {payload.buffer(), patternBytes(0, 1).buffer()};
    connection->send(std::move(frame), sends.callback(i));
  }
  ASSERT_TRUE(atServer.waitFrames(envelopes.size()));
  ASSERT_TRUE(sends.waitDone(envelopes.size()));
  EXPECT_EQ(sends.ok, envelopes.size());
  std::lock_guard lock(atServer.mutex);
  for (size_t i = 0; i < envelopes.size(); ++i) {
    const auto& f = atServer.frames[i];
    EXPECT_EQ(f.flags, i);
    EXPECT_EQ(f.envelope, envelopeWithIndex(i, envelopes[i]));
    ASSERT_EQ(f.payloads.size(), i % 2 == 0 ? 2u : 0u);
    if (i % 2 == 0) {
      ASSERT_EQ(f.payloads[0].size, payload.data->size());
      EXPECT_EQ(std::memcmp(f.payloads[0].data, payload.data->data(), payload.data->size()), 0);
      EXPECT_EQ(f.payloads[1].size, 0u);
    }
  }
}

// A connection from `client` to `address` and its end accepted into `accepted`, neither started; nulls (the
// failure recorded) when connecting fails.
std::pair<std::shared_ptr<Connection>, std::shared_ptr<Connection>> connectUnstarted(
    Context& client, const std::string& address, std::promise<std::shared_ptr<Connection>>& accepted) {
  std::promise<Result<std::shared_ptr<Connection>>> connected;
  client.connect(address, [&](Result<std::shared_ptr<Connection>> r) { connected.set_value(std::move(r)); });
  auto connection = connected.get_future().get();
  EXPECT_TRUE(connection.ok()) << connection.error().message;
  if (!connection.ok()) return {};
  return {connection.value(), accepted.get_future().get()};
}

// A connection from `client` to `listener`, started on both ends into the two collectors.
std::shared_ptr<Connection> connectPair(Context& client, const std::string& address, Collector& atClient,
                                        Collector& atServer, std::promise<std::shared_ptr<Connection>>& accepted) {
  auto [connection, serverEnd] = connectUnstarted(client, address, accepted);
  if (!connection) return nullptr;
  atClient.start(connection);
  atServer.start(serverEnd);
  return connection;
}

// A listener on a fresh port of `server` whose first accepted connection goes to `accepted`; null (the
// failure recorded) when listen fails.
std::unique_ptr<Listener> listenOnce(Context& server, std::promise<std::shared_ptr<Connection>>& accepted) {
  auto listening =
      server.listen("127.0.0.1:0", [&accepted](std::shared_ptr<Connection> c) { accepted.set_value(std::move(c)); });
  if (!listening.ok()) {
    ADD_FAILURE() << "listen: " << listening.error().message;
    return nullptr;
  }
  return std::move(listening).value();
}

bool exchanges(Connection& connection, Collector& atPeer, size_t index) {
  OutgoingFrame frame;
  frame.envelope = envelopeWithIndex(index);
  frame.payloads = {patternBytes(1000, static_cast<uint32_t>(index)).buffer()};
  connection.send(std::move(frame), nullptr);
  if (!atPeer.waitFrames(index + 1)) return false;
  std::lock_guard lock(atPeer.mutex);
  return indexOf(atPeer.frames[index]) == index;
}

// Note [One worker per process]: the ucx Contexts of a process share one loop thread; closing one closes
// only its own listeners and connections (its peers see them close), the others keep exchanging frames
// and accepting, and once the last one closed a new Context starts a fresh worker.
TEST(UcxWorker, ContextsOfAProcessShareOneLoopAndCloseOnlyTheirOwn) {
  if (!ucxUnavailableReason().empty()) GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
  auto server = createContext("ucx").value();
  auto leaving = createContext("ucx").value();
  auto staying = createContext("ucx").value();
  auto loopThread = [](Context& context) {
    std::promise<pid_t> id;  // the kernel's thread id: pthread ids are reused as soon as a thread ends
    context.defer([&id] { id.set_value(::gettid()); });
    return id.get_future().get();
  };
  const pid_t loop = loopThread(*server);
  EXPECT_EQ(loopThread(*leaving), loop);
  EXPECT_EQ(loopThread(*staying), loop);
  EXPECT_NE(loop, ::gettid());

  std::promise<std::shared_ptr<Connection>> acceptedFirst;
  std::promise<std::shared_ptr<Connection>> acceptedSecond;
  std::promise<std::shared_ptr<Connection>> acceptedThird;
  std::atomic<int> accepts{0};
  auto listener = server->listen("127.0.0.1:0", [&](std::shared_ptr<Connection> c) {
    int n = accepts.fetch_add(1);
    (n == 0 ? acceptedFirst : n == 1 ? acceptedSecond : acceptedThird).set_value(std::move(c));
  });
  ASSERT_TRUE(listener.ok());
  const std::string address = listener.value()->address();
  Collector leavingEnd, leavingPeer, stayingEnd, stayingPeer;
  auto toLeave = connectPair(*leaving, address, leavingEnd, leavingPeer, acceptedFirst);
  auto toStay = connectPair(*staying, address, stayingEnd, stayingPeer, acceptedSecond);
  ASSERT_TRUE(toLeave && toStay);
  EXPECT_TRUE(exchanges(*toLeave, leavingPeer, 0));
  EXPECT_TRUE(exchanges(*toStay, stayingPeer, 0));

  leaving->close();
  ASSERT_TRUE(leavingEnd.waitClosed());
  ASSERT_TRUE(leavingPeer.waitClosed()) << "the server's end of the closed Context's connection";
  EXPECT_TRUE(exchanges(*toStay, stayingPeer, 1));
  {
    std::lock_guard lock(stayingEnd.mutex);
    EXPECT_FALSE(stayingEnd.closed.has_value());
  }
  Collector laterEnd, laterPeer;
  auto later = connectPair(*staying, address, laterEnd, laterPeer, acceptedThird);
  ASSERT_TRUE(later);
  EXPECT_TRUE(exchanges(*later, laterPeer, 0));

  staying->close();
  server->close();
  ASSERT_TRUE(stayingPeer.waitClosed());
  auto fresh = createContext("ucx").value();
  EXPECT_NE(loopThread(*fresh), loop) << "a new worker (and thread) after the last Context closed";
}

// A busy-polling Context joining a worker asleep on behalf of another Context wakes it into spinning (its
// posts do not wake the loop), and once it closed the loop sleeps again and still hears the other's posts.
TEST(UcxWorker, ABusyPollingContextJoiningAndLeavingASleepingWorker) {
  if (!ucxUnavailableReason().empty()) GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
  auto sleeping = createContext("ucx").value();
  std::promise<void> idle;  // the loop ran this and then went to sleep: nothing else is queued
  sleeping->defer([&idle] { idle.set_value(); });
  idle.get_future().get();
  ContextOptions spin;
  spin.ucxBusyPoll = true;
  auto polling = createContext("ucx", spin).value();
  std::promise<std::shared_ptr<Connection>> accepted;
  auto listener = listenOnce(*polling, accepted);
  ASSERT_TRUE(listener);
  Collector atClient, atServer;
  auto connection = connectPair(*sleeping, listener->address(), atClient, atServer, accepted);
  ASSERT_TRUE(connection);
  EXPECT_TRUE(exchanges(*connection, atServer, 0));
  polling->close();
  ASSERT_TRUE(atClient.waitClosed());
  std::promise<void> ran;
  sleeping->defer([&ran] { ran.set_value(); });
  EXPECT_EQ(ran.get_future().wait_for(kWait), std::future_status::ready) << "the loop slept through a post";
}

// Note [Driving threads]: a thread that waits for an answer drives the process's worker itself, so the
// answer reaches onFrame on that thread (in order, the loop thread asleep meanwhile), with the loop asleep
// (event mode) or spinning (busy polling, where the loop thread yields to it); and a frame marked fromSender
// is issued by its sending thread while the loop thread sleeps.
void expectWaitingThreadsDrive(bool busyPoll) {
  using namespace std::chrono_literals;  // NOLINT
  ContextOptions options;
  options.ucxBusyPoll = busyPoll;
  auto server = createContext("ucx").value();
  auto client = createContext("ucx", options).value();
  std::promise<std::shared_ptr<Connection>> accepted;
  auto listener = listenOnce(*server, accepted);
  ASSERT_TRUE(listener);
  auto [connection, serverEnd] = connectUnstarted(*client, listener->address(), accepted);
  ASSERT_TRUE(connection);
  // The server answers every frame with its envelope, from its frame handler.
  Connection* echo = serverEnd.get();  // alive while its callbacks are (they go when it closes)
  serverEnd->start(
      nullptr,
      [echo](IncomingFrame&& frame) {
        OutgoingFrame answer;
        answer.envelope = std::move(frame.envelope);
        echo->send(std::move(answer), nullptr);
      },
      [](const Error&) {});
  std::mutex mutex;
  std::vector<std::pair<uint64_t, pid_t>> answers;  // index, the thread that received it
  connection->start(
      nullptr,
      [&](IncomingFrame&& frame) {
        std::lock_guard lock(mutex);
        answers.emplace_back(indexOf(frame), ::gettid());
      },
      [](const Error&) {});
  auto answered = [&](size_t n) {
    std::lock_guard lock(mutex);
    return answers.size() >= n;
  };
  auto waitAnswered = [&](size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + kWait;
    while (!answered(n) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
    return answered(n);
  };

  constexpr uint64_t kCalls = 50;
  std::vector<bool> driven(kCalls, false);
  // The contexts' worker (one per process), counted as a tenant while this looks at it.
  const std::shared_ptr<UcxWorker> worker = UcxWorker::acquire(false).value();
  struct Release {
    UcxWorker& worker;
    ~Release() { worker.release(false); }
  } release{*worker};
  const uint64_t wakes = worker->wakesAfterDriving();
  for (uint64_t i = 0; i < kCalls; ++i) {
    // The loop thread is awake now and then (it just handled the server's side): try again a little later.
    bool reading = connection->beginWaitingRead();
    for (int attempt = 0; attempt < 100 && !reading; ++attempt) {
      std::this_thread::sleep_for(1ms);
      reading = connection->beginWaitingRead();
    }
    OutgoingFrame frame;
    frame.envelope = envelopeWithIndex(i);
    frame.fromSender = true;
    connection->send(std::move(frame), nullptr);
    if (reading) {
      connection->readWhileWaiting([&] { return answered(i + 1); }, std::chrono::seconds(10));
      connection->endWaitingRead();
      driven[i] = true;
    }
    ASSERT_TRUE(waitAnswered(i + 1)) << "no answer to frame " << i;
  }
  EXPECT_GE(std::count(driven.begin(), driven.end(), true), static_cast<long>(kCalls * 9 / 10));
  if (!busyPoll) {
    // Note [Arming after driving]: a driver lets go with the worker armed (the loop thread was woken at
    // every call when the driver took the first arm's BUSY for work left to it).
    EXPECT_LT(worker->wakesAfterDriving() - wakes, kCalls / 5) << "drivers woke the loop thread";
  }
  {
    std::lock_guard lock(mutex);
    for (uint64_t i = 0; i < kCalls; ++i) {
      EXPECT_EQ(answers[i].first, i) << "answers out of order";
      if (driven[i]) {
        EXPECT_EQ(answers[i].second, ::gettid()) << "answer " << i << " was not read by its waiter";
      }
    }
  }
  if (!busyPoll) {
    // Sent alone while the loop thread sleeps: issued by this thread (retried should the loop be awake).
    const uint64_t before = connection->framesWrittenBySender();
    for (uint64_t i = kCalls; i < kCalls + 20 && connection->framesWrittenBySender() == before; ++i) {
      std::this_thread::sleep_for(5ms);
      OutgoingFrame frame;
      frame.envelope = envelopeWithIndex(i);
      frame.fromSender = true;
      connection->send(std::move(frame), nullptr);
      ASSERT_TRUE(waitAnswered(i + 1));
    }
    EXPECT_GT(connection->framesWrittenBySender(), before);
  }
  client->close();
  server->close();
}

TEST(UcxWorker, AWaitingThreadDrivesTheWorkerAndReadsItsAnswerItself) {
  if (!ucxUnavailableReason().empty()) GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
  expectWaitingThreadsDrive(/*busyPoll=*/false);
}

TEST(UcxWorker, AWaitingThreadDrivesABusyPollingWorkerWhileTheLoopThreadYields) {
  if (!ucxUnavailableReason().empty()) GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
  expectWaitingThreadsDrive(/*busyPoll=*/true);
}

// Note [Watching apart]: while a thread drives (asleep on the drivers' own epoll set, the loop thread's set
// not watching the worker), a task posted to the loop wakes that thread, which runs it at once, and an
// interrupt makes it check its condition again; neither waits for the driver's window to pass.
TEST(UcxWorker, ADriverRunsWhatIsPostedAndSeesInterruptsAtOnce) {
  using namespace std::chrono_literals;  // NOLINT
  if (!ucxUnavailableReason().empty()) GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
  const std::shared_ptr<UcxWorker> worker = UcxWorker::acquire(false).value();
  struct Release {
    UcxWorker& worker;
    ~Release() { worker.release(false); }
  } release{*worker};
  auto drive = [&](const std::function<bool()>& done, const std::function<void()>& other) {
    // The loop thread may be awake a moment after acquire: try again a little later.
    bool driving = worker->beginDriving();
    for (int attempt = 0; attempt < 1000 && !driving; ++attempt) {
      std::this_thread::sleep_for(1ms);
      driving = worker->beginDriving();
    }
    EXPECT_TRUE(driving) << "the loop thread never let go";
    if (!driving) return std::chrono::steady_clock::duration::max();
    std::thread poster([&] {
      std::this_thread::sleep_for(20ms);  // the driver is asleep by then
      other();
    });
    const auto begin = std::chrono::steady_clock::now();
    worker->driveWhile(done, 30s);
    const auto waited = std::chrono::steady_clock::now() - begin;
    worker->endDriving();
    poster.join();
    return waited;
  };
  std::atomic<bool> ran{false};
  std::atomic<pid_t> ranOn{0};
  auto waited = drive([&] { return ran.load(); },
                      [&] {
                        ASSERT_TRUE(worker->post([&] {
                          ranOn = ::gettid();
                          ran = true;
                        }));
                      });
  EXPECT_TRUE(ran.load());
  EXPECT_EQ(ranOn.load(), ::gettid()) << "the posted task did not run on the driving thread";
  EXPECT_LT(waited, 10s) << "the posted task waited for the driver's window";
  std::atomic<bool> flag{false};
  waited = drive([&] { return flag.load(); },
                 [&] {
                   flag = true;
                   worker->interrupt();
                 });
  EXPECT_TRUE(flag.load());
  EXPECT_LT(waited, 10s) << "the interrupt was not seen before the driver's window passed";
}

// Note [Cross-memory attach] (rpc/transport/ucx/context.cpp): on one host the rendezvous lane is CMA, not
// UCX's tcp, and a payload far above the rendezvous threshold arrives intact.
TEST(UcxLanes, OneHostRendezvousGoesByCrossMemoryAttach) {
  if (!ucxUnavailableReason().empty()) GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
  if (std::string why = distgrad::testing::crossMemoryAttachUnavailable(); !why.empty()) GTEST_SKIP() << why;
  auto server = createContext("ucx").value();
  auto client = createContext("ucx").value();
  std::promise<std::shared_ptr<Connection>> accepted;
  auto listener = listenOnce(*server, accepted);
  ASSERT_TRUE(listener);
  Collector atClient, atServer;
  auto connection = connectPair(*client, listener->address(), atClient, atServer, accepted);
  ASSERT_TRUE(connection);
  const std::string lanes = connection->lanes();
  EXPECT_NE(lanes.find("cma/memory (rma_bw"), std::string::npos) << lanes;
  EXPECT_EQ(lanes.find("tcp/lo (rma_bw"), std::string::npos) << lanes;
  Bytes payload = patternBytes(8u << 20, 3);
  OutgoingFrame frame;
  frame.envelope = envelopeWithIndex(0);
  frame.payloads = {payload.buffer()};
  SendTracker sends(1);
  connection->send(std::move(frame), sends.callback(0));
  ASSERT_TRUE(atServer.waitFrames(1));
  ASSERT_TRUE(sends.waitDone(1));
  EXPECT_EQ(sends.ok, 1u);
  std::lock_guard lock(atServer.mutex);
  ASSERT_EQ(atServer.frames[0].payloads.size(), 1u);
  ASSERT_EQ(atServer.frames[0].payloads[0].size, payload.data->size());
  EXPECT_EQ(std::memcmp(atServer.frames[0].payloads[0].data, payload.data->data(), payload.data->size()), 0);
}

// A send that fails while its payload waits to be read by the peer (here: a peer connection never started,
// so the rendezvous is never answered, then our close gives up on it) keeps the payload allocated after it
// reported the failure (UcxConnection::kFailedSendLinger), and the Context's close releases it.
TEST(UcxLanes, APayloadOfAFailedSendStaysAllocatedUntilTheLingerOrTheContextsClose) {
  if (!ucxUnavailableReason().empty()) GTEST_SKIP() << "ucx is not viable here: " << ucxUnavailableReason();
  auto server = createContext("ucx").value();
  auto client = createContext("ucx").value();
  std::promise<std::shared_ptr<Connection>> accepted;
  auto listener = listenOnce(*server, accepted);
  ASSERT_TRUE(listener);
  // `unstarted` holds what arrives and answers nothing.
  auto [connection, unstarted] = connectUnstarted(*client, listener->address(), accepted);
  ASSERT_TRUE(connection);
  Collector atClient;
  atClient.start(connection);
  auto released = std::make_shared<std::promise<void>>();
  auto releasedFuture = released->get_future();
  SendTracker sends(1);
  {
    Bytes payload = patternBytes(4u << 20, 5);
    OutgoingFrame frame;
    frame.envelope = envelopeWithIndex(0);
    frame.payloads = {payload.buffer()};
    // The owner signals when the transport lets go of the bytes.
    frame.payloads[0].owner = std::shared_ptr<const void>(
        payload.data->data(), [bytes = payload.data, released](const void*) { released->set_value(); });
    connection->send(std::move(frame), sends.callback(0));
  }
  connection->close();
  ASSERT_TRUE(sends.waitDone(1));
  EXPECT_EQ(sends.failed, 1u) << "the send was never answered, so it must fail when its connection closes";
  EXPECT_EQ(releasedFuture.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout)
      << "a peer may still read the failed send's bytes in place";
  client->close();
  EXPECT_EQ(releasedFuture.wait_for(kWait), std::future_status::ready) << "the Context's close releases what lingered";
  unstarted->close();
  server->close();
}

}  // namespace
}  // namespace distgrad::rpc::transport::ucx

#endif  // DG_HAVE_UCX
