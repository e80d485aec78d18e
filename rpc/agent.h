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
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

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
#include "rpc/transport/transport.h"

namespace distgrad::rpc {

namespace transport::inproc {
class InprocHub;
}

// Start-time settings that are not part of the job's Options (they do not come from the environment).
struct AgentConfig {
  // For options.transport == "inproc": the hub every agent of the in-process job shares (required).
  std::shared_ptr<transport::inproc::InprocHub> inprocHub;
  // Bound on the shutdown barrier and the drain of in-flight calls.
  std::chrono::milliseconds shutdownTimeout{30'000};
  // Prefix of this job's keys in the store (several jobs may share one store).
  std::string storePrefix = "dg";
  // TEST-ONLY: the protocol version this agent announces in its handshake, so tests can make a peer that
  // speaks another version. Leave it at the default in real jobs.
  uint16_t protocolVersionForTesting = transport::kProtocolVersion;
};

// Per-call settings (rpcAsyncWith / rpcSyncWith).
struct CallOptions {
  // 0 = Options::defaultTimeout; negative = no deadline.
  std::chrono::milliseconds timeout{0};
  // Cancelling it fails the call with `cancelled` and tells the callee (its CallContext token).
  CancellationToken cancel;
};

// Counters per peer (snapshot).
struct PeerMetrics {
  uint64_t callsSent = 0;
  uint64_t callsReceived = 0;
  uint64_t bytesSent = 0;
  uint64_t bytesReceived = 0;
  uint64_t errors = 0;   // calls to this peer that ended in an error
  uint64_t pending = 0;  // calls to this peer awaiting a response
  bool connected = false;
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
  int worldSize() const { return options_.worldSize; }
  std::vector<std::string> workerNames() const;
  // The store this agent uses ("host:port"); useful when rank 0 hosted it on port 0.
  std::string storeAddress() const;

  template <typename R, typename... Params, typename... A>
  Future<R> rpcAsyncWith(const CallOptions& callOptions, const std::string& worker, const Function<R(Params...)>& fn,
                         A&&... args) {
    static_assert(sizeof...(Params) == sizeof...(A), "rpcAsync: wrong number of arguments");
    Promise<R> promise(*executor_);
    Future<R> future = promise.getFuture();
    EnvelopeFields fields;
    fields.kind = MessageKind::kCall;
    fields.messageId = nextMessageId_.fetch_add(1, std::memory_order_relaxed);
    fields.functionName = fn.name();
    fields.signatureHash = fn.hash();
    // Converting to the declared parameter types first makes the wire type the declared one.
    prepareCall(callOptions, fields);
    auto frame = encodeCall(fields, asParam<Params>(std::forward<A>(args))...);
    std::string signature = fn.signature();
    Completion complete = [promise = std::move(promise), signature](Result<DecodedMessage>&& reply) mutable {
      if (!reply.ok()) {
        Error error = reply.error();
        if (error.kind == ErrorKind::kUnimplemented) error.message += " (caller's signature: " + signature + ")";
        promise.setError(std::move(error));
        return;
      }
      const DecodedMessage& message = reply.value();
      if (message.kind() == MessageKind::kError) {
        Error error = *message.fields().error;
        if (error.kind == ErrorKind::kUnimplemented) error.message += " (caller's signature: " + signature + ")";
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
      startCall(callOptions, worker, fields, std::move(frame).value(), std::move(complete));
    }
    return future;
  }

  template <typename R, typename... Params, typename... A>
  Future<R> rpcAsync(const std::string& worker, const Function<R(Params...)>& fn, A&&... args) {
    return rpcAsyncWith(CallOptions{}, worker, fn, std::forward<A>(args)...);
  }
  template <typename R, typename... Params, typename... A>
  R rpcSync(const std::string& worker, const Function<R(Params...)>& fn, A&&... args) {
    return rpcAsyncWith(CallOptions{}, worker, fn, std::forward<A>(args)...).get();
  }
  template <typename R, typename... Params, typename... A>
  R rpcSyncWith(const CallOptions& callOptions, const std::string& worker, const Function<R(Params...)>& fn,
                A&&... args) {
    return rpcAsyncWith(callOptions, worker, fn, std::forward<A>(args)...).get();
  }

  // Graceful (default): refuse new calls, meet every worker at a store barrier (bounded by
  // AgentConfig::shutdownTimeout; RpcError naming the workers that never arrived), drain in-flight calls
  // both ways, then close connections and stop threads. Non-graceful: fail pending calls and stop at once.
  // The agent is always torn down when shutdown returns or throws. Idempotent and safe to call
  // concurrently: a call made while another is in progress waits until that teardown is complete, then
  // returns quietly (the first caller alone reports the outcome); a later call returns at once. Throws
  // ValueError, touching nothing, on the agent's own threads (see the thread-safety note above).
  void shutdown(bool graceful = true);

  Executor& executor() { return *executor_; }
  PeerMetrics metrics(const std::string& worker) const;
  // Calls awaiting a response (all peers) and handlers running.
  size_t pendingCalls() const;
  size_t runningHandlers() const;
  // Timers this agent has armed and not yet fired or cancelled (call deadlines of both sides, the
  // heartbeat): a gauge for leak checks.
  size_t armedTimers() const { return timers_ ? timers_->pending() : 0; }

 private:
  using Completion = detail::MoveOnlyFunction<void(Result<DecodedMessage>&&)>;
  struct Peer;
  struct Link;
  struct Pending;
  struct Incoming;

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
  std::chrono::milliseconds effectiveTimeout(const CallOptions& callOptions) const;
  void startUp();
  void startCall(const CallOptions& callOptions, const std::string& worker, const EnvelopeFields& fields,
                 transport::OutgoingFrame frame, Completion complete);
  // Removes and returns pending call `id`; with `fromPeer`, only if that call went to that peer (a reply
  // from anyone else is ignored).
  std::unique_ptr<Pending> takePending(uint64_t id, const std::string* fromPeer = nullptr);
  void failPending(uint64_t id, Error error, bool sendCancel);

  // Links and handshake (loop thread).
  void adoptConnection(std::shared_ptr<transport::Connection> connection, const std::string& expectedPeer);
  void onFrame(const std::shared_ptr<Link>& link, transport::IncomingFrame&& frame);
  void onHandshake(const std::shared_ptr<Link>& link, const DecodedMessage& message);
  void onLinkClosed(const std::shared_ptr<Link>& link, const Error& error);
  // Logs and closes a link that failed the handshake. The failure aborts start() only when it concerns a
  // worker of this job (a link we opened, or a peer claiming a registered name): an anonymous stray
  // connection (port scanner, garbage, unknown name) is only logged.
  void refuseLink(const std::shared_ptr<Link>& link, const std::string& reason, const std::string& claimedName = {});
  void peerDown(const std::string& peer, const Error& error);

  void onCall(const std::shared_ptr<Link>& link, DecodedMessage message);
  void onReply(const std::string& peer, DecodedMessage message);
  void onCancel(const std::string& peer, const DecodedMessage& message);
  // The callee-side deadline of incoming call (peer, id) expired (timer thread): cancels its token.
  void onCallDeadline(const std::string& peer, uint64_t id, int64_t timeoutMicros);
  void sendFrame(const std::string& peer, transport::OutgoingFrame frame);
  void sendOn(const std::shared_ptr<Link>& link, transport::OutgoingFrame frame);
  void heartbeat();
  // Sets this rank's key under `tag`, then waits for every other rank's; with onlyStoreHostWaits, only the
  // rank hosting the store waits (the others may leave at once).
  void storeBarrier(const std::string& tag, std::chrono::steady_clock::time_point deadline,
                    bool onlyStoreHostWaits = false);
  void waitQuiet(bool outgoing, std::chrono::steady_clock::time_point deadline);
  void warn(const std::string& message) const;
  // Names the agent thread the caller is on ("executor", "transport loop", "timer"), or nullptr.
  const char* internalThreadName() const;
  void teardown();

  Options options_;
  AgentConfig config_;
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

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::unique_ptr<Peer>> peers_;          // GUARDED_BY(mutex_), fixed after start
  std::vector<std::shared_ptr<Link>> links_;                    // GUARDED_BY(mutex_): every live link
  std::unordered_map<uint64_t, std::unique_ptr<Pending>> pending_;        // GUARDED_BY(mutex_)
  std::map<std::pair<std::string, uint64_t>, std::unique_ptr<Incoming>> incoming_;  // GUARDED_BY(mutex_)
  std::optional<Error> startError_;                             // GUARDED_BY(mutex_)
  bool accepting_ = false;   // GUARDED_BY(mutex_): incoming calls are served
  bool callsOpen_ = false;   // GUARDED_BY(mutex_): new outgoing calls from non-executor threads allowed
  bool peersKnown_ = false;  // GUARDED_BY(mutex_): peers_ is filled in
  bool closed_ = false;                                         // GUARDED_BY(mutex_)
  TimerId heartbeatTimer_ = kInvalidTimerId;                    // GUARDED_BY(mutex_)
  // Held for the whole of shutdown(), so a concurrent caller waits for the teardown to complete.
  std::mutex shutdownMutex_;
  bool shutDown_ = false;  // GUARDED_BY(shutdownMutex_)
  std::atomic<bool> tornDown_{false};  // set once a shutdown() completed its teardown
};

}  // namespace distgrad::rpc
