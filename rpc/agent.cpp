#include "rpc/agent.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <thread>
#include <utility>

#include "rpc/detail/hmac.h"
#include "rpc/transport/inproc/context.h"
#include "tensor/cuda/runtime.h"
#include "tensor/error.h"

namespace distgrad::rpc {

namespace {

using SteadyTime = std::chrono::steady_clock;

int64_t nowNanos() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyTime::now().time_since_epoch()).count();
}

// A traced call's times on the executor thread that ran its handler (trace::nowNs()), when the handler
// returned its value: recorded with the reply's (trace::RpcSite::kServerHandled).
struct ExecuteTimes {
  int64_t queuedNs;
  int64_t startNs;
  int64_t invokedNs;
};

int64_t unixMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The handshake (docs/wire_protocol.md section 8). Every stage travels as a MessageKind::kHandshake frame
// whose value is Agent::HandshakeMessage; the connector is the lower rank, which opened the link:
//   1 hello      connector -> acceptor  version, name, rank, nonce_c
//   2 challenge  acceptor -> connector  version, name, rank, nonce_a        (only after checking the hello)
//   3 proof      connector -> acceptor  mac = MAC("c2a")                    (the connector proves first)
//   4 accept     acceptor -> connector  mac = MAC("a2c")                    (only after checking the proof)
// MAC(d) = HMAC-SHA256(secret, kHandshakeLabel || d || nonce_c || nonce_a || u32le(|name_c|) || name_c ||
//                      u32le(|name_a|) || name_a): both nonces, both names and the direction, so a proof is
// valid for exactly one link and one direction and cannot be relayed to another link or reflected back.
constexpr int64_t kHello = 1;
constexpr int64_t kChallenge = 2;
constexpr int64_t kProof = 3;
constexpr int64_t kAccept = 4;
constexpr std::string_view kHandshakeLabel = "distgrad-handshake-v2 ";
constexpr std::string_view kConnectorToAcceptor = "c2a";
constexpr std::string_view kAcceptorToConnector = "a2c";
// A worker name in a hello longer than this is refused (names come from the store and are short).
constexpr size_t kMaxNameBytes = 256;
// Before a link is ready, a frame must look like a handshake message: no payloads, a small envelope.
constexpr size_t kMaxHandshakeEnvelopeBytes = 4096;
// The callee's backstop deadline for a call fires this long (or 5% of the timeout, if longer) after the
// call's own deadline (onCall).
constexpr std::chrono::microseconds kCalleeDeadlineGrace{20'000};
// Default bound on one link's handshake (AgentConfig::handshakeTimeout).
constexpr std::chrono::milliseconds kDefaultHandshakeTimeout{10'000};
// Clock-offset samples kept per peer (the handshake's, then one per heartbeat received): the estimate is
// the sample with the smallest round trip among them (Note [Clock offsets]).
constexpr size_t kClockWindow = 16;

const char* stageName(int64_t stage) {
  switch (stage) {
    case kHello:
      return "hello";
    case kChallenge:
      return "challenge";
    case kProof:
      return "proof";
    case kAccept:
      return "accept";
    default:
      return "unknown";
  }
}

void appendBytes(std::vector<uint8_t>& out, std::string_view bytes) { out.insert(out.end(), bytes.begin(), bytes.end()); }

void appendName(std::vector<uint8_t>& out, const std::string& name) {
  // Length-prefixed, so ("ab", "c") and ("a", "bc") never give the same message.
  const auto n = static_cast<uint32_t>(name.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(n >> (8 * i)));
  appendBytes(out, name);
}

std::vector<uint8_t> handshakeMac(const std::string& secret, std::string_view direction,
                                  std::span<const uint8_t> connectorNonce, std::span<const uint8_t> acceptorNonce,
                                  const std::string& connector, const std::string& acceptor) {
  std::vector<uint8_t> message;
  appendBytes(message, kHandshakeLabel);
  appendBytes(message, direction);
  message.insert(message.end(), connectorNonce.begin(), connectorNonce.end());
  message.insert(message.end(), acceptorNonce.begin(), acceptorNonce.end());
  appendName(message, connector);
  appendName(message, acceptor);
  auto digest = detail::hmacSha256(
      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(secret.data()), secret.size()), message);
  return {digest.begin(), digest.end()};
}

// A name a peer claimed, safe for a log line: bytes outside printable ASCII (and the backslash) become
// \xHH escapes, and an over-long name is cut (its length is given).
std::string printable(std::string_view text) {
  constexpr size_t kShown = 64;
  std::string out;
  for (size_t i = 0; i < text.size() && i < kShown; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char escaped[5];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", c);
      out += escaped;
    }
  }
  if (text.size() > kShown) out += "... (" + std::to_string(text.size()) + " bytes)";
  return out;
}

bool isLoopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

uint64_t frameBytes(const transport::OutgoingFrame& frame) {
  uint64_t n = frame.envelope.size();
  for (const auto& p : frame.payloads) n += p.size;
  return n;
}

std::string joinNames(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

// Note [Clock offsets] (docs/wire_protocol.md, "Clock offsets")
// Every worker times its events with its own steady clock; distgrad-trace lines them up with an estimate
// of each peer's clock taken from four timestamps of one round trip: t0 (A sends, A's clock), t1 (B
// receives, B's clock), t2 (B answers, B's clock), t3 (A receives, A's clock):
//   rtt = (t3 - t0) - (t2 - t1)        offset(A -> B) = (t1 - t0) - rtt / 2
// (= ((t1 - t0) + (t2 - t3)) / 2: the error is at most rtt / 2, the asymmetry of the two trips). The
// handshake gives the first sample: hello (t0), challenge (t1 = when the hello arrived, t2 = its own send
// time), the connector takes t3 and sends its estimate in the proof, which the acceptor checks against the
// t0 and t1 it knows (the offset must equal (t1 - t0) - rtt / 2) and adopts, negated. Heartbeats refresh
// it: each carries its send time and echoes the last heartbeat received from that peer with its arrival
// time, so every heartbeat that echoes one gives its receiver a new sample. A peer keeps the last
// kClockWindow samples; the one with the smallest round trip (least queueing) is the estimate.
struct Agent::HandshakeMessage {
  int64_t stage = 0;
  int64_t version = 0;
  std::string name;
  int64_t rank = -1;
  std::vector<uint8_t> nonce;
  std::vector<uint8_t> mac;
  // Note [Clock offsets]: hello and challenge: the sender's clock when it sent this message (> 0);
  // challenge: when the hello arrived (acceptor's clock); proof: the connector's estimate of the acceptor's
  // clock (offsetNs, with its round trip rttNs >= 0). 0 where a stage does not use them.
  int64_t sentNs = 0;
  int64_t helloReceivedNs = 0;
  int64_t offsetNs = 0;
  int64_t rttNs = 0;
  // CUDA over RPC (hello and challenge): the sender's CUDA device count and its device map for messages to
  // the receiver (Options::deviceMaps[receiver], as (source, target) pairs), checked by Agent::start.
  int64_t cudaDevices = 0;
  std::vector<std::pair<int64_t, int64_t>> deviceMap;
  template <class V>
  void visitFields(V& v) {
    v("stage", stage);
    v("version", version);
    v("name", name);
    v("rank", rank);
    v("nonce", nonce);
    v("mac", mac);
    v("sentNs", sentNs);
    v("helloReceivedNs", helloReceivedNs);
    v("offsetNs", offsetNs);
    v("rttNs", rttNs);
    v("cudaDevices", cudaDevices);
    v("deviceMap", deviceMap);
  }
};

// The value of a heartbeat (Note [Clock offsets]): its send time on the sender's clock, and the send time
// of the last heartbeat the sender received from this receiver with its arrival time on the sender's
// clock (both 0 until one arrived).
struct Agent::HeartbeatMessage {
  int64_t sentNs = 0;
  int64_t echoNs = 0;
  int64_t echoReceivedNs = 0;
  template <class V>
  void visitFields(V& v) {
    v("sentNs", sentNs);
    v("echoNs", echoNs);
    v("echoReceivedNs", echoReceivedNs);
  }
};

namespace {

// Where a link's handshake stands; the stage this end waits for.
enum class HandshakeStep {
  kAwaitHello,      // acceptor
  kHelloPending,    // acceptor: a hello came before the peer list was known and waits on the link
  kAwaitChallenge,  // connector
  kAwaitProof,      // acceptor
  kAwaitAccept,     // connector
  kDone,
};

// Note [Serving reader]: a worker reads a caller's connection for its next call once this many of its calls
// in a row arrived while no other call was being served (the call being answered included; inline calls,
// such as the RRef layer's control messages, are not counted either way).
constexpr uint32_t kServeAfterCallsAlone = 3;
// Note [Lone calls]: a call is written by its sender once this many calls in a row to its worker (it
// included) found no other call to that worker pending.
constexpr uint32_t kSenderWritesAfterLoneCalls = 3;

// True while this thread reads a connection for some agent (SyncWait::read: a caller waiting for its reply,
// a worker serving the next call): the frames it hands on are decoded on a read path, as on the loop.
thread_local bool tReadsConnection = false;

// Note [Reading for the answer]: the calls the handler running on this executor worker sent (startCall
// counts them while one is set), the last one's id and connection.
struct HandlerCalls {
  explicit HandlerCalls(const void* of) : agent(of) {}
  const void* agent;
  int count = 0;
  uint64_t id = 0;
  std::shared_ptr<transport::Connection> connection;  // null: a call to the agent itself
};
thread_local HandlerCalls* tHandlerCalls = nullptr;

}  // namespace

// Fields marked "loop" are read and written only on the transport's loop thread.
struct Agent::Link {
  std::shared_ptr<transport::Connection> connection;
  std::string expectedPeer;  // set for the links this agent opened (it is then the connector)
  std::string peer;          // loop: the registered worker the peer's hello / challenge named, once checked
  std::array<uint8_t, detail::kNonceBytes> nonce{};  // this end's
  std::vector<uint8_t> peerNonce;                     // loop
  HandshakeStep step = HandshakeStep::kAwaitHello;    // loop
  TimerId handshakeTimer = kInvalidTimerId;           // loop
  bool closed = false;                                // loop: onLinkClosed ran
  std::optional<HandshakeMessage> deferredHello;      // GUARDED_BY(Agent::mutex_)
  bool ready = false;    // written on the loop thread under Agent::mutex_
  bool refused = false;  // written on the loop thread under Agent::mutex_
  // Written on the loop thread before the link is registered (under Agent::mutex_), read-only afterwards.
  int peerRank = -1;
  // Note [Clock offsets], loop: the connector's hello send time; the acceptor's copy of the hello's
  // sentNs and its arrival; the sample the handshake gave (moved into the Peer by registerLink).
  int64_t helloSentNs = 0;
  int64_t peerHelloSentNs = 0;
  int64_t helloReceivedNs = 0;
  std::optional<std::pair<int64_t, int64_t>> clockSample;  // (offset, rtt)
  // What the peer's hello / challenge announced (loop; moved into the Peer by registerLink).
  int peerCudaDevices = 0;
  DeviceMap peerDeviceMap;
};

struct Agent::Peer {
  std::string name;
  int rank = -1;
  std::string address;
  std::shared_ptr<Link> link;  // the handshaken link, null before / after
  bool dead = false;
  std::optional<Error> deadReason;
  std::atomic<int64_t> lastSeenNanos{0};
  std::atomic<uint64_t> callsSent{0};
  std::atomic<uint64_t> callsReceived{0};
  std::atomic<uint64_t> bytesSent{0};
  std::atomic<uint64_t> bytesReceived{0};
  std::atomic<uint64_t> errors{0};
  uint64_t pending = 0;  // GUARDED_BY(Agent::mutex_)
  // Note [Serving reader], GUARDED_BY(Agent::mutex_): this peer's calls in a row that arrived while no other
  // call was being served.
  uint32_t callsAlone = 0;
  // Note [Lone calls], GUARDED_BY(Agent::mutex_): calls in a row to this peer that found none pending.
  uint32_t loneCallsSent = 0;
  // Note [Clock offsets], GUARDED_BY(Agent::mutex_): the last kClockWindow samples (offset, rtt), how many
  // were taken, and the last heartbeat received from the peer (its sentNs, our arrival time) to echo.
  std::deque<std::pair<int64_t, int64_t>> clockSamples;
  uint64_t clockSampleCount = 0;
  int64_t lastHeartbeatSentNs = 0;
  int64_t lastHeartbeatReceivedNs = 0;
  int64_t lastEchoUsedNs = 0;  // the echo of our heartbeat that gave the last sample (never used twice)
  // CUDA over RPC, GUARDED_BY(Agent::mutex_), set by registerLink: the peer's CUDA device count and the
  // map it announced for messages to this worker; the map this worker sends to it with (null: none).
  std::optional<int> cudaDevices;
  DeviceMap announcedMap;
  std::shared_ptr<const DeviceMap> sendMap;
};

struct Agent::Pending {
  std::string peer;
  std::string function;
  Completion complete;
  TimerId timer = kInvalidTimerId;
  std::chrono::milliseconds timeout{0};  // the deadline's length, for the timeout error's message
  CancellationRegistration cancelRegistration;
  // Tracing: the function's interned name (nullptr: the call is not traced), the callee's rank and when
  // the call started waiting (after its frame was queued).
  const char* traceName = nullptr;
  int peerRank = -1;
  int64_t waitBeginNs = 0;
};

struct Agent::Incoming {
  CancellationSource source;
  // The callee's own deadline for this call (onCallDeadline), cancelled when the handler finishes.
  TimerId timer = kInvalidTimerId;
};

// ---- start ----

Agent::Agent(const Options& options, const Registry& registry, AgentConfig config)
    : options_(options),
      config_(std::move(config)),
      syncReadWindowUs_(config_.syncReadWindow.count()),
      serveReadWindowUs_(config_.serveReadWindow.count()),
      registry_(registry),
      name_(options.name()) {
  self_ = std::make_unique<Peer>();
  self_->name = name_;
  self_->rank = options_.rank;
  if (auto it = options_.deviceMaps.find(name_); it != options_.deviceMaps.end()) {
    selfDeviceMap_ = std::make_shared<const DeviceMap>(it->second);
    deviceMapsInUse_.store(true, std::memory_order_release);
  }
}

std::unique_ptr<Agent> Agent::start(const Options& options, const Registry& registry, AgentConfig config) {
  options.validate();
  std::unique_ptr<Agent> agent(new Agent(options, registry, std::move(config)));
  try {
    agent->startUp();
  } catch (...) {
    agent->teardown();
    agent->tornDown_.store(true, std::memory_order_release);
    throw;
  }
  return agent;
}

void Agent::warn(const std::string& message) const {
  std::fprintf(stderr, "[distgrad] agent %s: %s\n", name_.c_str(), message.c_str());
}

void Agent::startUp() {
  // First the trace slot every thread of this agent records for; with Options::traceDir the file is
  // created now, so a directory that cannot be written fails start at once (ValueError).
  traceSlot_ = trace::registerWorker(name_, options_.rank, options_.traceDir, config_.clockSkewForTesting.count());
  const trace::WorkerSlot slot = traceSlot_;
  auto bindThread = [slot] { trace::setCurrentWorker(slot); };
  executor_ = std::make_unique<Executor>(static_cast<size_t>(std::max(1, options_.executorThreads)), "dg-agent",
                                         bindThread);
  timers_ = std::make_unique<TimerQueue>(nullptr, bindThread);
  // Before any connection exists, so every message sees the hook (it may use the executor).
  if (registry_.autogradHookFactory()) autogradHook_ = registry_.autogradHookFactory()(*this);
  const auto rendezvousDeadline = SteadyTime::now() + options_.rendezvousTimeout;

  // Rendezvous store.
  if (options_.storeAddr.empty() && options_.rank == 0) {
    std::string host = isLoopback(options_.masterAddr) ? options_.masterAddr : std::string("0.0.0.0");
    storeServer_ = StoreServer::start(host + ":" + std::to_string(options_.masterPort));
    storeAddress_ = (isLoopback(options_.masterAddr) ? options_.masterAddr : std::string("127.0.0.1")) + ":" +
                    std::to_string(storeServer_->port());
  } else {
    storeAddress_ = options_.rendezvousAddress();
  }
  store_ = StoreClient::connect(storeAddress_, options_.rendezvousTimeout);

  // Transport and listener.
  transport::ContextOptions contextOptions;
  contextOptions.limits.maxPayloadBytes = options_.maxMessageBytes;
  if (options_.transport == "inproc") {
    DG_CHECK(config_.inprocHub != nullptr,
             "Agent::start: transport 'inproc' needs AgentConfig::inprocHub (shared by the job's agents)");
    context_ = transport::inproc::createInprocContext(config_.inprocHub, contextOptions);
  } else {
    auto context = transport::createContext(options_.transport, contextOptions);
    if (!context.ok()) throw RpcError(context.error());
    context_ = std::move(context).value();
  }
  // The loop thread records for this agent too; this runs before any connection exists.
  context_->defer(bindThread);
  allocator_ = makePayloadAllocator();
  std::string listenAddress;
  std::string publishHost;
  if (options_.transport == "inproc") {
    listenAddress = config_.storePrefix + "/" + name_;
  } else if (isLoopback(options_.masterAddr)) {
    listenAddress = "127.0.0.1:0";
  } else {
    listenAddress = "0.0.0.0:0";
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    publishHost = host;
  }
  auto listener = context_->listen(listenAddress, [this](std::shared_ptr<transport::Connection> connection) {
    adoptConnection(std::move(connection), "");
  });
  if (!listener.ok()) throw RpcError(listener.error());
  listener_ = std::move(listener).value();
  std::string address = listener_->address();
  if (!publishHost.empty()) address = publishHost + ":" + std::to_string(parseHostPort(address, "listener").second);

  {
    std::lock_guard<std::mutex> lock(mutex_);
    accepting_ = true;
  }

  // Publish ourselves, then learn everyone.
  const std::string prefix = config_.storePrefix + "/worker/";
  store_->set(prefix + std::to_string(options_.rank), name_ + "\n" + address);
  std::vector<std::string> keys;
  for (int r = 0; r < options_.worldSize; ++r) keys.push_back(prefix + std::to_string(r));
  store_->wait(keys, options_.rendezvousTimeout);
  {
    std::map<std::string, std::unique_ptr<Peer>> peers;
    for (int r = 0; r < options_.worldSize; ++r) {
      std::string entry = store_->getString(keys[r], options_.rendezvousTimeout);
      auto newline = entry.find('\n');
      DG_CHECK(newline != std::string::npos, "Agent::start: malformed store entry for rank ", r);
      auto peer = std::make_unique<Peer>();
      peer->name = entry.substr(0, newline);
      peer->rank = r;
      peer->address = entry.substr(newline + 1);
      if (r == options_.rank) continue;
      DG_CHECK(peer->name != name_ && peers.find(peer->name) == peers.end(), "Agent::start: worker name '",
               peer->name, "' is used by two ranks");
      peers.emplace(peer->name, std::move(peer));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    peers_ = std::move(peers);
    peersKnown_ = true;
    callsOpen_ = true;
    // Hellos that came before the peer list was known waited on their links; answer them now, on the loop.
    for (const auto& link : links_) {
      if (!link->deferredHello) continue;
      context_->defer([this, link, hello = std::move(*link->deferredHello)] { onHello(link, hello); });
      link->deferredHello.reset();
    }
  }
  changed_.notify_all();
  // Device maps: every worker named must be in the job (devices are checked once handshakes told them).
  checkDeviceMaps();

  // One connection per pair: the lower rank connects to the higher one.
  std::vector<std::pair<std::string, std::string>> toConnect;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [name, peer] : peers_) {
      if (peer->rank > options_.rank) toConnect.emplace_back(name, peer->address);
    }
  }
  for (const auto& [peerName, peerAddress] : toConnect) {
    context_->connect(peerAddress, [this, peerName, peerAddress](Result<std::shared_ptr<transport::Connection>> r) {
      if (!r.ok()) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!startError_) {
          startError_ = Error::failed("cannot connect to " + peerName + " at " + peerAddress + ": " +
                                      r.error().message);
        }
        changed_.notify_all();
        return;
      }
      adoptConnection(std::move(r).value(), peerName);
    });
  }

  // Wait until every peer is handshaken.
  std::unique_lock<std::mutex> lock(mutex_);
  auto allReady = [&] {
    return std::all_of(peers_.begin(), peers_.end(), [](const auto& p) { return p.second->link != nullptr; });
  };
  auto anyDead = [&] {
    for (const auto& [name, peer] : peers_) {
      if (peer->dead) {
        if (!startError_) startError_ = peer->deadReason.value_or(Error::disconnected(name + " died during start"));
        return true;
      }
    }
    return false;
  };
  if (!changed_.wait_until(lock, rendezvousDeadline,
                           [&] { return startError_.has_value() || anyDead() || allReady(); })) {
    std::vector<std::string> missing;
    for (const auto& [name, peer] : peers_) {
      if (!peer->link) missing.push_back(name);
    }
    throw RpcError(Error::timeout("agent " + name_ + " could not connect to " + joinNames(missing) + " within " +
                                  std::to_string(options_.rendezvousTimeout.count()) + " ms"));
  }
  if (startError_) throw RpcError(*startError_);
  lock.unlock();
  checkDeviceMaps();
  lock.lock();
  // Still under mutex_: the first heartbeat may fire (and re-arm, writing heartbeatTimer_) at once.
  heartbeatTimer_ = timers_->scheduleAfter(options_.heartbeatInterval, [this] { heartbeat(); });
}

std::vector<std::string> Agent::workerNames() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<int, std::string>> ranked{{options_.rank, name_}};
  for (const auto& [name, peer] : peers_) ranked.emplace_back(peer->rank, name);
  std::sort(ranked.begin(), ranked.end());
  std::vector<std::string> out;
  for (auto& [rank, name] : ranked) out.push_back(std::move(name));
  return out;
}

std::string Agent::storeAddress() const { return storeAddress_; }

// ---- links and handshake (loop thread) ----

Result<transport::OutgoingFrame> Agent::introduction(int64_t stage, Link& link) const {
  HandshakeMessage message;
  message.stage = stage;
  message.version = config_.protocolVersionForTesting;
  message.name = name_;
  message.rank = options_.rank;
  message.nonce.assign(link.nonce.begin(), link.nonce.end());
  // Note [Clock offsets]: the hello's send time is t0; the challenge carries t1 (the hello's arrival) and t2.
  message.sentNs = clockNs();
  if (stage == kHello) link.helloSentNs = message.sentNs;
  if (stage == kChallenge) message.helloReceivedNs = link.helloReceivedNs;
  message.cudaDevices = tensor::cuda::deviceCount();
  const std::string& peer = stage == kHello ? link.expectedPeer : link.peer;
  if (auto it = options_.deviceMaps.find(peer); it != options_.deviceMaps.end()) {
    for (const auto& [from, to] : it->second.entries()) message.deviceMap.emplace_back(from, to);
  }
  EnvelopeFields fields;
  fields.kind = MessageKind::kHandshake;
  return encodeMessageWith(fields, message);
}

void Agent::adoptConnection(std::shared_ptr<transport::Connection> connection, const std::string& expectedPeer) {
  auto link = std::make_shared<Link>();
  link->connection = connection;
  link->expectedPeer = expectedPeer;
  link->nonce = detail::makeNonce();
  link->step = expectedPeer.empty() ? HandshakeStep::kAwaitHello : HandshakeStep::kAwaitChallenge;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) {
      connection->close();
      return;
    }
    links_.push_back(link);
  }
  std::weak_ptr<Link> weak = link;
  connection->start(
      linkAllocator(weak),
      [this, weak](transport::IncomingFrame&& frame) {
        if (auto l = weak.lock()) onFrame(l, std::move(frame));
      },
      [this, weak](const Error& error) {
        if (auto l = weak.lock()) onLinkClosed(l, error);
      });
  // A link that does not finish its handshake in time is closed (the check itself runs on the loop).
  link->handshakeTimer = timers_->scheduleAfter(handshakeTimeout(), [this, weak] {
    std::lock_guard<std::mutex> lock(mutex_);
    auto l = weak.lock();
    if (closed_ || !l || l->ready) return;
    try {
      context_->defer([this, l] { onHandshakeTimeout(l); });  // the context is open while !closed_
    } catch (const std::exception& e) {
      warn(std::string("cannot check a handshake timeout: ") + e.what());
    }
  });
  if (!expectedPeer.empty()) {
    // This end opened the link: it is the connector and speaks first.
    auto frame = introduction(kHello, *link);
    if (frame.ok()) sendOn(link, std::move(frame).value());
  }
}

transport::PayloadAllocator Agent::linkAllocator(const std::weak_ptr<Link>& weak) {
  return [this, weak](std::span<const uint8_t> envelope,
                      std::span<const uint64_t> sizes) -> Result<std::vector<transport::PayloadBuffer>> {
    auto link = weak.lock();
    if (link && link->ready) return allocator_(envelope, sizes);
    uint64_t bytes = 0;
    for (uint64_t size : sizes) bytes += size;
    std::string reason = "a frame with " + std::to_string(sizes.size()) + " payloads (" + std::to_string(bytes) +
                         " bytes) before the handshake completed; refused without allocating them";
    if (link) refuseLink(link, reason);
    return Error::failed(reason);
  };
}

std::chrono::milliseconds Agent::handshakeTimeout() const {
  if (config_.handshakeTimeout.count() > 0) return config_.handshakeTimeout;
  return std::min(options_.rendezvousTimeout, kDefaultHandshakeTimeout);
}

void Agent::onHandshakeTimeout(const std::shared_ptr<Link>& link) {
  if (link->ready || link->closed || link->refused) return;
  refuseLink(link, std::string("no handshake within ") + std::to_string(handshakeTimeout().count()) +
                       " ms (waiting for its " +
                       (link->step == HandshakeStep::kAwaitHello       ? "hello"
                        : link->step == HandshakeStep::kHelloPending   ? "hello to be answered: the peer list is unknown"
                        : link->step == HandshakeStep::kAwaitChallenge ? "challenge"
                        : link->step == HandshakeStep::kAwaitProof     ? "proof"
                                                                       : "accept") +
                       ")");
}

void Agent::refuseLink(const std::shared_ptr<Link>& link, const std::string& reason, const std::string& claimedName,
                       std::optional<transport::OutgoingFrame> lastWords) {
  if (link->refused) return;
  std::string who = !link->peer.empty() ? link->peer
                    : !link->expectedPeer.empty() ? link->expectedPeer
                    : !claimedName.empty() ? printable(claimedName)
                                           : link->connection->peerAddress();
  warn("refused the connection with " + who + ": " + reason);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    link->refused = true;
    link->deferredHello.reset();
    const bool concernsJob = !link->peer.empty() || !link->expectedPeer.empty() ||
                             (!claimedName.empty() && peers_.count(claimedName) > 0);
    if (concernsJob && !startError_) startError_ = Error::failed("handshake with " + who + " failed: " + reason);
  }
  changed_.notify_all();
  if (link->handshakeTimer != kInvalidTimerId) timers_->cancel(link->handshakeTimer);
  if (lastWords) {
    // Closed once the frame left (a close would drop a frame still queued); the handshake timeout is
    // not needed for this: the send completes or fails when the connection closes.
    auto connection = link->connection;
    connection->send(std::move(*lastWords), [connection](const Result<void>&) { connection->close(); });
    return;
  }
  link->connection->close();
}

// Note [Carried references]: a message's envelope lists the remote references (RRef forks) its value
// carries. Before any handler sees the message they are bound to the sink the registry names (rref/), so
// whichever path drops the message undecoded (unknown function, signature mismatch, a refusal while
// shutting down, failed argument decoding, a reply whose caller stopped waiting; any drop path added later
// too) hands the references it never claimed to the sink when its last view goes: the reference layer
// settles them, no owner keeps a fork nobody holds.
void Agent::bindReferences(const DecodedMessage& message, const std::string& peer) {
  const auto& references = message.references();
  if (!references) return;
  std::shared_ptr<ReferenceSink> sink;
  if (registry_.referenceSinkFactory()) {
    try {
      sink = registry_.referenceSinkFactory()(*this);
    } catch (const std::exception& e) {
      warn("cannot settle the " + std::to_string(references->size()) + " references of a message from " + peer +
           ": " + e.what());
    }
  } else {
    warn("a message from " + peer + " carries " + std::to_string(references->size()) +
         " remote references but this worker's registry has no reference layer (rref::RRefContext::install)");
  }
  references->bind(std::move(sink), peer);
}

void Agent::onFrame(const std::shared_ptr<Link>& link, transport::IncomingFrame&& frame) {
  // One clock read per frame, for the peer's liveness and, traced, the frame's arrival: traced, the trace
  // clock (the deserialize span ends on it), which stays within microseconds of the steady clock the
  // liveness checks use (Note [TSC trace clock] in rpc/trace.cpp).
  const bool tracing = trace::enabled();
  const int64_t seenNs = tracing ? trace::nowNs() : nowNanos();
  const int64_t arrivalNs = tracing ? seenNs : 0;
  // The loop thread was bound to this agent at start, but one ucx loop serves every agent of a process
  // (Note [One worker per process]): what this frame records goes to this agent's file.
  trace::WorkerScope traceWorker(traceSlot_, tracing);
  if (!link->ready && (!frame.payloads.empty() || frame.envelope.size() > kMaxHandshakeEnvelopeBytes)) {
    // Only handshake messages may come before the link is ready (the tcp allocator refused payloads
    // before this point; inproc frames get here).
    refuseLink(link, "a frame with " + std::to_string(frame.payloads.size()) + " payloads and a " +
                         std::to_string(frame.envelope.size()) + "-byte envelope before the handshake completed (" +
                         "at most " + std::to_string(kMaxHandshakeEnvelopeBytes) + " bytes and no payloads)");
    return;
  }
  uint64_t bytes = frame.envelope.size();
  for (const auto& p : frame.payloads) bytes += p.size;
  // RPC has value semantics on every transport: inproc frames share the sender's bytes, so they are copied
  // (tcp reads into fresh storage anyway).
  if (options_.transport == "inproc") copyPayloads(frame);
  auto decoded = decodeMessage(std::move(frame));
  if (!decoded.ok()) {
    warn("closing the connection with " + (link->peer.empty() ? link->connection->peerAddress() : link->peer) +
         ": " + decoded.error().message);
    link->connection->close();
    return;
  }
  DecodedMessage message = std::move(decoded).value();
  if (message.kind() == MessageKind::kHandshake) {
    onHandshake(link, message);
    return;
  }
  Peer* peer = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (link->ready) {
      auto it = peers_.find(link->peer);
      if (it != peers_.end()) peer = it->second.get();
    }
  }
  if (peer == nullptr) {
    refuseLink(link, std::string("a ") + messageKindName(message.kind()) + " message before the handshake");
    return;
  }
  peer->lastSeenNanos.store(seenNs, std::memory_order_relaxed);
  peer->bytesReceived.fetch_add(bytes, std::memory_order_relaxed);
  const MessageKind kind = message.kind();
  // A call's or a reply's transport.recv is part of the record its handling makes (trace::RpcRecord).
  if (arrivalNs != 0 && kind != MessageKind::kCall && kind != MessageKind::kResponse && kind != MessageKind::kError) {
    trace::recordInstant("transport.recv", trace::Category::kTransport, arrivalNs,
                         {static_cast<int64_t>(bytes), peer->rank});
  }
  const Arrival arrival{arrivalNs, bytes, /*fromTransport=*/true, peer->rank};
  bindReferences(message, link->peer);
  switch (message.kind()) {
    case MessageKind::kCall:
      onCall(link, std::move(message), arrival);
      break;
    case MessageKind::kResponse:
    case MessageKind::kError:
      onReply(link->peer, std::move(message), arrival);
      break;
    case MessageKind::kCancel:
      onCancel(link->peer, message);
      break;
    case MessageKind::kHeartbeat:
      onHeartbeat(link, message);
      break;
    default:
      warn(std::string("ignoring a ") + messageKindName(message.kind()) + " message from " + link->peer +
           " (no handler for it yet)");
      break;
  }
}

void Agent::onHandshake(const std::shared_ptr<Link>& link, const DecodedMessage& message) {
  if (link->refused) return;
  const int64_t receivedNs = clockNs();  // Note [Clock offsets]: t1 of a hello, t3 of a challenge
  auto decoded = message.decodeValue<HandshakeMessage>();
  if (!decoded.ok()) return refuseLink(link, "malformed handshake: " + decoded.error().message);
  HandshakeMessage hs = std::move(decoded).value();
  const bool connector = !link->expectedPeer.empty();
  const HandshakeStep expected = hs.stage == kHello       ? HandshakeStep::kAwaitHello
                                 : hs.stage == kChallenge ? HandshakeStep::kAwaitChallenge
                                 : hs.stage == kProof     ? HandshakeStep::kAwaitProof
                                 : hs.stage == kAccept    ? HandshakeStep::kAwaitAccept
                                                          : HandshakeStep::kDone;
  if (expected == HandshakeStep::kDone) return refuseLink(link, "unknown handshake stage " + std::to_string(hs.stage));
  if (link->step != expected) {
    return refuseLink(link, std::string("a handshake ") + stageName(hs.stage) + " out of order (this end " +
                                (connector ? "opened the link: the lower rank connects and says hello first"
                                           : "accepted the link") +
                                ")");
  }
  if (hs.stage == kHello || hs.stage == kChallenge) {
    if (hs.name.size() > kMaxNameBytes) {
      return refuseLink(link, std::string("a ") + stageName(hs.stage) + " with a name of " +
                                  std::to_string(hs.name.size()) + " bytes (at most " + std::to_string(kMaxNameBytes) +
                                  ")");
    }
    if (hs.nonce.size() != detail::kNonceBytes) {
      return refuseLink(link, "a nonce of " + std::to_string(hs.nonce.size()) + " bytes (expected " +
                                  std::to_string(detail::kNonceBytes) + ")");
    }
    if (hs.sentNs <= 0) {
      return refuseLink(link, std::string("a ") + stageName(hs.stage) + " with sentNs " + std::to_string(hs.sentNs) +
                                  " (expected the sender's steady clock in ns, > 0)");
    }
  }
  EnvelopeFields fields;
  fields.kind = MessageKind::kHandshake;
  switch (hs.stage) {
    case kHello: {
      link->step = HandshakeStep::kHelloPending;
      link->peerHelloSentNs = hs.sentNs;
      link->helloReceivedNs = receivedNs;
      {
        // A hello can come before this agent has read the peer list from the store: it waits on the link
        // (startUp replays it on the loop) so that the loop thread never blocks.
        std::lock_guard<std::mutex> lock(mutex_);
        if (!peersKnown_) {
          link->deferredHello = std::move(hs);
          return;
        }
      }
      onHello(link, hs);
      return;
    }
    case kChallenge: {
      // Connector: the acceptor named itself; it must be the worker we dialled, at its registered rank.
      if (hs.name != link->expectedPeer) {
        return refuseLink(link, "connected to " + link->expectedPeer + " but '" + printable(hs.name) + "' answered");
      }
      int registeredRank = -1;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        registeredRank = peers_.at(link->expectedPeer)->rank;
      }
      if (hs.rank != registeredRank) {
        return refuseLink(link, "worker '" + link->expectedPeer + "' claims rank " + std::to_string(hs.rank) +
                                    " but registered rank " + std::to_string(registeredRank));
      }
      if (hs.version != config_.protocolVersionForTesting) {
        return refuseLink(link, "protocol version " + std::to_string(hs.version) + ", this worker speaks " +
                                    std::to_string(config_.protocolVersionForTesting));
      }
      // Note [Clock offsets]: t0 = our hello, t1 = its arrival, t2 = the challenge's send time, t3 = now.
      if (hs.helloReceivedNs <= 0 || hs.helloReceivedNs > hs.sentNs) {
        return refuseLink(link, "a challenge whose hello arrival time (" + std::to_string(hs.helloReceivedNs) +
                                    " ns) is not in (0, its send time " + std::to_string(hs.sentNs) + " ns]");
      }
      // Both steady clocks are monotonic and run at the same rate to within parts per million, so a
      // negative round trip can only be rounding: it counts as 0.
      const int64_t rtt =
          std::max<int64_t>(0, (receivedNs - link->helloSentNs) - (hs.sentNs - hs.helloReceivedNs));
      const int64_t offset = (hs.helloReceivedNs - link->helloSentNs) - rtt / 2;
      link->clockSample = std::make_pair(offset, rtt);
      if (auto problem = adoptAnnouncedDevices(*link, hs)) return refuseLink(link, *problem);
      link->peer = hs.name;
      link->peerRank = registeredRank;
      link->peerNonce = std::move(hs.nonce);
      HandshakeMessage proof;
      proof.stage = kProof;
      proof.version = config_.protocolVersionForTesting;
      proof.offsetNs = offset;
      proof.rttNs = rtt;
      proof.mac = handshakeMac(options_.secret, kConnectorToAcceptor, link->nonce, link->peerNonce, name_, link->peer);
      link->step = HandshakeStep::kAwaitAccept;
      auto frame = encodeMessageWith(fields, proof);
      if (frame.ok()) sendOn(link, std::move(frame).value());
      return;
    }
    case kProof: {
      // Acceptor: the connector proves first, over both nonces and both names.
      auto expectedMac = handshakeMac(options_.secret, kConnectorToAcceptor, link->peerNonce, link->nonce, link->peer,
                                      name_);
      if (!detail::constantTimeEqual(expectedMac, hs.mac)) {
        return refuseLink(link, "HMAC mismatch: the peer does not know the cluster secret (DISTGRAD_SECRET)");
      }
      {
        // Note [Clock offsets]: the connector's estimate must follow from the hello's t0 and t1 we know.
        // Every trip of the handshake fits in its timeout, which also keeps this arithmetic in range.
        const int64_t maxRtt = std::chrono::duration_cast<std::chrono::nanoseconds>(handshakeTimeout()).count();
        const bool rttOk = hs.rttNs >= 0 && hs.rttNs <= maxRtt;
        const int64_t expectedOffset = rttOk ? (link->helloReceivedNs - link->peerHelloSentNs) - hs.rttNs / 2 : 0;
        if (!rttOk || hs.offsetNs != expectedOffset) {
          return refuseLink(link, "a proof whose clock estimate (offset " + std::to_string(hs.offsetNs) + " ns, rtt " +
                                      std::to_string(hs.rttNs) + " ns) does not follow from its hello's times " +
                                      "(expected rtt in [0, " + std::to_string(maxRtt) + "] and offset " +
                                      (rttOk ? std::to_string(expectedOffset) + " ns)" : "(hello arrival - hello sent) - rtt / 2)"));
        }
        link->clockSample = std::make_pair(-hs.offsetNs, hs.rttNs);
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        const Peer& peer = *peers_.at(link->peer);
        if (peer.link != nullptr || peer.dead) {
          return refuseLink(link, "a second connection from " + link->peer);
        }
      }
      // The accept is queued before the link is published, so no call can overtake it. Handshakes run on
      // this loop thread only, so nobody registers another link for this peer in between.
      HandshakeMessage accept;
      accept.stage = kAccept;
      accept.version = config_.protocolVersionForTesting;
      accept.mac = handshakeMac(options_.secret, kAcceptorToConnector, link->peerNonce, link->nonce, link->peer, name_);
      auto frame = encodeMessageWith(fields, accept);
      if (frame.ok()) sendOn(link, std::move(frame).value());
      if (!registerLink(link)) return refuseLink(link, "a second connection from " + link->peer);
      return;
    }
    case kAccept: {
      // Connector: the acceptor answers only after checking our proof; its MAC has the other direction.
      auto expectedMac = handshakeMac(options_.secret, kAcceptorToConnector, link->nonce, link->peerNonce, name_,
                                      link->peer);
      if (!detail::constantTimeEqual(expectedMac, hs.mac)) {
        return refuseLink(link, "HMAC mismatch: the peer does not know the cluster secret (DISTGRAD_SECRET)");
      }
      if (!registerLink(link)) return refuseLink(link, "a second connection to " + link->peer);
      return;
    }
    default:
      return;
  }
}

void Agent::onHello(const std::shared_ptr<Link>& link, const HandshakeMessage& hello) {
  if (link->closed || link->refused) return;
  std::optional<int> registeredRank;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(hello.name);
    if (it != peers_.end()) registeredRank = it->second->rank;
  }
  if (!registeredRank) {
    return refuseLink(link, "unknown worker '" + printable(hello.name) + "' (rank " + std::to_string(hello.rank) + ")");
  }
  if (*registeredRank != hello.rank) {
    return refuseLink(link, "worker '" + hello.name + "' claims rank " + std::to_string(hello.rank) +
                                " but registered rank " + std::to_string(*registeredRank), hello.name);
  }
  if (hello.rank >= options_.rank) {
    return refuseLink(link, "worker '" + hello.name + "' (rank " + std::to_string(hello.rank) +
                                ") opened a connection to this worker (rank " + std::to_string(options_.rank) +
                                "), but only a lower rank connects to a higher one", hello.name);
  }
  // Like any malformed field of an unauthenticated hello: the link is refused, the claimed worker's start
  // is not failed (anyone can send a hello naming it).
  if (auto problem = adoptAnnouncedDevices(*link, hello)) return refuseLink(link, *problem);
  link->peer = hello.name;
  link->peerRank = *registeredRank;
  link->peerNonce = hello.nonce;
  auto frame = introduction(kChallenge, *link);
  if (!frame.ok()) return refuseLink(link, "cannot encode the challenge: " + frame.error().message);
  if (hello.version != config_.protocolVersionForTesting) {
    // The challenge (which carries our version) goes out first, so the connector can name the mismatch too.
    return refuseLink(link, "protocol version " + std::to_string(hello.version) + ", this worker speaks " +
                                std::to_string(config_.protocolVersionForTesting), hello.name,
                      std::move(frame).value());
  }
  link->step = HandshakeStep::kAwaitProof;
  sendOn(link, std::move(frame).value());
}

std::optional<std::string> Agent::adoptAnnouncedDevices(Link& link, const HandshakeMessage& hs) const {
  if (hs.cudaDevices < 0 || hs.cudaDevices > kMaxCudaDevices) {
    return "a handshake announcing " + std::to_string(hs.cudaDevices) + " CUDA devices (expected [0, " +
           std::to_string(kMaxCudaDevices) + "])";
  }
  if (hs.deviceMap.size() > static_cast<size_t>(kMaxCudaDevices)) {
    return "a handshake announcing a device map of " + std::to_string(hs.deviceMap.size()) + " entries";
  }
  DeviceMap map;
  try {
    for (const auto& [from, to] : hs.deviceMap) {
      if (from < 0 || from >= kMaxCudaDevices || to < 0 || to >= kMaxCudaDevices) {
        return "a handshake announcing a device map entry cuda:" + std::to_string(from) + " -> cuda:" +
               std::to_string(to) + " (indices must be in [0, " + std::to_string(kMaxCudaDevices) + "))";
      }
      map.setIndex(static_cast<int>(from), static_cast<int>(to), "the peer's device map");
    }
  } catch (const ValueError& e) {
    return std::string("a handshake announcing an invalid device map: ") + e.what();
  }
  link.peerCudaDevices = static_cast<int>(hs.cudaDevices);
  link.peerDeviceMap = std::move(map);
  return std::nullopt;
}

std::shared_ptr<const DeviceMap> Agent::sendDeviceMap(const std::string& peer) const {
  if (peer == name_) return selfDeviceMap_;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = peers_.find(peer);
  return it == peers_.end() ? nullptr : it->second->sendMap;
}

std::optional<int> Agent::peerCudaDevices(const std::string& worker) const {
  if (worker == name_) return tensor::cuda::deviceCount();
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = peers_.find(worker);
  if (it == peers_.end()) return std::nullopt;
  return it->second->cudaDevices;
}

DeviceMap Agent::peerDeviceMap(const std::string& worker) const {
  if (worker == name_) return selfDeviceMap_ ? *selfDeviceMap_ : DeviceMap();
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = peers_.find(worker);
  return it == peers_.end() ? DeviceMap() : it->second->announcedMap;
}

void Agent::checkDeviceMaps() const {
  const int localDevices = tensor::cuda::deviceCount();
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [worker, map] : options_.deviceMaps) {
    int devices = localDevices;
    if (worker != name_) {
      auto it = peers_.find(worker);
      if (it == peers_.end()) {
        std::vector<std::string> names{name_};
        for (const auto& [name, peer] : peers_) names.push_back(name);
        DG_CHECK(false, "Agent::start: Options::deviceMaps names worker '", worker, "', which is not in the job (",
                 joinNames(names), ")");
      }
      if (!it->second->cudaDevices) continue;  // not handshaken yet: checked again once every peer is
      devices = *it->second->cudaDevices;
    }
    for (const auto& [from, to] : map.entries()) {
      DG_CHECK(to < devices, "Agent::start: the device map of ", name_, " for ", worker, " maps cuda:", from,
               " -> cuda:", to, " but ", worker, " has ", devices, " CUDA device(s)");
    }
  }
  // What the peers announced for this worker must fit here too (their own start checks the same).
  for (const auto& [name, peer] : peers_) {
    for (const auto& [from, to] : peer->announcedMap.entries()) {
      DG_CHECK(to < localDevices, "Agent::start: the device map of ", name, " for ", name_, " maps cuda:", from,
               " -> cuda:", to, " but ", name_, " has ", localDevices, " CUDA device(s)");
    }
  }
}

bool Agent::registerLink(const std::shared_ptr<Link>& link) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Peer& peer = *peers_.at(link->peer);
    if (peer.link != nullptr || peer.dead) return false;
    peer.link = link;
    link->ready = true;
    peer.lastSeenNanos.store(nowNanos(), std::memory_order_relaxed);
    if (link->clockSample) addClockSampleLocked(peer, link->clockSample->first, link->clockSample->second);
    peer.cudaDevices = link->peerCudaDevices;
    peer.announcedMap = link->peerDeviceMap;
    auto own = options_.deviceMaps.find(peer.name);
    if (own != options_.deviceMaps.end()) {
      peer.sendMap = std::make_shared<const DeviceMap>(own->second);
    } else if (!peer.announcedMap.empty()) {
      peer.sendMap = std::make_shared<const DeviceMap>(peer.announcedMap.inverse());
    }
    if (peer.sendMap) deviceMapsInUse_.store(true, std::memory_order_release);
  }
  link->step = HandshakeStep::kDone;
  if (link->handshakeTimer != kInvalidTimerId) timers_->cancel(link->handshakeTimer);
  changed_.notify_all();
  return true;
}

void Agent::onHeartbeat(const std::shared_ptr<Link>& link, const DecodedMessage& message) {
  const int64_t receivedNs = clockNs();  // Note [Clock offsets]: t3 of the round trip the echo closes
  auto decoded = message.decodeValue<HeartbeatMessage>();
  std::string problem;
  HeartbeatMessage beat;
  if (!decoded.ok()) {
    problem = "a malformed heartbeat: " + decoded.error().message;
  } else {
    beat = std::move(decoded).value();
    if (beat.sentNs <= 0) {
      problem = "a heartbeat with sentNs " + std::to_string(beat.sentNs) + " (expected > 0)";
    } else if (beat.echoNs < 0 || beat.echoReceivedNs < 0 || (beat.echoNs == 0) != (beat.echoReceivedNs == 0)) {
      problem = "a heartbeat echoing time " + std::to_string(beat.echoNs) + " received at " +
                std::to_string(beat.echoReceivedNs) + " (expected both 0 or both > 0)";
    } else if (beat.echoNs > receivedNs) {
      problem = "a heartbeat echoing time " + std::to_string(beat.echoNs) + ", later than this worker's clock (" +
                std::to_string(receivedNs) + ")";
    } else if (beat.echoReceivedNs > beat.sentNs) {
      problem = "a heartbeat sent at " + std::to_string(beat.sentNs) + " echoing a heartbeat it received later, at " +
                std::to_string(beat.echoReceivedNs);
    }
  }
  if (!problem.empty()) {
    warn("closing the connection with " + link->peer + ": " + problem);
    link->connection->close();
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = peers_.find(link->peer);
  if (it == peers_.end()) return;
  Peer& peer = *it->second;
  peer.lastHeartbeatSentNs = beat.sentNs;
  peer.lastHeartbeatReceivedNs = receivedNs;
  if (beat.echoNs == 0 || beat.echoNs == peer.lastEchoUsedNs) return;  // nothing new to learn
  // t0 = echoNs (ours), t1 = echoReceivedNs (theirs), t2 = sentNs (theirs), t3 = receivedNs (ours). All
  // differences are of non-negative values, so none overflows.
  const int64_t rtt = (receivedNs - beat.echoNs) - (beat.sentNs - beat.echoReceivedNs);
  if (rtt < 0) return;  // the clocks' rates differ over the interval (slewing): no usable sample
  peer.lastEchoUsedNs = beat.echoNs;
  addClockSampleLocked(peer, (beat.echoReceivedNs - beat.echoNs) - rtt / 2, rtt);
}

void Agent::addClockSampleLocked(Peer& peer, int64_t offsetNs, int64_t rttNs) {
  peer.clockSamples.emplace_back(offsetNs, rttNs);
  if (peer.clockSamples.size() > kClockWindow) peer.clockSamples.pop_front();
  ++peer.clockSampleCount;
  if (!trace::enabled()) return;
  auto best = std::min_element(peer.clockSamples.begin(), peer.clockSamples.end(),
                               [](const auto& a, const auto& b) { return a.second < b.second; });
  // The recorder's lock is a leaf: taking it under mutex_ cannot deadlock.
  trace::setClockOffset(traceSlot_, peer.name, peer.rank, best->first, best->second, peer.clockSampleCount);
}

std::optional<ClockOffset> Agent::clockOffset(const std::string& worker) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = peers_.find(worker);
  if (it == peers_.end() || it->second->clockSamples.empty()) return std::nullopt;
  const Peer& peer = *it->second;
  auto best = std::min_element(peer.clockSamples.begin(), peer.clockSamples.end(),
                               [](const auto& a, const auto& b) { return a.second < b.second; });
  return ClockOffset{best->first, best->second, peer.clockSampleCount};
}

void Agent::onLinkClosed(const std::shared_ptr<Link>& link, const Error& error) {
  bool wasReady = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    links_.erase(std::remove(links_.begin(), links_.end(), link), links_.end());
    link->closed = true;
    link->deferredHello.reset();
    wasReady = link->ready;
    if (!wasReady && !link->refused && !closed_ && !startError_ &&
        (!link->peer.empty() || !link->expectedPeer.empty())) {
      std::string who = link->peer.empty() ? link->expectedPeer : link->peer;
      startError_ = Error::disconnected("the connection with " + who + " closed during the handshake: " +
                                        error.message);
      startError_->worker = who;
    }
  }
  changed_.notify_all();
  if (link->handshakeTimer != kInvalidTimerId) timers_->cancel(link->handshakeTimer);
  if (wasReady) {
    Error down = Error::disconnected("the connection to " + link->peer + " closed: " + error.message);
    down.worker = link->peer;
    peerDown(link->peer, down);
  }
}

void Agent::peerDown(const std::string& peerName, const Error& error) {
  bool firstDeath = false;
  std::shared_ptr<Link> link;
  std::vector<uint64_t> calls;
  std::vector<CancellationSource> handlers;
  Error reason = error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(peerName);
    if (it == peers_.end()) return;
    Peer& peer = *it->second;
    if (!peer.dead) {
      peer.dead = true;
      peer.deadReason = error;
      firstDeath = true;
    }
    // Every call to a dead peer fails with the FIRST reason (e.g. the heartbeat timeout), also when the
    // link's close, which this death causes, reports it again from the loop thread and wins the race for
    // the pending calls.
    reason = *peer.deadReason;
    link = std::move(peer.link);
    for (const auto& [id, pending] : pending_) {
      if (pending->peer == peerName) calls.push_back(id);
    }
    for (const auto& [key, incoming] : incoming_) {
      if (key.first == peerName) handlers.push_back(incoming->source);
    }
  }
  changed_.notify_all();
  if (link) link->connection->close();
  for (uint64_t id : calls) failPending(id, reason, /*sendCancel=*/false);
  for (auto& source : handlers) source.cancel(reason);
  if (firstDeath) {
    for (auto& extension : extensionList()) extension->onPeerDown(peerName, reason);
  }
}

std::shared_ptr<AgentExtension> Agent::extension(const std::string& key,
                                                 const std::function<std::shared_ptr<AgentExtension>(Agent&)>& make) {
  std::lock_guard<std::mutex> lock(extensionsMutex_);
  auto it = extensions_.find(key);
  if (it != extensions_.end()) return it->second;
  DG_CHECK(!extensionsClosed_, "Agent::extension: agent ", name_, " is shut down (extension '", key, "')");
  auto made = make(*this);
  DG_CHECK(made != nullptr, "Agent::extension: the factory of '", key, "' returned nothing");
  extensions_.emplace(key, made);
  return made;
}

void Agent::rpcRaw(const CallOptions& callOptions, const std::string& worker, const std::string& functionName,
                   uint64_t signatureHash, const EncodeValueFn& encodeValue, RawCompletion complete) {
  const bool tracing = trace::enabled();
  trace::WorkerScope traceWorker(traceSlot_, tracing);
  CallTiming timing;
  EnvelopeFields fields;
  fields.kind = MessageKind::kCall;
  fields.messageId = nextMessageId_.fetch_add(1, std::memory_order_relaxed);
  fields.functionName = functionName;
  fields.signatureHash = signatureHash;
  prepareCall(callOptions, fields);
  const CodecScope scope = sendScope(worker, activeAutogradContext(), &callOptions);
  if (tracing) timing.serializeBeginNs = trace::nowNs();
  auto frame = encodeMessage(fields, encodeValue, &scope);
  if (tracing) timing.serializeEndNs = trace::nowNs();
  if (!frame.ok()) {
    complete(Result<DecodedMessage>(frame.error()));
    return;
  }
  startCall(callOptions, worker, fields, std::move(frame).value(), std::move(complete), timing, /*wait=*/nullptr);
}

// ---- calls ----

std::optional<Error> Agent::attachAutograd(DecodedMessage& message, const std::string& peer) {
  const auto& ids = message.fields().autograd;
  if (!ids || message.gradMetas().empty()) return std::nullopt;
  Error error = Error::failed("");
  if (!autogradHook_) {
    error.message = "worker " + name_ + " received tensors that require grad inside distributed autograd context " +
                    std::to_string(ids->contextId) + " from " + peer +
                    " but serves no distributed autograd (call autograd::distributed::install(registry) before "
                    "Agent::start on every worker)";
  } else {
    try {
      message.attachRecvNode(autogradHook_->onReceive(*ids, peer, message.gradMetas()));
      return std::nullopt;
    } catch (const std::exception& e) {
      error.message = e.what();
    }
  }
  error.worker = name_;
  return error;
}

std::chrono::milliseconds Agent::effectiveTimeout(const CallOptions& callOptions) const {
  return callOptions.timeout.count() == 0 ? options_.defaultTimeout : callOptions.timeout;
}

void Agent::prepareCall(const CallOptions& callOptions, EnvelopeFields& fields) const {
  auto timeout = effectiveTimeout(callOptions);
  if (timeout.count() > 0) {
    fields.timeoutMicros = std::chrono::duration_cast<std::chrono::microseconds>(timeout).count();
    fields.deadlineUnixMicros = unixMicros() + fields.timeoutMicros;
  }
}

void Agent::readWhileWaiting(const std::string& worker, const std::function<bool()>& ready) {
  const auto window = syncReadWindow();
  if (window.count() <= 0 || worker == name_ || ready()) return;
  SyncWait wait;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(worker);
    if (it == peers_.end() || it->second->dead || !it->second->link) return;
    wait.connection = it->second->link->connection;
  }
  if (!wait.connection->beginWaitingRead()) wait.connection = nullptr;
  wait.read(window, ready);
}

// Note [Serving reader]: Note [Waiting reader] (rpc/transport/tcp/connection.cpp) let a caller blocked in
// rpcSync read its reply itself; on the callee the call still went from the loop thread, which read it, to an
// executor worker, which ran it: a wake-up and a context switch more than a raw socket ping-pong's on one
// core (a sixth of a no-op rpcSync's round trip here), a wake-up of a sleeping CPU more across idle ones. So
// the worker that wrote the reply to the only call this agent was serving, a call that arrived while no other
// call was being served, like the caller's calls before it (kServeAfterCallsAlone in a row: the latency-bound
// case, one call at a time), becomes that connection's reader for serveReadWindow, waiting outside the
// executor's queue (Executor::beginOutsideWait, Note [Waiting outside the queue] in rpc/executor.cpp): the
// next call wakes it, the call it reads is queued without waking anyone (an inline function's runs right
// there: Note [Inline handlers]), and it returns to its task loop and runs that call at once. It takes the
// reader role before it writes the reply, as rpcSync's caller does before its send: on one core the caller,
// woken by the reply, preempts the worker and sends its next call before the worker could begin reading.
// Other work ends the wait: anything queued (posted by it or, with no other worker asleep, by another thread,
// which interrupts it), a closing connection, shutdown. A flood of calls leaves it out, so the loop keeps
// batching them: its calls arrive while others are served, and the few that arrive alone do not come in a row
// (measured: serving after any lone call cost a flood of 64 no-op calls in flight 10% of its throughput on
// one core). inproc refuses the read (beginWaitingRead), so nothing changes there; ucx drives its worker
// instead (Note [Driving threads] in rpc/transport/ucx/context.cpp).
void Agent::serveNextCall(SyncWait& serving) {
  DG_ASSERT(serving.connection != nullptr, "Agent::serveNextCall without the connection's reader role");
  const auto connection = serving.connection;
  if (!executor_->beginOutsideWait([connection] { connection->interruptWaitingRead(); })) return;
  OutsideWait outside{*executor_};
  serving.read(serveReadWindow(), [this] { return executor_->outsideWaitOver(); });
}

// Note [Reading for the answer]: Note [Serving reader] took the loop -> worker hand-off out of a call that
// is answered at once. A handler that forwards (an RRef's value fetched from its owner, a call passed on to
// a third worker) returns a future that a call it sent completes; the answer was read by the loop thread,
// which posted the reply's continuation to a worker: a wake-up of the loop and a hand-off to a worker more
// than an rpcSync chain has (bench_rref's fork_third_fetch). So the worker whose handler returned pending
// after sending exactly one call (to another worker) reads that call's connection for serveReadWindow,
// waiting outside the executor's queue as the serving reader does: the answer completes the call on this
// thread, the continuation it posts wakes nobody and ends the wait, and this worker runs it (the reply,
// written by itself). The read also ends once the call is no longer pending (the answer completed it
// without posting) and on anything else the serving reader stops for. It starts after the handler
// returned, not before the send as rpcSync's: a handler is user code that may go on computing, or block,
// after its send, and the connection must not go unread meanwhile.
void Agent::readForAnswer(std::shared_ptr<transport::Connection> connection, uint64_t id) {
  const auto window = serveReadWindow();
  if (window.count() <= 0) return;
  if (!executor_->beginOutsideWait([connection] { connection->interruptWaitingRead(); })) return;
  OutsideWait outside{*executor_};
  SyncWait wait;
  if (!connection->beginWaitingRead()) return;
  wait.connection = std::move(connection);
  wait.read(window, [this, id] {
    if (executor_->outsideWaitOver()) return true;
    std::lock_guard<std::mutex> lock(mutex_);
    return closed_ || !pending_.contains(id);
  });
}

void Agent::SyncWait::read(std::chrono::microseconds window, const std::function<bool()>& ready) {
  if (!connection) return;
  // The reply may be in already (a fast peer, or the send failed). Should the read throw, the destructor
  // still lets go.
  if (window.count() > 0 && !ready()) {
    Executor::wakeOwed();  // Note [Following the task] (rpc/executor.cpp): this thread may read for a while
    struct Reading {
      Reading() { tReadsConnection = true; }
      ~Reading() { tReadsConnection = false; }
    } reading;
    connection->readWhileWaiting(ready, window);
  }
  connection->endWaitingRead();
  connection.reset();
}

void Agent::startCall(const CallOptions& callOptions, const std::string& worker, const EnvelopeFields& fields,
                      transport::OutgoingFrame frame, Completion complete, const CallTiming& timing,
                      SyncWait* wait) {
  const uint64_t id = fields.messageId;
  const bool toSelf = worker == name_;  // Note [Self calls]
  // Decided once, when the call was encoded: a call is traced whole or not at all.
  const bool traced = timing.serializeBeginNs != 0;
  const char* traceName = traced ? trace::intern(fields.functionName) : nullptr;
  const uint64_t bytes = frameBytes(frame);
  int peerRank = -1;
  std::shared_ptr<Link> link;
  std::optional<Error> refusal;
  bool senderWrites = false;  // Note [Lone calls]
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(worker);
    if (closed_ || (!callsOpen_ && !executor_->isCurrentThread())) {
      refusal = Error::failed("agent " + name_ + " is shut down: call of '" + fields.functionName + "' on " +
                              worker + " refused");
    } else if (it == peers_.end() && !toSelf) {
      std::vector<std::string> names;
      for (const auto& [name, peer] : peers_) names.push_back(name);
      refusal = Error::failed("unknown worker '" + worker + "' (peers: " + joinNames(names) + ")");
    } else if (!toSelf && (it->second->dead || !it->second->link)) {
      refusal = it->second->deadReason.value_or(Error::disconnected("worker " + worker + " is not connected"));
      refusal->worker = worker;
    } else {
      Peer& peer = toSelf ? *self_ : *it->second;
      link = peer.link;
      auto pending = std::make_unique<Pending>();
      pending->peer = worker;
      pending->function = fields.functionName;
      pending->complete = std::move(complete);
      pending->traceName = traceName;
      pending->peerRank = peer.rank;
      pending->timeout = effectiveTimeout(callOptions);
      pending->waitBeginNs = timing.serializeEndNs;  // until the frame is queued (below)
      peerRank = peer.rank;
      pending_.emplace(id, std::move(pending));
      if (tHandlerCalls != nullptr && tHandlerCalls->agent == this) {  // Note [Reading for the answer]
        ++tHandlerCalls->count;
        tHandlerCalls->id = id;
        tHandlerCalls->connection = toSelf ? nullptr : link->connection;
      }
      peer.loneCallsSent = peer.pending == 0 ? peer.loneCallsSent + 1 : 0;
      senderWrites = peer.loneCallsSent >= kSenderWritesAfterLoneCalls;
      ++peer.pending;
      peer.callsSent.fetch_add(1, std::memory_order_relaxed);
      peer.bytesSent.fetch_add(bytes, std::memory_order_relaxed);
    }
  }
  if (refusal) {
    complete(Result<DecodedMessage>(std::move(*refusal)));
    return;
  }
  // Queue the call before arming the deadline and the cancel registration: frames leave in order, so a
  // cancel message (sent by either) can never overtake its call and reach the callee first. A self call is
  // registered as running (onCall) before deliverToSelf returns, which gives the same guarantee.
  if (toSelf) {
    deliverToSelf(std::move(frame), id);
  } else {
    // A failed send finds the worker's name in the call's Pending (if the call is still pending), so the
    // untraced callback captures 16 bytes and std::function stores it without an allocation.
    auto failed = [this, id](const Result<void>& sent) {
      std::string peer;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = pending_.find(id);
        if (it == pending_.end()) return;
        peer = it->second->peer;
      }
      Error error = Error::disconnected("sending to " + peer + " failed: " + sent.error().message);
      error.worker = peer;
      failPending(id, std::move(error), /*sendCancel=*/false);
    };
    // rpcSync: this thread becomes the connection's reader before the send (Note [Waiting reader] in
    // rpc/transport/tcp/connection.cpp), so that the reply cannot wake the loop thread first.
    if (wait != nullptr && syncReadWindow().count() > 0 && link->connection->beginWaitingRead()) {
      wait->connection = link->connection;
    }
    // Note [Lone calls]
    // An rpcSync's frame is written by the calling thread when the connection has nothing queued (Note
    // [Sender writes] in rpc/transport/tcp/connection.cpp): the caller waits, and waking the loop thread to
    // write it costs a context switch. Other calls that come one at a time are as latency-bound: rpcAsync
    // with one call in flight, the RRef layer's remote() and method calls followed by their wait (measured
    // on one core, bench_rref: remote()+toHere 1.64 -> 1.22x a no-op rpcSync, a method through an RRef
    // 1.49-1.53 -> 1.13-1.14x). So a call is written by its sender too once kSenderWritesAfterLoneCalls
    // calls in a row to the worker found none pending. A flood keeps the loop's batched writes: its calls
    // find others pending, and the one that finds none after a batch of replies stays alone. Writing that
    // one from the sender (any call finding none pending) cost rpcAsync at 8 and 64 in flight 7-14% on
    // one core: the callee was woken for that call alone, the batch broken in two.
    if (senderWrites) frame.fromSender = true;
    // Traced, its transport.send is part of the call's record (below).
    link->connection->send(std::move(frame), [failed](const Result<void>& sent) {
      if (!sent.ok()) failed(sent);
    });
  }
  const int64_t sentNs = traced ? trace::nowNs() : 0;
  if (traced) {
    trace::RpcRecord record;
    record.site = trace::RpcSite::kClientSend;
    record.t[0] = timing.serializeBeginNs;
    record.t[1] = timing.serializeEndNs;
    record.t[2] = sentNs;
    record.bytes = static_cast<int64_t>(bytes);
    record.call = id;
    record.flow = trace::callFlowId(options_.rank, id);
    record.function = traceName;
    record.peer = peerRank;
    record.flags = toSelf ? 0 : trace::kRpcToTransport;
    trace::recordRpc(record);
  }
  auto timeout = effectiveTimeout(callOptions);
  if (timeout.count() > 0) {
    // The callback captures only the id (stored in place, no allocation per call); the names and the
    // timeout for its message are in the Pending.
    // Traced, the deadline counts from the send's clock read (the trace clock is the timers' steady clock
    // to within microseconds: one read fewer per traced call).
    const auto deadline = traced ? SteadyTime::time_point(std::chrono::nanoseconds(sentNs)) + timeout
                                 : SteadyTime::now() + timeout;
    TimerId timer = timers_->schedule(deadline, [this, id] {
      Error error = Error::timeout("");
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = pending_.find(id);
        if (it == pending_.end()) return;  // completed as the timer fired
        const Pending& pending = *it->second;
        error.message = "rpc '" + pending.function + "' exceeded its " + std::to_string(pending.timeout.count()) +
                        " ms deadline";
        error.worker = pending.peer;
      }
      failPending(id, std::move(error), /*sendCancel=*/true);
    });
    bool armed = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = pending_.find(id);
      if (it != pending_.end()) {
        it->second->timer = timer;
        if (traced) it->second->waitBeginNs = sentNs;
        armed = true;
      }
    }
    // The reply (or a failure) already took the call: its completion could not see this timer, so cancel
    // it here rather than leave it queued (holding its captures) until the deadline.
    if (!armed && timer != kInvalidTimerId) timers_->cancel(timer);
  } else if (traced) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(id);
    if (it != pending_.end()) it->second->waitBeginNs = sentNs;
  }
  {
    // A default token never calls back; a cancelled one calls back at once (inline).
    CancellationRegistration registration = callOptions.cancel.onCancel([this, id, worker](const Error& reason) {
      Error error = reason;
      if (error.worker.empty()) error.worker = worker;
      failPending(id, std::move(error), /*sendCancel=*/true);
    });
    // Nothing to keep for a default token (the common case) or a callback that already ran: skip the lock.
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    if (registration.active()) lock.lock();
    auto it = lock.owns_lock() ? pending_.find(id) : pending_.end();
    if (it != pending_.end()) {
      it->second->cancelRegistration = std::move(registration);
    } else if (lock.owns_lock()) {
      lock.unlock();  // the registration dies here, outside the lock
    }
  }
}

std::unique_ptr<Agent::Pending> Agent::takePending(uint64_t id, const std::string* fromPeer) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pending_.find(id);
  if (it == pending_.end()) return nullptr;
  if (fromPeer != nullptr && it->second->peer != *fromPeer) return nullptr;  // not this peer's call
  auto pending = std::move(it->second);
  pending_.erase(it);
  if (Peer* peer = peerLocked(pending->peer)) --peer->pending;
  if (pending_.empty()) changed_.notify_all();
  return pending;
}

void Agent::failPending(uint64_t id, Error error, bool sendCancel) {
  auto pending = takePending(id);
  if (!pending) return;
  if (pending->traceName != nullptr && trace::enabled()) {
    trace::WorkerScope traceWorker(traceSlot_);  // any thread: the loop's, a timer's, a canceller's
    // a2: 1 + the ErrorKind that ended the wait (0 = a reply came).
    const int64_t endNs = trace::nowNs();  // the wait's start is clamped as for a reply (onReply)
    trace::recordAsync("rpc.client.wait", trace::Category::kRpcClient, std::min(pending->waitBeginNs, endNs), endNs,
                       {pending->peerRank, static_cast<int64_t>(id), 1 + static_cast<int64_t>(error.kind)}, 0,
                       pending->traceName);
  }
  if (pending->timer != kInvalidTimerId) timers_->cancel(pending->timer);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Peer* peer = peerLocked(pending->peer)) peer->errors.fetch_add(1, std::memory_order_relaxed);
  }
  if (sendCancel) {
    EnvelopeFields fields;
    fields.kind = MessageKind::kCancel;
    fields.messageId = id;
    fields.functionName = pending->function;
    auto frame = encodeMessageWith(fields, static_cast<int64_t>(error.kind));
    if (frame.ok()) sendFrame(pending->peer, std::move(frame).value(), id);
  }
  pending->complete(Result<DecodedMessage>(std::move(error)));
}

void Agent::onReply(const std::string& peer, DecodedMessage message, Arrival arrival) {
  const uint64_t id = message.fields().messageId;
  auto pending = takePending(id, &peer);
  // Traced when the call was and tracing is still on: one record (trace::RpcSite::kClientReply) for the
  // frame's arrival, the wait until then and the span of its decoding and completion, which ends the call's
  // flow. Otherwise a traced frame is only a transport.recv.
  const bool traced = pending && pending->traceName != nullptr && arrival.ns != 0;
  if (!traced && arrival.ns != 0 && arrival.fromTransport) {
    trace::recordInstant("transport.recv", trace::Category::kTransport, arrival.ns,
                         {static_cast<int64_t>(arrival.bytes), arrival.peerRank});
  }
  if (!pending) return;  // it timed out or was cancelled before the reply came
  trace::RpcRecord record;
  if (traced) {
    record.site = trace::RpcSite::kClientReply;
    // The sender stamps the wait's start after its send returned; a sender preempted there can stamp it
    // after the reply's arrival was stamped on another thread. The wait then began no later than that.
    record.t[0] = std::min(pending->waitBeginNs, arrival.ns);
    record.t[1] = arrival.ns;
    record.bytes = static_cast<int64_t>(arrival.bytes);
    record.call = id;
    record.flow = trace::callFlowId(options_.rank, id);
    record.function = pending->traceName;
    record.peer = pending->peerRank;
    record.status = message.kind() == MessageKind::kError && message.fields().error
                        ? static_cast<uint8_t>(1 + static_cast<int>(message.fields().error->kind))
                        : 0;
    record.flags = arrival.fromTransport ? trace::kRpcFromTransport : 0;
  }
  auto complete = [&](Result<DecodedMessage>&& result) {
    pending->complete(std::move(result));
    if (traced) {
      record.t[2] = trace::nowNs();
      trace::recordRpc(record);
    }
  };
  message.setScope(CodecScope{this, peer});
  if (pending->timer != kInvalidTimerId) timers_->cancel(pending->timer);
  if (auto refused = attachAutograd(message, peer)) {
    complete(Result<DecodedMessage>(std::move(*refused)));
    return;
  }
  if (message.kind() == MessageKind::kError) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Peer* peer = peerLocked(pending->peer)) peer->errors.fetch_add(1, std::memory_order_relaxed);
  }
  complete(Result<DecodedMessage>(std::move(message)));
}

void Agent::onCancel(const std::string& peer, const DecodedMessage& message) {
  std::optional<CancellationSource> source;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = incoming_.find({peer, message.fields().messageId});
    if (it != incoming_.end()) source = it->second->source;
  }
  if (!source) return;
  auto kind = message.decodeValue<int64_t>();
  bool timedOut = kind.ok() && kind.value() == static_cast<int64_t>(ErrorKind::kTimeout);
  Error reason = timedOut ? Error::timeout("the caller's deadline expired") : Error::cancelled("the caller cancelled");
  reason.worker = peer;
  source->cancel(std::move(reason));
}

void Agent::onCallDeadline(const std::string& peer, uint64_t id, int64_t timeoutMicros) {
  std::optional<CancellationSource> source;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = incoming_.find({peer, id});
    if (it == incoming_.end()) return;  // the handler finished as the timer fired
    it->second->timer = kInvalidTimerId;
    source = it->second->source;
  }
  Error reason = Error::timeout("the call's deadline (" + std::to_string(timeoutMicros / 1000) +
                                " ms from its arrival) expired on the callee " + name_);
  reason.worker = peer;
  source->cancel(std::move(reason));
}

// Note [Inline handlers]: the thread rules (docs/thread_model.md) keep user code off the transport's loop
// thread: a call decoded there is queued for an executor worker, and that worker's reply is handed back to
// the loop to be written. On the callee, a no-op call thus costs two thread hand-offs (loop -> worker ->
// loop), each a wake-up and a context switch of several microseconds: a third of a no-op rpcSync's round
// trip here (bench_rpc, rpcsync_rtt_noop vs rpcsync_rtt_noop_inline). A function bound with
// Dispatch::kInline opts out for short handlers that never block (control messages, table lookups, a
// value already at hand): the handler runs right here on the loop thread and its reply is queued on the
// connection from the loop, so it leaves with the loop's next write and the callee wakes no thread.
// The cost is that it holds up every connection of the loop while it runs, so the default stays the
// executor. A blocking wait for a future that is not ready would stall the loop that may have to deliver
// it: inside an inline handler it throws instead (detail::ForbidBlockingScope), which the caller gets as
// the call's error. What inline does not change: the checks (unknown function, signature, autograd
// context), deadlines, cancellation tokens, tracing, and the reply path. Self calls are not decoded on a
// loop thread: they run on the executor as usual. A call decoded by a thread that reads its connection
// instead of the loop (tcp: a caller waiting in rpcSync, Note [Waiting reader]; a worker reading for the
// next call, Note [Serving reader]) runs inline there too, under the same no-blocking rule: where an
// inline handler runs never decides whether it may block.
//
// Note [Batched hand-offs]: the frames of one read reach onFrame one after the other on the loop thread.
// Posting each call to the executor as it is decoded woke a worker for the first one, and on a busy (or
// the one) core the woken worker preempted the loop at once, ran that one call, posted its reply, found
// the queue empty and slept again: two context switches, a futex wake and wait and a loop wake-up per
// call instead of per read. So on the loop thread calls are queued with Executor::postDeferred and the
// worker is woken once, by a task deferred to the loop (Context::defer), which runs after the read's
// frames are handled and before the loop next blocks (the tcp loop runs its tasks before it blocks).
// Refusals still answer at once; calls that do not arrive on the loop thread (self calls from other
// threads) are posted as before.
void Agent::onCall(const std::shared_ptr<Link>& link, DecodedMessage message, Arrival arrival) {
  const std::string peerName = link ? link->peer : name_;  // no link: a call of this agent to itself
  const uint64_t id = message.fields().messageId;
  // Traced when tracing was on as the frame arrived: deserialize (up to here), queue, execute, await,
  // serialize and send of the reply, with the call's flow (started by the caller) stepping at execute.
  const char* traceName = arrival.ns != 0 ? trace::intern(message.fields().functionName) : nullptr;
  const int callerRank = link ? link->peerRank : options_.rank;
  // Decoded now; the call is queued for the executor right after (one clock read for both).
  const int64_t queuedNs = traceName != nullptr ? trace::nowNs() : 0;
  if (traceName != nullptr) {
    trace::RpcRecord record;  // transport.recv and rpc.server.deserialize
    record.site = trace::RpcSite::kServerArrive;
    record.t[0] = arrival.ns;
    record.t[1] = queuedNs;
    record.bytes = static_cast<int64_t>(arrival.bytes);
    record.call = id;
    record.function = traceName;
    record.peer = callerRank;
    record.flags = arrival.fromTransport ? trace::kRpcFromTransport : 0;
    trace::recordRpc(record);
  }
  CancellationToken token;
  std::optional<Error> refusal;
  bool duplicateId = false;
  bool arrivedAlone = false;  // Note [Serving reader]: one call at a time from this caller, for a while
  std::shared_ptr<const BoundFunction> entry = registry_.find(message.fields().functionName);
  const bool inlineCall = entry && entry->dispatch == Dispatch::kInline;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    Peer* caller = peerLocked(peerName);
    caller->callsReceived.fetch_add(1, std::memory_order_relaxed);
    if (!accepting_ || closed_) {
      refusal = Error::failed("worker " + name_ + " is shutting down");
    } else {
      auto incoming = std::make_unique<Incoming>();
      token = incoming->source.token();
      Incoming* running = incoming.get();
      // A peer reusing the id of a call still running would orphan that call's cancellation and reply:
      // a protocol violation, answered by closing the link.
      duplicateId = !incoming_.emplace(std::make_pair(peerName, id), std::move(incoming)).second;
      incomingCount_.store(incoming_.size(), std::memory_order_relaxed);
      // An inline call (a control message) arriving beside a running call says nothing of a flood, and its
      // reply never leaves from a worker: it leaves the count alone.
      // A call whose predecessor's reply is still being written counts as alone: the caller sent it on
      // that reply (two cores: before the worker that wrote it took its entry out).
      const bool alone = incoming_.size() - replying_.load(std::memory_order_relaxed) == 1;
      if (!inlineCall) caller->callsAlone = alone ? caller->callsAlone + 1 : 0;
      arrivedAlone = caller->callsAlone >= kServeAfterCallsAlone;
      const int64_t timeoutMicros = message.fields().timeoutMicros;
      if (!duplicateId && timeoutMicros > 0 && link) {
        // The callee's own deadline, from the call's arrival: if the caller's cancel message never comes
        // (caller partitioned or dead but not yet detected), the handler's token still fires. It is a
        // backstop, so it fires a grace period after the deadline: the caller's timer (and its cancel
        // message) normally decides, and a handler that stops at its token does not race a reply against
        // the caller's timeout. Self calls need none (the caller's deadline cannot get lost in-process).
        // Armed under mutex_ so the reply (which takes the Incoming under it) always sees the timer id.
        const auto timeout = std::chrono::microseconds(timeoutMicros);
        const auto grace = std::max<std::chrono::microseconds>(kCalleeDeadlineGrace, timeout / 20);
        // The callback names the caller through its Peer (peers_ is fixed after start), so its captures fit
        // the timer's callback in place: no allocation per call.
        // Traced, from the arrival's clock read (the trace clock is the timers' to within microseconds).
        const auto from = queuedNs != 0 ? SteadyTime::time_point(std::chrono::nanoseconds(queuedNs)) : SteadyTime::now();
        running->timer = timers_->schedule(from + timeout + grace, [this, name = &caller->name, id, timeoutMicros] {
          onCallDeadline(*name, id, timeoutMicros);
        });
      }
    }
  }
  // A response to a call of an autograd context belongs to it too (its grad tensors flow back).
  const uint64_t autogradContext = message.fields().autograd ? message.fields().autograd->contextId : 0;
  // CUDA tensors over RPC: the reply goes back through the inverse of the map the call came with (and with
  // no map when the call carried none: a CUDA result is then refused naming the device).
  std::shared_ptr<const DeviceMap> replyMap =
      message.fields().deviceMap.empty() ? nullptr : std::make_shared<const DeviceMap>(message.fields().deviceMap.inverse());
  auto reply = [this, link, arrivedAlone, peerName, id, autogradContext, fn = message.fields().functionName, traceName,
                callerRank, replyMap = std::move(replyMap)](Result<EncodeValueFn>&& result,
                                                            const ExecuteTimes* executed = nullptr) {
    // `executed`: the times of a handler that just returned on this thread (its invoked time is when
    // encoding began: one read fewer), recorded with the reply's in one record
    // (trace::RpcSite::kServerHandled).
    const int64_t serializeBeginNs = traceName == nullptr     ? 0
                                     : executed != nullptr ? executed->invokedNs
                                                           : trace::nowNs();
    EnvelopeFields fields;
    fields.messageId = id;
    fields.functionName = fn;
    Result<transport::OutgoingFrame> frame = Error::failed("unset");
    if (result.ok()) {
      fields.kind = MessageKind::kResponse;
      CodecScope scope = sendScope(peerName, autogradContext);
      scope.deviceMap = replyMap;
      frame = encodeMessage(fields, result.value(), &scope);
    }
    if (!result.ok() || !frame.ok()) {
      Error error = result.ok() ? frame.error() : result.error();
      if (error.worker.empty()) error.worker = name_;
      fields.kind = MessageKind::kError;
      fields.error = std::move(error);
      frame = encodeMessage(fields);
    }
    const int64_t serializeEndNs = traceName != nullptr ? trace::nowNs() : 0;
    // The reply to the only call this agent is serving is written by the worker itself (Note [Sender
    // writes] in rpc/transport/tcp/connection.cpp): a latency-bound caller waits on it. With more calls
    // running, replies go to the loop, which writes those of a batch together.
    const bool onlyCall = executor_->isCurrentThread() && incomingCount_.load(std::memory_order_relaxed) == 1;
    if (frame.ok()) frame.value().fromSender = onlyCall;
    SyncWait serving;  // Note [Serving reader]: this worker reads the caller's next call
    if (onlyCall && arrivedAlone && frame.ok() && link && serveReadWindow().count() > 0 &&
        link->connection->beginWaitingRead()) {
      serving.connection = link->connection;
    }
    if (onlyCall) replying_.fetch_add(1, std::memory_order_relaxed);
    const int64_t bytes = frame.ok() ? static_cast<int64_t>(frameBytes(frame.value())) : 0;
    const bool queued = frame.ok() && sendFrame(peerName, std::move(frame).value(), id, /*traceSend=*/traceName == nullptr);
    const int64_t sentNs = traceName != nullptr ? trace::nowNs() : 0;
    std::unique_ptr<Incoming> done;
    bool serveNext = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = incoming_.find({peerName, id});
      if (it != incoming_.end()) {
        done = std::move(it->second);
        incoming_.erase(it);
        incomingCount_.store(incoming_.size(), std::memory_order_relaxed);
      }
      if (onlyCall) replying_.fetch_sub(1, std::memory_order_relaxed);
      if (incoming_.empty()) changed_.notify_all();
      serveNext = serving.connection && queued && incoming_.empty() && accepting_ && !closed_;
    }
    // Recorded once the call is taken out: the first record of a thread may allocate and lock (its buffer,
    // the name table), which must not hold up the bookkeeping the next call's arrival looks at (Note
    // [Serving reader]: a call that finds this one still in the table does not count as alone; with the
    // record before it, 1 run in 6 of AgentTraceTest.OneCallAtATimeIsReadByTheWorkerThatAnsweredThe-
    // PreviousOne started serving late). The agent's threads are joined before its trace is written.
    if (traceName != nullptr) {
      trace::RpcRecord record;  // rpc.server.serialize and rpc.server.send (and queue and execute before them)
      if (executed != nullptr) {
        record.site = trace::RpcSite::kServerHandled;
        record.t[0] = executed->queuedNs;
        record.t[1] = executed->startNs;
        record.t[2] = serializeBeginNs;
        record.t[3] = serializeEndNs;
        record.t[4] = sentNs;
        record.flow = trace::callFlowId(callerRank, id);
      } else {
        record.site = trace::RpcSite::kServerReply;
        record.t[0] = serializeBeginNs;
        record.t[1] = serializeEndNs;
        record.t[2] = sentNs;
      }
      record.bytes = bytes;
      record.call = id;
      record.function = traceName;
      record.peer = callerRank;
      record.flags = queued ? trace::kRpcToTransport : 0;
      trace::recordRpc(record);
    }
    if (done && done->timer != kInvalidTimerId) timers_->cancel(done->timer);
    if (serveNext) serveNextCall(serving);
  };
  if (duplicateId) {
    warn("closing the connection with " + peerName + ": it reused call id " + std::to_string(id) +
         " while that call is still running");
    DG_ASSERT(link != nullptr, "a call of agent ", name_, " to itself reused call id ", id);
    link->connection->close();
    return;
  }
  if (refusal) {
    reply(Result<EncodeValueFn>(std::move(*refusal)));
    return;
  }
  auto task = [this, peerName, token, reply, entry, message = std::move(message), traceName, callerRank,
               queuedNs]() mutable {
    const int64_t startNs = traceName != nullptr ? trace::nowNs() : 0;
    const auto& fields = message.fields();
    // The queue wait of a call refused before its handler ran (its execute and queue are one record
    // otherwise, made once the handler returned).
    auto refuse = [&](Error error) {
      if (traceName != nullptr) {
        trace::recordAsync("rpc.server.queue", trace::Category::kRpcServer, queuedNs, startNs,
                           {callerRank, static_cast<int64_t>(fields.messageId)}, 0, traceName);
      }
      reply(Result<EncodeValueFn>(std::move(error)));
    };
    if (!entry) {
      Error error = Error::unimplemented("no function '" + fields.functionName + "' on " + name_);
      error.worker = name_;
      return refuse(std::move(error));
    }
    if (entry->hash != fields.signatureHash) {
      Error error = Error::unimplemented("function '" + fields.functionName + "' on " + name_ +
                                         " has signature " + entry->signature +
                                         ", which does not match the caller's (signature hash differs)");
      error.worker = name_;
      return refuse(std::move(error));
    }
    message.setScope(CodecScope{this, peerName});
    if (auto refused = attachAutograd(message, peerName)) return refuse(std::move(*refused));
    CallContext ctx;
    ctx.agent = this;
    ctx.caller = peerName;
    ctx.callee = name_;
    ctx.function = fields.functionName;
    ctx.messageId = fields.messageId;
    ctx.token = token;
    ctx.timeout = std::chrono::microseconds(fields.timeoutMicros);
    ctx.autogradContext = fields.autograd ? fields.autograd->contextId : 0;
    // Note [Reading for the answer]: a task on a worker (not an inline call run where it was read).
    HandlerCalls calls(this);
    const bool onWorker = executor_->isCurrentThread() && !tReadsConnection;
    Future<EncodeValueFn> result = [&] {
      // The handler's synchronous part runs inside the call's autograd context (nested calls carry it on).
      AutogradContextScope active(ctx.autogradContext);
      struct Counting {
        HandlerCalls* previous;
        explicit Counting(HandlerCalls* calls) : previous(tHandlerCalls) { tHandlerCalls = calls; }
        ~Counting() { tHandlerCalls = previous; }
      } counting(onWorker ? &calls : nullptr);
      return entry->invoke(message, ctx, *executor_);
    }();
    const int64_t invokedNs = traceName != nullptr ? trace::nowNs() : 0;
    if (result.isReady()) {
      // A synchronous handler (or an async one that finished already): we are on an executor thread
      // inside this task, so encode and send the reply here instead of posting a continuation for it.
      // This is not a continuation running inline (the task consumes its own ready result), and it
      // saves one executor round trip (and often a worker wake-up) per call. Traced, its execution is
      // recorded with the reply (one record instead of two).
      const ExecuteTimes executed{queuedNs, startNs, invokedNs};
      reply(result.result(), traceName != nullptr ? &executed : nullptr);
      return;
    }
    if (traceName != nullptr) {
      trace::RpcRecord record;  // rpc.server.queue and rpc.server.execute
      record.site = trace::RpcSite::kServerExecute;
      record.t[0] = queuedNs;
      record.t[1] = startNs;
      record.t[2] = invokedNs;
      record.call = fields.messageId;
      record.flow = trace::callFlowId(callerRank, fields.messageId);
      record.function = traceName;
      record.peer = callerRank;
      trace::recordRpc(record);
    }
    // Still running: the reply (which encodes the value) is a normal continuation on the executor, never
    // on the thread that completes the handler's future (that may be a transport loop thread).
    (void)result.then([reply, traceName, callerRank, invokedNs, id = fields.messageId](Result<EncodeValueFn>&& r) mutable {
      if (traceName != nullptr && trace::enabled()) {
        trace::recordAsync("rpc.server.await", trace::Category::kRpcServer, invokedNs, trace::nowNs(),
                           {callerRank, static_cast<int64_t>(id)}, 0, traceName);
      }
      reply(std::move(r));
    });
    if (calls.count == 1 && calls.connection) readForAnswer(std::move(calls.connection), calls.id);
  };
  // Note [Batched hand-offs]: on the loop thread the worker is woken once per batch of frames.
  const bool onLoop = context_ && context_->inLoop();
  if ((onLoop || tReadsConnection) && inlineCall) {
    // Note [Inline handlers].
    detail::ForbidBlockingScope noBlocking;
    task();
    return;
  }
  if (!(onLoop ? executor_->postDeferred(std::move(task)) : executor_->post(std::move(task)))) {
    reply(Result<EncodeValueFn>(Error::failed("worker " + name_ + " is shutting down")));
    return;
  }
  if (onLoop && !executorWakeOwed_) {
    try {
      context_->defer([this] {
        executorWakeOwed_ = false;
        executor_->wakeDeferred();
      });
      executorWakeOwed_ = true;
    } catch (...) {
      executor_->wakeDeferred();  // the loop refused the task (a closed context): wake now instead
    }
  }
}

bool Agent::sendFrame(const std::string& peerName, transport::OutgoingFrame frame, uint64_t callId, bool traceSend) {
  if (peerName == name_) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) return false;
    }
    deliverToSelf(std::move(frame), callId);
    return false;
  }
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = peers_.find(peerName);
    if (it == peers_.end() || !it->second->link || closed_) return false;
    link = it->second->link;
    it->second->bytesSent.fetch_add(frameBytes(frame), std::memory_order_relaxed);
  }
  sendOn(link, std::move(frame), traceSend);
  return true;
}

void Agent::sendOn(const std::shared_ptr<Link>& link, transport::OutgoingFrame frame, bool traceSend) {
  // `ready` and `peerRank` were set on the loop thread before the link was published under mutex_, which
  // every caller took to find the link (the loop thread itself wrote them). transport.send is recorded
  // when the frame is queued, on the queueing thread (docs/tracing.md): a completion callback recording it
  // would cost a clock read on the loop thread and, for a call, an allocation (its captures outgrow
  // std::function's inline storage).
  const int64_t bytes = traceSend && link->ready && trace::enabled() ? static_cast<int64_t>(frameBytes(frame)) : -1;
  link->connection->send(std::move(frame), [](const Result<void>&) {});
  if (bytes >= 0) trace::instant("transport.send", trace::Category::kTransport, {bytes, link->peerRank});
}

// ---- calls of this agent to itself ----

// Note [Self calls]: a call to this agent's own name has the semantics of a remote call without a
// transport. startCall registers it as pending (counted in self_'s metrics) and hands the encoded frame to
// deliverToSelf, which decodes it as a received frame would be (decodeLoopback copies the tensor payloads,
// so the handler gets its own values) and feeds it to the same paths a link's frames take: onCall
// registers the running call and posts the handler to the executor (it never runs inline in the caller),
// its reply comes back through sendFrame -> deliverToSelf -> onReply, and a deadline or cancel reaches the
// handler's token through onCancel. Deadlines, cancellation, errors and shutdown draining are therefore the
// same as for peers. Only a handler's cancellation callbacks are posted to the executor here (a remote
// callee runs them on its loop thread), so they never run inside the caller's CancellationSource::cancel().
void Agent::deliverToSelf(transport::OutgoingFrame frame, uint64_t callId) {
  const int64_t arrivalNs = trace::enabled() ? trace::nowNs() : 0;
  const uint64_t bytes = frameBytes(frame);
  auto decoded = decodeLoopback(std::move(frame));
  if (!decoded.ok()) {
    // Our own encoding failed to decode: a bug, but the call must still end (not wait for its deadline).
    warn("a message of " + name_ + " to itself does not decode: " + decoded.error().message);
    failPending(callId, decoded.error(), /*sendCancel=*/false);
    return;
  }
  self_->bytesReceived.fetch_add(bytes, std::memory_order_relaxed);
  DecodedMessage message = std::move(decoded).value();
  const Arrival arrival{arrivalNs, bytes};
  bindReferences(message, name_);
  switch (message.kind()) {
    case MessageKind::kCall:
      onCall(nullptr, std::move(message), arrival);
      break;
    case MessageKind::kResponse:
    case MessageKind::kError:
      onReply(name_, std::move(message), arrival);
      break;
    case MessageKind::kCancel: {
      auto shared = std::make_shared<DecodedMessage>(std::move(message));
      (void)executor_->post([this, shared] { onCancel(name_, *shared); });  // refused only by teardown,
      break;                                                               // which cancels every handler
    }
    default:
      warn(std::string("ignoring a ") + messageKindName(message.kind()) + " message of " + name_ + " to itself");
      break;
  }
}

Agent::Peer* Agent::peerLocked(const std::string& worker) const {
  if (worker == name_) return self_.get();
  auto it = peers_.find(worker);
  return it == peers_.end() ? nullptr : it->second.get();
}

// ---- heartbeats ----

void Agent::heartbeat() {
  const int64_t now = nowNanos();
  const int64_t limit = std::chrono::duration_cast<std::chrono::nanoseconds>(options_.heartbeatTimeout).count();
  std::vector<std::pair<std::string, int64_t>> silent;
  // Each live link with what its heartbeat echoes (Note [Clock offsets]).
  std::vector<std::pair<std::shared_ptr<Link>, HeartbeatMessage>> alive;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    for (const auto& [name, peer] : peers_) {
      if (!peer->link || peer->dead) continue;
      int64_t quiet = now - peer->lastSeenNanos.load(std::memory_order_relaxed);
      if (quiet > limit) {
        silent.emplace_back(name, quiet / 1'000'000);
      } else {
        HeartbeatMessage beat;
        beat.echoNs = peer->lastHeartbeatSentNs;
        beat.echoReceivedNs = peer->lastHeartbeatReceivedNs;
        alive.emplace_back(peer->link, beat);
      }
    }
  }
  for (const auto& [name, quietMs] : silent) {
    Error error = Error::disconnected("worker " + name + " sent nothing for " + std::to_string(quietMs) +
                                      " ms (heartbeat timeout " + std::to_string(options_.heartbeatTimeout.count()) +
                                      " ms): declared dead");
    error.worker = name;
    warn(error.message);
    peerDown(name, error);
  }
  EnvelopeFields fields;
  fields.kind = MessageKind::kHeartbeat;
  for (auto& [link, beat] : alive) {
    beat.sentNs = clockNs();
    auto frame = encodeMessageWith(fields, beat);
    if (frame.ok()) sendOn(link, std::move(frame).value());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!closed_) heartbeatTimer_ = timers_->scheduleAfter(options_.heartbeatInterval, [this] { heartbeat(); });
}

// ---- shutdown ----

PeerMetrics Agent::metrics(const std::string& worker) const {
  PeerMetrics m;
  std::shared_ptr<transport::Connection> connection;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const Peer* found = peerLocked(worker);
    DG_CHECK(found != nullptr, "Agent::metrics: unknown worker '", worker, "'");
    const Peer& peer = *found;
    m.callsSent = peer.callsSent.load();
    m.callsReceived = peer.callsReceived.load();
    m.bytesSent = peer.bytesSent.load();
    m.bytesReceived = peer.bytesReceived.load();
    m.errors = peer.errors.load();
    m.pending = peer.pending;
    if (peer.link) connection = peer.link->connection;
    m.connected = worker == name_ ? !closed_ : peer.link != nullptr && !peer.dead;
  }
  if (connection) {
    m.framesWrittenBySender = connection->framesWrittenBySender();
    m.lanes = connection->lanes();  // may wait for the loop thread, whose callbacks take mutex_
  }
  return m;
}

size_t Agent::pendingCalls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pending_.size();
}

size_t Agent::runningHandlers() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return incoming_.size();
}

void Agent::storeBarrier(const std::string& tag, std::chrono::milliseconds bound, bool onlyStoreHostWaits) {
  const auto deadline = bound.count() > 0 ? SteadyTime::now() + bound : SteadyTime::time_point::max();
  std::chrono::milliseconds poll(5);
  const std::string prefix = config_.storePrefix + "/" + tag + "/";
  store_->set(prefix + std::to_string(options_.rank), "1");
  if (onlyStoreHostWaits && !storeServer_) return;
  std::vector<int> missing;
  for (int r = 0; r < options_.worldSize; ++r) {
    if (r != options_.rank) missing.push_back(r);
  }
  while (true) {
    std::vector<int> still;
    for (int r : missing) {
      if (!store_->check({prefix + std::to_string(r)})) still.push_back(r);
    }
    missing = std::move(still);
    if (missing.empty()) return;
    std::vector<std::string> names;
    bool allDead = true;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (int r : missing) {
        std::string name = "rank " + std::to_string(r);
        bool dead = false;
        for (const auto& [peerName, peer] : peers_) {
          if (peer->rank == r) {
            name = peerName;
            dead = peer->dead;
          }
        }
        allDead = allDead && dead;
        names.push_back(name);
      }
    }
    if (allDead) {
      // A peer that passed this barrier and then closed its connections looks dead too: the keys are
      // re-read after its death was seen, so only workers that really never arrived are reported.
      bool arrived = false;
      for (int r : missing) arrived = arrived || store_->check({prefix + std::to_string(r)});
      if (arrived) continue;
      Error error = Error::disconnected("shutdown of " + name_ + ": " + joinNames(names) +
                                        " died before reaching the '" + tag + "' barrier");
      error.worker = joinNames(names);
      throw RpcError(error);
    }
    if (SteadyTime::now() >= deadline) {
      Error error = Error::timeout("shutdown of " + name_ + ": " + joinNames(names) + " did not reach the '" + tag +
                                   "' barrier within " + std::to_string(bound.count()) + " ms");
      error.worker = joinNames(names);
      throw RpcError(error);
    }
    // Poll the store quickly at first (the others are usually close behind), then back off: a worker that
    // waits here for minutes must not load the store's host (typically the busy driver).
    std::this_thread::sleep_for(poll);
    poll = std::min(poll * 2, std::chrono::milliseconds(100));
  }
}

void Agent::waitQuiet(bool outgoing, SteadyTime::time_point deadline) {
  std::unique_lock<std::mutex> lock(mutex_);
  bool quiet = changed_.wait_until(lock, deadline, [&] { return outgoing ? pending_.empty() : incoming_.empty(); });
  if (!quiet) {
    throw RpcError(Error::timeout("shutdown of " + name_ + ": " +
                                  std::to_string(outgoing ? pending_.size() : incoming_.size()) +
                                  (outgoing ? " outgoing calls" : " running handlers") + " did not finish within " +
                                  std::to_string(config_.shutdownTimeout.count()) + " ms"));
  }
}

const char* Agent::internalThreadName() const {
  if (executor_ && executor_->isCurrentThread()) return "executor (a handler or continuation)";
  if (context_ && context_->inLoop()) return "transport loop (an inline-safe continuation or transport callback)";
  if (timers_ && timers_->isCurrentThread()) return "timer thread (an inline-safe continuation or timer callback)";
  return nullptr;
}

void Agent::shutdown(bool graceful) {
  // Once torn down the agent's threads are gone (and their ids may belong to new threads): nothing to check.
  if (tornDown_.load(std::memory_order_acquire)) return;
  // Teardown joins the executor, the loop and the timer thread: on one of them it would join itself (or,
  // for the loop, half-close the transport under its own callbacks). Checked before touching anything.
  const char* thread = internalThreadName();
  DG_CHECK(thread == nullptr, "Agent::shutdown must not be called on the agent's own ", thread,
           " thread: it joins that thread. Call it from another thread (e.g. the one that started the agent).");
  // Held until teardown is complete: a concurrent caller blocks here and then finds shutDown_ set, so it
  // never returns (and lets its caller destroy things) while the first call is still tearing down.
  std::lock_guard<std::mutex> shutdownLock(shutdownMutex_);
  if (shutDown_) return;
  shutDown_ = true;
  shutdownStarted_.store(true, std::memory_order_release);
  std::exception_ptr failure;
  if (graceful) {
    try {
      // 0. Everyone's program is done: a worker that finished first (a parameter server, a pipeline stage)
      // waits here while the others work (unbounded by default; a death ends it), and keeps serving them
      // as a fully open agent: its own calls (RRef deletions when a handler drops an RRef, replies'
      // follow-ups) must not be refused while others still drive work through it.
      storeBarrier("done", config_.shutdownBarrierTimeout);
      // Layers above (rref/) finish their own traffic first, while this agent may still call out.
      for (auto& extension : extensionList()) extension->onShutdown(SteadyTime::now() + config_.shutdownTimeout);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        callsOpen_ = false;  // handlers may still call out so that in-flight work can finish
      }
      // 1. Everyone stopped issuing new calls. 2. Our own calls got their answers (peers keep serving
      // until they pass barrier 3). 3. Everyone's calls are answered: nobody needs a connection any more.
      storeBarrier("shutdown", config_.shutdownTimeout);
      const auto deadline = SteadyTime::now() + config_.shutdownTimeout;
      waitQuiet(/*outgoing=*/true, deadline);
      storeBarrier("drained", config_.shutdownTimeout);
      waitQuiet(/*outgoing=*/false, deadline);
      // The host of the store must not close it while others still use it; the others must not poll it
      // after their last write (the host may already have closed it).
      storeBarrier("left", config_.shutdownTimeout, /*onlyStoreHostWaits=*/true);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  teardown();
  tornDown_.store(true, std::memory_order_release);
  if (failure) std::rethrow_exception(failure);
}

void Agent::teardown() {
  TimerId heartbeatTimer = kInvalidTimerId;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    accepting_ = false;
    callsOpen_ = false;
    // heartbeat() re-arms only while !closed_, so this is the last timer it armed.
    heartbeatTimer = std::exchange(heartbeatTimer_, kInvalidTimerId);
  }
  if (timers_ && heartbeatTimer != kInvalidTimerId) timers_->cancel(heartbeatTimer);
  changed_.notify_all();
  if (listener_) listener_->close();
  if (context_) context_->close();  // joins the loop: no more frames or close callbacks
  if (timers_) timers_->shutdown();
  std::vector<uint64_t> ids;
  std::vector<CancellationSource> handlers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [id, p] : pending_) ids.push_back(id);
    for (const auto& [key, incoming] : incoming_) handlers.push_back(incoming->source);
  }
  for (uint64_t id : ids) failPending(id, Error::failed("agent " + name_ + " shut down"), false);
  for (auto& source : handlers) source.cancel(Error::cancelled("agent " + name_ + " shut down"));
  std::vector<std::shared_ptr<AgentExtension>> extensions;
  {
    std::lock_guard<std::mutex> lock(extensionsMutex_);
    extensionsClosed_ = true;
    for (auto& [key, extension] : extensions_) extensions.push_back(extension);
  }
  for (auto& extension : extensions) extension->onAgentClosed();
  if (executor_) executor_->shutdown();
  store_.reset();
  storeServer_.reset();
  // Every thread of the agent is joined: its trace is complete. Writes it and closes the file.
  trace::unregisterWorker(traceSlot_);
}

Agent::~Agent() {
  const char* thread = tornDown_.load(std::memory_order_acquire) ? nullptr : internalThreadName();
  if (thread != nullptr) {
    // Cannot throw from a destructor, and returning would free the agent under threads that still run.
    std::fprintf(stderr,
                 "[distgrad] agent %s: FATAL: the Agent was destroyed on its own %s thread; destroy it from "
                 "another thread (teardown joins that thread)\n",
                 name_.c_str(), thread);
    std::abort();
  }
  try {
    shutdown(false);
  } catch (const std::exception& e) {
    warn(std::string("shutdown in the destructor failed: ") + e.what());
  }
}

}  // namespace distgrad::rpc
