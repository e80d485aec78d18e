// The ucx transport's wire validation: a raw ucp client (its own context, worker and client-server
// endpoint) sends hand-made active messages to a ucx listener, and each malformed one must close that
// connection with a `malformed frame:` Error naming the problem, without touching the process.
#ifdef DG_HAVE_UCX

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstring>
#include <future>

#include "rpc/transport/ucx/context.h"
#include "tests/rpc/transport_test_util.h"

namespace distgrad::rpc::transport::ucx {
namespace {

using namespace testing;  // NOLINT

// A bare ucp client driven by hand (progress in wait loops), for sending what our transport never would.
class RawUcpClient {
 public:
  explicit RawUcpClient(const std::string& address) {
    ucp_config_t* config = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    EXPECT_EQ(ucp_init(&params, config, &context_), UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t workerParams{};
    workerParams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    workerParams.thread_mode = UCS_THREAD_MODE_SINGLE;
    EXPECT_EQ(ucp_worker_create(context_, &workerParams, &worker_), UCS_OK);
    // Handlers for the ids the server sends (its goodbye): UCX 1.13 crashes on a reply-flagged message for
    // an id without one.
    for (unsigned id = 1; id <= 5; ++id) {
      ucp_am_handler_param_t handler{};
      handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB;
      handler.id = id;
      handler.cb = [](void*, const void*, size_t, void*, size_t, const ucp_am_recv_param_t*) { return UCS_OK; };
      EXPECT_EQ(ucp_worker_set_am_recv_handler(worker_, &handler), UCS_OK);
    }
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
    EXPECT_EQ(ucp_ep_create(worker_, &epParams, &ep_), UCS_OK);
  }
  ~RawUcpClient() {
    if (ep_ != nullptr) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;
      wait(ucp_ep_close_nbx(ep_, &param));
    }
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  // Sends one active message and progresses until ucp completed it.
  void send(AmId id, const std::vector<uint8_t>& header, const std::vector<uint8_t>& data) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    wait(ucp_am_send_nbx(ep_, static_cast<unsigned>(id), header.empty() ? nullptr : header.data(), header.size(),
                         data.empty() ? nullptr : data.data(), data.size(), &param));
  }
  // Progresses the worker (the server's goodbye and disconnect need an answer) until `done`.
  template <typename F>
  bool progressUntil(F done) {
    auto deadline = std::chrono::steady_clock::now() + kWait;
    while (!done()) {
      ucp_worker_progress(worker_);
      if (std::chrono::steady_clock::now() > deadline) return false;
    }
    return true;
  }

 private:
  void wait(ucs_status_ptr_t request) {
    if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
    auto deadline = std::chrono::steady_clock::now() + kWait;
    while (ucp_request_check_status(request) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(request);
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
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
    if (!client->progressUntil(
            [&] { return acceptedFuture.wait_for(std::chrono::seconds(0)) == std::future_status::ready; })) {
      ADD_FAILURE() << "the ucx listener did not accept the raw client";
      return false;
    }
    atServer.start(acceptedFuture.get());
    return true;
  }
  // Progresses the client (the server's goodbye needs answers) until the server's end holds `n` frames.
  bool waitFrames(size_t n) {
    return client->progressUntil([&] {
      std::lock_guard lock(atServer.mutex);
      return atServer.frames.size() >= n;
    });
  }
  // Likewise until the server's end reported its close.
  bool waitClosed() {
    return client->progressUntil([&] {
      std::lock_guard lock(atServer.mutex);
      return atServer.closed.has_value();
    });
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
  cases.push_back({"a header shorter than the prefix", AmId::kFrame, std::vector<uint8_t>(10, 1), {},
                   "shorter than the 24-byte prefix"});
  FramePrefix badMagic = ok;
  badMagic.magic = 0x12345678;
  cases.push_back({"a bad magic", AmId::kFrame, head(badMagic, {}, 16), {}, "bad magic"});
  FramePrefix badVersion = ok;
  badVersion.version = kProtocolVersion + 1;
  cases.push_back({"another protocol version", AmId::kFrame, head(badVersion, {}, 16), {}, "protocol version"});
  cases.push_back({"a header shorter than its envelope", AmId::kFrame, head(ok, {}, 8), {}, "where the prefix declares"});
  FramePrefix onePayload = ok;
  onePayload.payloadCount = 1;
  onePayload.payloadBytes = 100;
  cases.push_back({"data longer than the declared payloads", AmId::kFrame, head(onePayload, {100}, 16),
                   std::vector<uint8_t>(150, 7), "payload bytes where the prefix declares"});
  cases.push_back({"sizes that do not sum to the total", AmId::kFrame, head(onePayload, {60}, 16),
                   std::vector<uint8_t>(100, 7), "payload sizes sum to 60"});
  cases.push_back({"a payload larger than the total", AmId::kFrame, head(onePayload, {1000}, 16),
                   std::vector<uint8_t>(100, 7), "more than the frame's total"});
  cases.push_back({"payloads without a head", AmId::kPayloads, {}, std::vector<uint8_t>(64, 7),
                   "payload data without a frame head"});
  cases.push_back({"a head message whose header is not a prefix", AmId::kHead, head(ok, {}, 4), std::vector<uint8_t>(16, 1),
                   "a frame head of 16 bytes"});
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
    ASSERT_TRUE(session.waitClosed());
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
  ASSERT_TRUE(session.waitFrames(1));
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
  ASSERT_TRUE(session.waitFrames(2));
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
  auto listener = server->listen("127.0.0.1:0", [&](std::shared_ptr<Connection> c) { accepted.set_value(std::move(c)); });
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

}  // namespace
}  // namespace distgrad::rpc::transport::ucx

#endif  // DG_HAVE_UCX
