// Agent: one worker of a distgrad job. It joins the job through the rendezvous store, connects to every
// peer (handshake with the cluster secret), serves the functions of its Registry on an executor and calls
// its peers' functions (rpcSync / rpcAsync) with deadlines, cancellation, heartbeats and a graceful
// shutdown. Design and threads: docs/thread_model.md ("Agent"); handshake: docs/wire_protocol.md.
//
//   auto agent = rpc::Agent::start(options, registry);
//   Tensor c = agent->rpcSync("worker1", kAdd, a, b);
//   rpc::Future<Tensor> f = agent->rpcAsync("worker1", kAdd, a, b);
//   agent->shutdown();
//
// A worker may call itself (worker == name()) with the same semantics as a peer: values are encoded and
// decoded (copied), the handler runs on the executor, deadlines, cancellation and errors behave the same,
// and metrics(name()) counts those calls (docs/thread_model.md, "Calls to itself").
// Errors of a call come back through its future (Future::get() throws RpcError): `unimplemented` (no such
// function / signature mismatch), `remote` (the handler threw), `timeout` (deadline; the callee's
// CallContext token is cancelled too), `cancelled` (CallOptions::cancel), `disconnected` (the peer's
// connection closed or its heartbeats stopped), `failed` (unknown worker, agent shut down, encode errors).
// Thread-safety: every method may be called from any thread, including from handlers (nested calls), except
// shutdown()/the destructor, which must not run on the agent's own threads: its executor (a handler, a
// continuation), its transport loop or its timer thread (an inline-safe continuation of an agent future
// runs on whichever of those completed it; a timer or transport callback). Teardown joins those threads, so
// shutdown() there throws ValueError without tearing anything down, and the destructor there aborts the
// process with a message (it cannot throw, and returning would free state those threads still use).
// Futures returned by an agent are bound to its executor: consume them before the agent is destroyed.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "rpc/autograd_hook.h"
#include "rpc/cancellation.h"
#include "rpc/codec.h"
#include "rpc/detail/move_only_function.h"
#include "rpc/error.h"
#include "rpc/executor.h"
#include "rpc/function.h"
#include "rpc/future.h"
#include "rpc/message.h"
#include "rpc/options.h"
#include "rpc/registry.h"
#include "rpc/store.h"
#include "rpc/timer.h"
#include "rpc/trace.h"
#include "rpc/transport/transport.h"

namespace distgrad::rpc {

namespace transport::inproc {
class InprocHub;
}

// Start-time settings that are not part of the job's Options (they do not come from the environment).
struct AgentConfig {
  // For options.transport == "inproc": the hub every agent of the in-process job shares (required).
  std::shared_ptr<transport::inproc::InprocHub> inprocHub;
  // Bound on each phase of a graceful shutdown once every worker has reached it: the RRef layer's release,
  // the drain of in-flight calls and the barriers after it.
  std::chrono::milliseconds shutdownTimeout{30'000};
  // Bound on the first shutdown barrier, where a worker that is done (a parameter server, a pipeline stage)
  // waits for the others to finish their work: 0 (default) waits as long as the missing workers are alive
  // (their heartbeats keep coming); a worker that dies fails it at once, naming it.
  std::chrono::milliseconds shutdownBarrierTimeout{0};
  // Prefix of this job's keys in the store (several jobs may share one store).
  std::string storePrefix = "dg";
  // TEST-ONLY: the protocol version this agent announces in its handshake, so tests can make a peer that
  // speaks another version. Leave it at the default in real jobs.
  uint16_t protocolVersionForTesting = transport::kProtocolVersion;
  // Bound on one connection's handshake (from the moment it exists to the last proof): a connection that
  // has not finished by then is closed with a logged reason. 0 = min(Options::rendezvousTimeout, 10 s).
  std::chrono::milliseconds handshakeTimeout{0};
  // How long a thread blocked in rpcSync may read the reply's connection itself instead of being woken by
  // the transport's loop thread (transport::Connection::beginWaitingRead; tcp: Note [Waiting reader] in
  // rpc/transport/tcp/connection.cpp; ucx: Note [Driving threads] in rpc/transport/ucx/context.cpp).
  // Replies slower than this are awaited as usual. 0 turns it off.
  std::chrono::microseconds syncReadWindow{2000};
  // How long an executor worker that just answered the only call this agent was serving reads that call's
  // connection for the next call, instead of sleeping until the loop thread hands it one (tcp and ucx:
  // Note [Serving reader] in rpc/agent.cpp). 0 turns it off.
  std::chrono::microseconds serveReadWindow{2000};
  // TEST-ONLY: added to this agent's clock (the times its handshakes and heartbeats carry and its trace
  // file records), so one process can check the clock-offset estimate against a known offset.
  std::chrono::nanoseconds clockSkewForTesting{0};
};

// An estimate of a peer's clock relative to this agent's (docs/wire_protocol.md, "Clock offsets"): from
// the handshake, refreshed by heartbeats; the sample with the smallest round trip of the last few wins.
struct ClockOffset {
  int64_t offsetNs = 0;  // add it to this worker's steady-clock time (ns) to get the peer's
  int64_t rttNs = 0;     // round trip of that sample: the offset is within rttNs / 2 of the truth
  uint64_t samples = 0;  // samples taken since the link opened
};

// Per-agent state of a layer above rpc/ (rref/, autograd/distributed/), kept in the agent's extension slot
// so that rpc/ never depends on those layers. The agent tells every extension when a peer is declared dead
// and when the agent closes; both calls come from a thread of the agent (loop, timer, executor or the one
// shutting down), never under the agent's locks, and must not block.
class AgentExtension {
 public:
  virtual ~AgentExtension() = default;
  // `peer` was declared dead (its connection closed or its heartbeats stopped); once per peer.
  virtual void onPeerDown(const std::string& peer, const Error& error) {
    (void)peer;
    (void)error;
  }
  // A graceful shutdown begins, on the thread that called shutdown(), before new calls are refused (peers
  // still serve): finish the extension's own protocol traffic by `deadline` (e.g. release references).
  virtual void onShutdown(std::chrono::steady_clock::time_point deadline) { (void)deadline; }
  // The agent is tearing down (after its pending calls failed, before its executor stops): drop every
  // reference to it. Extensions may outlive the agent (values above rpc/ hold them).
  virtual void onAgentClosed() {}
};

// Per-call settings (rpcAsyncWith / rpcSyncWith).
struct CallOptions {
  // 0 = Options::defaultTimeout; negative = no deadline.
  std::chrono::milliseconds timeout{0};
  // Cancelling it fails the call with `cancelled` and tells the callee (its CallContext token).
  CancellationToken cancel;
  // Where this call's CUDA tensors land on the callee (replaces Options::deviceMaps for this call; the
  // reply comes back through its inverse). Unset: the agent's map for the callee (rpc/device_map.h).
  std::optional<DeviceMap> deviceMap;
};

// Counters per peer (snapshot).
struct PeerMetrics {
  uint64_t callsSent = 0;
  uint64_t callsReceived = 0;
  uint64_t bytesSent = 0;
  uint64_t bytesReceived = 0;
  uint64_t errors = 0;   // calls to this peer that ended in an error
  // Of the frames sent to this peer, those the sending thread wrote itself instead of the transport's loop
  // thread (tcp: an rpcSync's call, calls made one at a time, a lone call's reply: Note [Lone calls] in
  // rpc/agent.cpp), over the current connection.
  uint64_t framesWrittenBySender = 0;
  uint64_t pending = 0;  // calls to this peer awaiting a response
  bool connected = false;
  // How the transport carries this peer's frames where it chooses among several ways (Connection::lanes():
  // ucx names the lanes ucp picked, e.g. sysv/memory for messages and cma/memory for large payloads); ""
  // for tcp and inproc.
  std::string lanes;
};

class Agent {
 public:
  // Joins the job: transport, listener, store registration, wait for all workers, connect + handshake with
  // every peer. Throws RpcError (timeout naming the missing workers, failed naming a refused handshake) or
  // ValueError (bad options).
  static std::unique_ptr<Agent> start(const Options& options, const Registry& registry, AgentConfig config = {});
  ~Agent();  // shutdown(false) if not shut down
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return options_.rank; }
  const Options& options() const { return options_; }
  int worldSize() const { return options_.worldSize; }
  std::vector<std::string> workerNames() const;
  // The store this agent uses ("host:port"); useful when rank 0 hosted it on port 0.
  std::string storeAddress() const;

  template <typename R, typename... Params, typename... A>
  Future<R> rpcAsyncWith(const CallOptions& callOptions, const std::string& worker, const Function<R(Params...)>& fn,
                         A&&... args) {
    return call(callOptions, /*wait=*/nullptr, worker, fn, std::forward<A>(args)...);
  }

  template <typename R, typename... Params, typename... A>
  Future<R> rpcAsync(const std::string& worker, const Function<R(Params...)>& fn, A&&... args) {
    return rpcAsyncWith(CallOptions{}, worker, fn, std::forward<A>(args)...);
  }
  // The caller blocks for the answer, so its frame is written from this thread when the connection has
  // nothing queued (transport::OutgoingFrame::fromSender), and this thread may read the reply itself
  // (AgentConfig::syncReadWindow, transport::Connection::beginWaitingRead).
  template <typename R, typename... Params, typename... A>
  R rpcSync(const std::string& worker, const Function<R(Params...)>& fn, A&&... args) {
    return rpcSyncWith(CallOptions{}, worker, fn, std::forward<A>(args)...);
  }
  template <typename R, typename... Params, typename... A>
  R rpcSyncWith(const CallOptions& callOptions, const std::string& worker, const Function<R(Params...)>& fn,
                A&&... args) {
    SyncWait wait;
    Future<R> future = call(callOptions, &wait, worker, fn, std::forward<A>(args)...);
    wait.read(syncReadWindow(), [&future] { return future.isReady(); });
    return future.get();
  }

  // Graceful (default): meet every worker at a store barrier, serving and calling as usual meanwhile
  // (waiting while the others are alive, AgentConfig::shutdownBarrierTimeout; RpcError naming the workers
  // that died before arriving), then let the RRef layer release what it holds, refuse new calls, meet
  // again, drain in-flight calls both ways (bounded by AgentConfig::shutdownTimeout), then close
  // connections and stop threads. Non-graceful: fail pending calls and stop at once.
  // The agent is always torn down when shutdown returns or throws. Idempotent and safe to call
  // concurrently: a call made while another is in progress waits until that teardown is complete, then
  // returns quietly (the first caller alone reports the outcome); a later call returns at once. Throws
  // ValueError, touching nothing, on the agent's own threads (see the thread-safety note above).
  void shutdown(bool graceful = true);
  // Whether shutdown() was called (it may still be waiting for the other workers, serving them).
  bool shutdownStarted() const { return shutdownStarted_.load(std::memory_order_acquire); }

  // Untyped call, for layers above rpc/ that build their own call values (rref/): calls `functionName` on
  // `worker` with `signatureHash` and the value `encodeValue` writes (encoded with this agent's CodecScope),
  // with the deadline and cancellation of callOptions. `complete` gets the reply (a kResponse or kError
  // message, scoped to this agent) or the failure, exactly once, on whichever thread ends the call (a
  // transport loop, the timer thread, an executor thread or the caller): it must not block.
  using RawCompletion = detail::MoveOnlyFunction<void(Result<DecodedMessage>&&)>;
  void rpcRaw(const CallOptions& callOptions, const std::string& worker, const std::string& functionName,
              uint64_t signatureHash, const EncodeValueFn& encodeValue, RawCompletion complete);

  // The extension stored under `key` (see AgentExtension), created by `make` on first use. `make` runs
  // under the slot's lock: it must not call extension() again. Throws ValueError after the agent closed.
  std::shared_ptr<AgentExtension> extension(const std::string& key,
                                            const std::function<std::shared_ptr<AgentExtension>(Agent&)>& make);
  // The functions and classes this agent serves (its copy of the Registry given to start()).
  const Registry& registry() const { return registry_; }

  Executor& executor() { return *executor_; }
  PeerMetrics metrics(const std::string& worker) const;
  // Calls awaiting a response (all peers) and handlers running.
  size_t pendingCalls() const;
  size_t runningHandlers() const;
  // Timers this agent has armed and not yet fired or cancelled (call deadlines of both sides, the
  // heartbeat): a gauge for leak checks.
  size_t armedTimers() const { return timers_ ? timers_->pending() : 0; }

  // How many CUDA devices `worker` has (from its handshake; this agent's own count for its own name);
  // nullopt for an unknown worker or before its handshake.
  std::optional<int> peerCudaDevices(const std::string& worker) const;
  // The device map `worker` announced for messages it sends to this worker (empty when none or unknown).
  DeviceMap peerDeviceMap(const std::string& worker) const;

  // The current estimate of `worker`'s clock relative to this agent's; nullopt before the first sample
  // (or for this agent itself / an unknown name).
  std::optional<ClockOffset> clockOffset(const std::string& worker) const;
  // The calling thread is about to block until `ready()` holds, for an answer from `worker` that some call
  // already asked for (an RRef's value, a remote module's output): it may read its connection to `worker`
  // meanwhile, as rpcSync does (AgentConfig::syncReadWindow, transport::Connection::beginWaitingRead).
  // Returns once ready() holds or the window passed, or at once where it cannot read (another thread reads
  // that connection, a call to this agent itself, inproc or ucx); then block as usual.
  void readWhileWaiting(const std::string& worker, const std::function<bool()>& ready);
  // AgentConfig::syncReadWindow, changeable while the agent runs (benchmarks compare both ways in one run).
  std::chrono::microseconds syncReadWindow() const {
    return std::chrono::microseconds(syncReadWindowUs_.load(std::memory_order_relaxed));
  }
  void setSyncReadWindow(std::chrono::microseconds window) {
    syncReadWindowUs_.store(window.count(), std::memory_order_relaxed);
  }
  // AgentConfig::serveReadWindow, changeable while the agent runs.
  std::chrono::microseconds serveReadWindow() const {
    return std::chrono::microseconds(serveReadWindowUs_.load(std::memory_order_relaxed));
  }
  void setServeReadWindow(std::chrono::microseconds window) {
    serveReadWindowUs_.store(window.count(), std::memory_order_relaxed);
  }
  // This agent's worker slot in the trace recorder (rpc/trace.h).
  trace::WorkerSlot traceWorker() const { return traceSlot_; }

 private:
  // Executor::beginOutsideWait's registration, ended on scope exit.
  struct OutsideWait {
    Executor& executor;
    ~OutsideWait() { executor.endOutsideWait(); }
  };
  // rpcSync(With)'s hold on the connection its call goes out on, when startCall made this thread its reader
  // (transport::Connection::beginWaitingRead, before the send): read() reads until `ready` holds or the
  // window passed, then lets go; the destructor lets go if read() was never reached (an exception).
  struct SyncWait {
    std::shared_ptr<transport::Connection> connection;  // null: this thread does not read (the usual wait)
    void read(std::chrono::microseconds window, const std::function<bool()>& ready);
    ~SyncWait() {
      if (connection) connection->endWaitingRead();
    }
  };
  // rpcAsyncWith (wait == nullptr), and rpcSync(With): the caller waits, so the frame carries the fromSender
  // hint and `wait` gets the connection to read.
  template <typename R, typename... Params, typename... A>
  Future<R> call(const CallOptions& callOptions, SyncWait* wait, const std::string& worker,
                 const Function<R(Params...)>& fn, A&&... args) {
    static_assert(sizeof...(Params) == sizeof...(A), "rpcAsync: wrong number of arguments");
    // Tracing (rpc/trace.h): the only cost when off is this load.
    const bool tracing = trace::enabled();
    trace::WorkerScope traceWorker(traceSlot_, tracing);
    CallTiming timing;
    Promise<R> promise(*executor_);
    Future<R> future = promise.getFuture();
    EnvelopeFields fields;
    fields.kind = MessageKind::kCall;
    fields.messageId = nextMessageId_.fetch_add(1, std::memory_order_relaxed);
    fields.functionName = fn.name();
    fields.signatureHash = fn.hash();
    // Converting to the declared parameter types first makes the wire type the declared one.
    prepareCall(callOptions, fields);
    const CodecScope scope = sendScope(worker, activeAutogradContext(), &callOptions);
    if (tracing) timing.serializeBeginNs = trace::nowNs();
    auto frame = encodeCallIn(&scope, fields, asParam<Params>(std::forward<A>(args))...);
    if (tracing) timing.serializeEndNs = trace::nowNs();
    // The signature text is built only for the error that names it (building it costs allocations).
    Completion complete = [promise = std::move(promise)](Result<DecodedMessage>&& reply) mutable {
      const auto signature = [] { return signatureText<R(Params...)>(); };
      if (!reply.ok()) {
        Error error = reply.error();
        if (error.kind == ErrorKind::kUnimplemented) error.message += " (caller's signature: " + signature() + ")";
        promise.setError(std::move(error));
        return;
      }
      const DecodedMessage& message = reply.value();
      if (message.kind() == MessageKind::kError) {
        Error error = *message.fields().error;
        if (error.kind == ErrorKind::kUnimplemented) error.message += " (caller's signature: " + signature() + ")";
        promise.setError(std::move(error));
        return;
      }
      if constexpr (std::is_void_v<R>) {
        promise.setValue();
      } else {
        promise.setResult(message.decodeValue<R>());
      }
    };
    if (!frame.ok()) {
      complete(Result<DecodedMessage>(frame.error()));
    } else {
      frame.value().fromSender = wait != nullptr;
      startCall(callOptions, worker, fields, std::move(frame).value(), std::move(complete), timing, wait);
    }
    return future;
  }
  using Completion = detail::MoveOnlyFunction<void(Result<DecodedMessage>&&)>;
  struct Peer;
  struct Link;
  struct Pending;
  struct Incoming;
  struct HandshakeMessage;
  struct HeartbeatMessage;
  // When a traced call was encoded (trace::nowNs(); 0 = the call is not traced).
  struct CallTiming {
    int64_t serializeBeginNs = 0;
    int64_t serializeEndNs = 0;
  };
  // A received frame: when it arrived (0 = not traced) and its size.
  struct Arrival {
    int64_t ns = 0;
    uint64_t bytes = 0;
    bool fromTransport = false;  // a link's frame (its transport.recv is traced with the call), not a self call
    int peerRank = -1;           // the link's peer (fromTransport)
  };

  Agent(const Options& options, const Registry& registry, AgentConfig config);
  // The argument as the declared parameter type: passed through when it already is one (no copy).
  template <typename P, typename X>
  static decltype(auto) asParam(X&& x) {
    if constexpr (std::is_same_v<std::decay_t<X>, std::decay_t<P>>) {
      return static_cast<const std::decay_t<P>&>(x);
    } else {
      return std::decay_t<P>(std::forward<X>(x));
    }
  }
  void prepareCall(const CallOptions& callOptions, EnvelopeFields& fields) const;
  // The CodecScope of a message to `peer`; inside distributed autograd context `autogradContext` (0: none)
  // when this agent has an AutogradHook.
  // `callOptions` (a call's): its device map replaces the agent's for `peer`.
  CodecScope sendScope(const std::string& peer, uint64_t autogradContext, const CallOptions* callOptions = nullptr) {
    CodecScope scope{this, peer};
    if (autogradHook_ && autogradContext != 0) {
      scope.autogradContext = autogradContext;
      scope.autogradHook = autogradHook_.get();
    }
    if (callOptions != nullptr && callOptions->deviceMap) {
      scope.deviceMap = std::make_shared<const DeviceMap>(*callOptions->deviceMap);
    } else if (deviceMapsInUse_.load(std::memory_order_acquire)) {
      scope.deviceMap = sendDeviceMap(peer);
    }
    return scope;
  }
  // The device map of messages to `peer` that are not replies: Options::deviceMaps[peer], else the inverse
  // of the map `peer` announced for this worker in its handshake (so a worker that only receives CUDA
  // tensors sends gradients and its own calls back where they came from), else null.
  std::shared_ptr<const DeviceMap> sendDeviceMap(const std::string& peer) const;
  // Agent::start: every worker Options::deviceMaps names is in the job, and every map (this worker's and
  // what the peers announced) targets devices its receiver has. Throws ValueError naming worker and device.
  void checkDeviceMaps() const;
  // The hello / challenge's CUDA device count and device map, validated, into `link`; the reason to refuse
  // the link otherwise.
  std::optional<std::string> adoptAnnouncedDevices(Link& link, const HandshakeMessage& hs) const;
  // A received call or response from `peer` inside an autograd context that carries grad tensors: hangs
  // them from the RecvBackward node the hook makes. An Error when this agent cannot (no hook, refused).
  std::optional<Error> attachAutograd(DecodedMessage& message, const std::string& peer);
  std::chrono::milliseconds effectiveTimeout(const CallOptions& callOptions) const;
  void startUp();
  // `wait` (rpcSync): gets the connection the call went out on.
  void startCall(const CallOptions& callOptions, const std::string& worker, const EnvelopeFields& fields,
                 transport::OutgoingFrame frame, Completion complete, const CallTiming& timing, SyncWait* wait);
  // Removes and returns pending call `id`; with `fromPeer`, only if that call went to that peer (a reply
  // from anyone else is ignored).
  std::unique_ptr<Pending> takePending(uint64_t id, const std::string* fromPeer = nullptr);
  void failPending(uint64_t id, Error error, bool sendCancel);

  // Links and handshake (loop thread; docs/wire_protocol.md section 8).
  void adoptConnection(std::shared_ptr<transport::Connection> connection, const std::string& expectedPeer);
  // This end's hello (connector) or challenge (acceptor): version, name, rank, the link's nonce and the
  // times of the clock-offset exchange (recorded in the link).
  Result<transport::OutgoingFrame> introduction(int64_t stage, Link& link) const;
  // The allocator of a link: refuses every payload until the link is ready (an unauthenticated peer must
  // not make this process allocate up to maxMessageBytes), then defers to allocator_.
  transport::PayloadAllocator linkAllocator(const std::weak_ptr<Link>& weak);
  void onFrame(const std::shared_ptr<Link>& link, transport::IncomingFrame&& frame);
  void onHandshake(const std::shared_ptr<Link>& link, const DecodedMessage& message);
  // A heartbeat from a ready link's peer: validates its times and adds a clock-offset sample.
  void onHeartbeat(const std::shared_ptr<Link>& link, const DecodedMessage& message);
  // Adds a clock-offset sample for `peer` (caller holds mutex_) and publishes the best one to the trace.
  void addClockSampleLocked(Peer& peer, int64_t offsetNs, int64_t rttNs);
  // The acceptor's answer to a connector's hello, once the peer list is known (a hello that came earlier
  // waits on its link and is replayed by startUp on the loop thread: the loop never blocks).
  void onHello(const std::shared_ptr<Link>& link, const HandshakeMessage& hello);
  // Makes `link` the peer's link; false when the peer already has one or is dead.
  bool registerLink(const std::shared_ptr<Link>& link);
  void onHandshakeTimeout(const std::shared_ptr<Link>& link);
  std::chrono::milliseconds handshakeTimeout() const;
  void onLinkClosed(const std::shared_ptr<Link>& link, const Error& error);
  // Logs and closes a link that failed the handshake. The failure aborts start() only when it concerns a
  // worker of this job (a link we opened, or a peer claiming a registered name): an anonymous stray
  // connection (port scanner, garbage, unknown name) is only logged. `lastWords` (optional) is sent first
  // and the link closed once it left, so the peer can name the reason too.
  void refuseLink(const std::shared_ptr<Link>& link, const std::string& reason, const std::string& claimedName = {},
                  std::optional<transport::OutgoingFrame> lastWords = std::nullopt);
  void peerDown(const std::string& peer, const Error& error);

  // Note [Carried references] in agent.cpp.
  void bindReferences(const DecodedMessage& message, const std::string& peer);
  void onCall(const std::shared_ptr<Link>& link, DecodedMessage message, Arrival arrival);
  // Note [Serving reader]: an executor worker that just wrote the reply to the only call being served, as
  // `serving`'s reader, reads that connection for the next call (serveReadWindow), waiting outside the
  // executor's queue meanwhile; then lets go.
  void serveNextCall(SyncWait& serving);
  // Note [Reading for the answer] in agent.cpp: an executor worker whose handler returned pending after
  // sending one call (`id`, on `connection`) reads that connection for the answer, waiting outside the
  // executor's queue.
  void readForAnswer(std::shared_ptr<transport::Connection> connection, uint64_t id);
  void onReply(const std::string& peer, DecodedMessage message, Arrival arrival);
  void onCancel(const std::string& peer, const DecodedMessage& message);
  // `callId`: the call the frame belongs to (a self call fails it if its loopback frame does not decode).
  // True when the frame was queued on a link (not delivered to this agent itself, not dropped). With
  // traceSend false the caller traces the frame's transport.send itself (a reply's trace::RpcRecord).
  bool sendFrame(const std::string& peer, transport::OutgoingFrame frame, uint64_t callId, bool traceSend = true);
  // Note [Self calls] in agent.cpp: a frame of this agent to itself, received without a transport.
  void deliverToSelf(transport::OutgoingFrame frame, uint64_t callId);
  // The peer named `worker` (self_ for this agent's own name), or nullptr. Caller holds mutex_.
  Peer* peerLocked(const std::string& worker) const;
  // The callee-side deadline of incoming call (peer, id) expired (timer thread): cancels its token.
  void onCallDeadline(const std::string& peer, uint64_t id, int64_t timeoutMicros);
  // Queues `frame` on the link; traced (and traceSend), records its transport.send.
  void sendOn(const std::shared_ptr<Link>& link, transport::OutgoingFrame frame, bool traceSend = true);
  void heartbeat();
  // Sets this rank's key under `tag`, then waits for every other rank's, at most `bound` (0: as long as a
  // missing rank is alive); with onlyStoreHostWaits, only the rank hosting the store waits (the others may
  // leave at once).
  void storeBarrier(const std::string& tag, std::chrono::milliseconds bound, bool onlyStoreHostWaits = false);
  void waitQuiet(bool outgoing, std::chrono::steady_clock::time_point deadline);
  void warn(const std::string& message) const;
  // Names the agent thread the caller is on ("executor", "transport loop", "timer"), or nullptr.
  const char* internalThreadName() const;
  void teardown();
  // This agent's clock for handshakes and heartbeats: trace::nowNs() plus the test skew.
  int64_t clockNs() const { return trace::nowNs() + config_.clockSkewForTesting.count(); }

  Options options_;
  AgentConfig config_;
  std::atomic<int64_t> syncReadWindowUs_{0};   // syncReadWindow(); set from config_ by the constructor
  std::atomic<int64_t> serveReadWindowUs_{0};  // serveReadWindow(); likewise
  Registry registry_;
  std::string name_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<TimerQueue> timers_;
  std::unique_ptr<StoreServer> storeServer_;
  std::unique_ptr<StoreClient> store_;
  std::unique_ptr<transport::Context> context_;
  std::unique_ptr<transport::Listener> listener_;
  std::string storeAddress_;
  transport::PayloadAllocator allocator_;
  std::atomic<uint64_t> nextMessageId_{1};
  // Set in startUp before any message moves, read-only afterwards (rpc/autograd_hook.h).
  std::shared_ptr<AutogradHook> autogradHook_;
  // Set first thing in startUp, read-only afterwards: this agent's slot in the trace recorder.
  trace::WorkerSlot traceSlot_ = trace::kNoWorker;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::unique_ptr<Peer>> peers_;          // GUARDED_BY(mutex_), fixed after start
  std::unique_ptr<Peer> self_;  // this agent as the target of its own calls (metrics; never has a link)
  std::vector<std::shared_ptr<Link>> links_;                    // GUARDED_BY(mutex_): every live link
  std::unordered_map<uint64_t, std::unique_ptr<Pending>> pending_;        // GUARDED_BY(mutex_)
  std::map<std::pair<std::string, uint64_t>, std::unique_ptr<Incoming>> incoming_;  // GUARDED_BY(mutex_)
  // incoming_.size(), written where incoming_ changes (under mutex_), read without it by a reply deciding
  // whether it answers the only call running (Note [Sender writes]).
  std::atomic<size_t> incomingCount_{0};
  // Note [Serving reader], written under mutex_ or before the write it precedes: calls counted in incoming_
  // whose reply, the only call's, is being written (its caller may already be sending its next call).
  std::atomic<size_t> replying_{0};
  std::optional<Error> startError_;                             // GUARDED_BY(mutex_)
  bool accepting_ = false;   // GUARDED_BY(mutex_): incoming calls are served
  bool callsOpen_ = false;   // GUARDED_BY(mutex_): new outgoing calls from non-executor threads allowed
  bool peersKnown_ = false;  // GUARDED_BY(mutex_): peers_ is filled in
  bool closed_ = false;                                         // GUARDED_BY(mutex_)
  TimerId heartbeatTimer_ = kInvalidTimerId;                    // GUARDED_BY(mutex_)
  // Held for the whole of shutdown(), so a concurrent caller waits for the teardown to complete.
  std::mutex shutdownMutex_;
  bool shutDown_ = false;  // GUARDED_BY(shutdownMutex_)
  // Whether any device map applies to messages this agent sends (its options have one, or a peer announced
  // one): otherwise sendScope skips the lookup (and its lock).
  std::atomic<bool> deviceMapsInUse_{false};
  std::shared_ptr<const DeviceMap> selfDeviceMap_;  // Options::deviceMaps[name_] (calls to itself), or null
  std::atomic<bool> shutdownStarted_{false};  // set with shutDown_, readable without the mutex
  std::mutex extensionsMutex_;
  std::map<std::string, std::shared_ptr<AgentExtension>> extensions_;  // GUARDED_BY(extensionsMutex_)
  bool extensionsClosed_ = false;                                      // GUARDED_BY(extensionsMutex_)
  std::vector<std::shared_ptr<AgentExtension>> extensionList() {
    std::lock_guard<std::mutex> lock(extensionsMutex_);
    std::vector<std::shared_ptr<AgentExtension>> out;
    for (auto& [key, extension] : extensions_) out.push_back(extension);
    return out;
  }
  std::atomic<bool> tornDown_{false};  // set once a shutdown() completed its teardown
  // Transport loop only: a deferred Executor::wakeDeferred is queued (Note [Batched hand-offs]).
  bool executorWakeOwed_ = false;
};

}  // namespace distgrad::rpc
