// RRefContext: the per-agent side of remote references (ARCHITECTURE §6, docs/rref_protocol.md): the owner
// table (values this worker owns for others), the user table (forks of others' values this worker holds),
// the fork/accept/delete control protocol, and the owner-side queue that runs calls on values that are not
// ready yet (promise pipelining). Users reach it through RRef<T> (rref/rref.h) and
//   auto rrefs = rref::RRefContext::of(*agent);      // created on first use, kept in the agent's slot
//   RRef<Linear> m = rrefs->remote<Linear>("worker1", int64_t{4}, int64_t{2});
// rpc/ never depends on this layer: the context lives in the agent's extension slot (rpc::AgentExtension),
// its messages are ordinary calls of the "dg.rref.*" functions that rref::install(registry) binds before
// Agent::start, and RRefs travel in values through Codec<RRef<T>> with the agent's rpc::CodecScope.
// Thread-safety: every method may be called from any thread (one mutex guards the tables; no callback,
// send or value destructor runs under it). Nothing here blocks an executor thread. Each RRefContext owns
// one flusher thread (started at the first queued entry) that sends the batched deletions, accepts and fork requests (Note [Batched
// settlements] in context.cpp); it is joined when the context closes.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "rpc/agent.h"
#include "rpc/class.h"
#include "rpc/codec.h"
#include "rpc/error.h"
#include "rpc/future.h"
#include "rpc/registry.h"

namespace distgrad::rref {

using rpc::RRefId;
// Globally unique id of one user reference (a fork): the creating worker's rank in the top 16 bits, a
// counter of that worker below (RRefId::localId is made the same way, so ids never need a round trip).
using ForkId = uint64_t;

// The Error::remoteType of errors that mean "the owner of this RRef died" (kind kDisconnected, worker = the
// owner). Every waiter on an RRef of a dead owner fails with it.
inline constexpr const char* kOwnerLostType = "distgrad::rref::OwnerLost";
inline bool isOwnerLost(const rpc::Error& error) { return error.remoteType == kOwnerLostType; }

class RRefContext;

namespace detail {

// What the owner keeps for one RRef: a constructed object (class instance) or a value (the result encoder
// of a function or method, which also holds the typed value: rpc::detail::ResultEncoder<R>).
struct OwnedValue {
  rpc::ObjectHandle object;
  rpc::EncodeValueFn value;
};

// The reply to the call that created a user's RRef (Note [Value in creation reply] in context.cpp): the
// owner answers a value-creating call once the value is resolved, with the value itself when it is small
// and plain (no tensors, no RRefs). A toHere issued before the reply waits for it instead of fetching.
// Shared by the handle and the call's completion (which may outlive the handle).
class CreationReply {
 public:
  // Gets a view of the carried value (decodable as the RRef's type), or the error: the creation call
  // failed, or the reply carries no value (remoteType kNotCarriedType).
  using Waiter = std::function<void(rpc::Result<rpc::DecodedMessage>)>;
  // Runs `waiter` once the reply is in: at once (on this thread) when it is already, else on the thread
  // that completes the call (a transport loop: it must not block).
  void whenReplied(Waiter waiter);
  // The same as whenReplied's argument if the reply is in, else nothing.
  std::optional<rpc::Result<rpc::DecodedMessage>> ifReplied() const;
  // The creation call ended with `reply` (the owner's answer) or an error; runs the waiters.
  void complete(rpc::Result<rpc::DecodedMessage> reply);

 private:
  rpc::Result<rpc::DecodedMessage> view() const;  // replied_ is set

  mutable std::mutex mutex_;
  bool replied_ = false;  // GUARDED_BY(mutex_); once set, reply_ and error_ never change
  std::optional<rpc::DecodedMessage> reply_;  // the answer, when it carries the value
  rpc::Error error_;                          // else why there is no value
  std::vector<Waiter> waiters_;               // GUARDED_BY(mutex_)
};

// Marks a creation reply that carries no value (the reply's error when a caller asks for the value).
inline constexpr const char* kNotCarriedType = "distgrad::rref::NotCarried";

// One reference of this process to an RRef: all copies of an RRef<T> share it; its destructor tells the
// context (the owner's local count, or a user deletion, Note [User deletion]).
class RRefState {
 public:
  RRefState(std::shared_ptr<RRefContext> context, RRefId id, ForkId fork, std::string owner, bool isOwner);
  ~RRefState();
  RRefState(const RRefState&) = delete;
  RRefState& operator=(const RRefState&) = delete;

  const std::shared_ptr<RRefContext> context;
  const RRefId id;
  const ForkId fork;  // 0 on the owner
  const std::string owner;
  const bool isOwner;
  // The order of method calls made through this reference (Note [Call order]): a stream id unique to it
  // (the fork on a user, a fresh id on the owner) and the number of the last call issued.
  const uint64_t stream;
  std::atomic<uint64_t> lastCall{0};
  std::atomic<bool> confirmed{false};
  // A user's reference made by this process's remote() of a value: the creating call's reply (Note [Value
  // in creation reply]); null on the owner, for received forks and for objects. Set before the handle is
  // shared.
  std::shared_ptr<CreationReply> creation;
};

// The header of a "dg.rref.call" message; its value is the struct (header, arguments tuple). On the wire
// it is positional (Note [Positional call header] below), not a named struct.
struct CallHeader {
  int64_t kind = 0;  // CallKind
  std::string target;  // function name, or class name (constructor)
  std::string method;
  uint64_t hash = 0;   // signature hash of the function, constructor or method
  RRefId receiver;     // method calls: the RRef whose object runs the method
  RRefId result;       // kinds that store: the new RRef
  uint64_t resultFork = 0;  // the caller's fork of the result (0: the caller is the owner)
  // Method calls (Note [Call order]): the caller's reference to the receiver (its stream) and the call's
  // number in it, from 1; 0: unordered.
  uint64_t stream = 0;
  uint64_t seq = 0;
  template <class V>
  void visitFields(V& v) {
    v("kind", kind);
    v("target", target);
    v("method", method);
    v("hash", hash);
    v("receiver", receiver);
    v("result", result);
    v("resultFork", resultFork);
    v("stream", stream);
    v("seq", seq);
  }
};

enum class CallKind : int64_t {
  kFunction = 0,     // store fn(args) as `result`
  kConstruct = 1,    // store a new object of class `target` as `result`
  kMethodStore = 2,  // store receiver.method(args) as `result`
  kMethodValue = 3,  // reply with receiver.method(args)
  kCopy = 4,         // reply with a copy of the receiver (toHere of an object: its class's codec)
};

// The wire form of an RRef inside a value tree. The parent (the worker that sent it) is not on the wire:
// the receiver takes it from the message's CodecScope, so a worker cannot speak for another.
struct WireRRef {
  RRefId id;
  uint64_t fork = 0;
  template <class V>
  void visitFields(V& v) {
    v("id", id);
    v("fork", fork);
  }
};

inline const char* kCallFunction = "dg.rref.call";
inline constexpr uint64_t kCallHash = rpc::detail::fnv1a64("dg.rref.call(header,args)");
inline const char* kFetchFunction = "dg.rref.fetch";
inline constexpr uint64_t kFetchHash = rpc::detail::fnv1a64("dg.rref.fetch(rref)");

}  // namespace detail
}  // namespace distgrad::rref

namespace distgrad::rpc {

// Note [Positional call header]: the header of every RRef call (remote, method calls, toHere of objects)
// travels positionally (Note [Positional structs] in rpc/codec.h): the owner's decode of the nine named
// fields cost ~6,000 instructions per call (callgrind), a tenth of a remote()+toHere()'s user-space work on
// the owner. The kind's range is checked by serveCall.
template <>
struct Codec<rref::detail::CallHeader> : PositionalCodec<rref::detail::CallHeader> {};

}  // namespace distgrad::rpc

namespace distgrad::rref {

template <typename T>
class RRef;

class RRefContext : public rpc::AgentExtension,
                    public rpc::ReferenceSink,
                    public std::enable_shared_from_this<RRefContext> {
 public:
  // The context of `agent`, created on first use. Throws ValueError after the agent closed.
  static std::shared_ptr<RRefContext> of(rpc::Agent& agent);
  // Binds the "dg.rref.*" functions every worker that creates, holds or owns RRefs needs. Call it on the
  // Registry before Agent::start.
  static void install(rpc::Registry& registry);

  explicit RRefContext(rpc::Agent& agent);
  ~RRefContext() override;

  const std::string& name() const { return name_; }

  // remote(): the value lives on `worker` (its owner) and this call returns at once; the owner creates it
  // when the call arrives (see Note [Promise pipelining]).
  template <typename T, typename... A>
  RRef<T> remote(const std::string& worker, A&&... ctorArgs);  // T declared with DG_RREF_CLASS
  template <typename T, typename... A>
  RRef<T> remoteWith(const std::string& worker, const rpc::Class<T>& cls, A&&... ctorArgs);
  template <typename R, typename... P, typename... A>
  RRef<R> remote(const std::string& worker, const rpc::Function<R(P...)>& fn, A&&... args);
  // A new RRef owned by this worker holding `value`, resolved at once (PyTorch's local RRef(value)): how an
  // owner hands out references to values it already has, e.g. a RemoteModule's parameters (a Tensor
  // handle aliases the parameter's storage, so the owner's localValue() is the parameter itself).
  template <typename T>
  RRef<T> own(T value);
  // Runs `use` with this context's agent and returns true, or returns false once the agent closed (Note
  // [Agent lifetime]): how layers above RRef (RemoteModule) make ordinary calls about an RRef from a
  // handle that may outlive its agent. `use` must not block.
  bool withAgent(const std::function<void(rpc::Agent&)>& use);

  // Diagnosis and tests: entries of the owner table, this worker's user forks (alive or waiting to send
  // their deletion) and forks it passed on that their receivers have not accepted yet.
  size_t ownedCount() const;
  size_t userCount() const;
  size_t pendingChildCount() const;
  // Control messages sent and not yet answered (forks, accepts, deletions).
  size_t pendingControlCount() const;

  // rpc::AgentExtension
  void onPeerDown(const std::string& peer, const rpc::Error& error) override;
  void onShutdown(std::chrono::steady_clock::time_point deadline) override;
  void onAgentClosed() override;
  // rpc::ReferenceSink: forks carried by a message from `peer` that was dropped without decoding them
  // (Note [Unclaimed references]).
  void onUnclaimedReferences(const std::string& peer, std::vector<rpc::CarriedReference> refs) override;

  // ---- internals used by RRef<T> and Codec<RRef<T>> ----
  std::string workerOfRank(uint32_t rank) const;
  uint32_t rankOf(const std::string& worker) const;  // throws ValueError naming the workers
  uint32_t rank() const { return rank_; }
  uint64_t nextId() { return (static_cast<uint64_t>(rank_) << 48) | nextCounter_.fetch_add(1); }
  // A new handle of this process: on the owner a local reference (counted), on a user a fork.
  std::shared_ptr<detail::RRefState> makeOwnerHandle(RRefId id);
  std::shared_ptr<detail::RRefState> makeUserHandle(RRefId id, ForkId fork, bool confirmed);
  // A new owned entry, created and resolved with `value`, and a local handle to it.
  std::shared_ptr<detail::RRefState> makeOwned(detail::OwnedValue value);
  // Note [Fork on send]: the wire form of `state` sent to `peer`.
  detail::WireRRef fork(const std::shared_ptr<detail::RRefState>& state, const std::string& peer);
  // Undoes fork() for a message that was not sent (it failed to encode).
  void unfork(const std::shared_ptr<detail::RRefState>& state, ForkId fork);
  // Note [Fork on receive]: the handle for a received wire form, sent by `from`.
  std::shared_ptr<detail::RRefState> receive(const detail::WireRRef& wire, const std::string& from);
  void release(detail::RRefState& state);
  // Owner: calls `callback` (on the executor) with the value of `id` once it is resolved (Note [Resolve
  // wake-ups] in the .cpp: when the value is already there and the caller is an executor thread, on that
  // thread before returning).
  void whenResolved(RRefId id, std::function<void(rpc::Result<detail::OwnedValue>)> callback);
  // The same for a callback marked inline-safe (as then(kInlineSafe, f): short and thread-agnostic, e.g. it
  // completes a promise): it runs on whichever thread resolves the value, or inside this call if it is
  // resolved already.
  void whenResolved(RRefId id, std::function<void(rpc::Result<detail::OwnedValue>)> callback, rpc::InlineSafe);
  // Sends a "dg.rref.call" to `owner`; `done` gets the reply message or an error (OwnerLost when the owner
  // died). `orderedBy` (method calls): the caller's reference to the receiver, whose next call number the
  // call takes once its arguments are encoded (Note [Call order]).
  void callOwner(const std::string& owner, const detail::CallHeader& header, rpc::EncodeValueFn args,
                 std::function<void(rpc::Result<rpc::DecodedMessage>&&)> done,
                 detail::RRefState* orderedBy = nullptr, const rpc::CallOptions& options = {});
  // toHere of a value on a user: the value from the creation reply when it carried one (waiting for the
  // reply if it is not in yet, Note [Value in creation reply]), else a "dg.rref.fetch" to the owner. `done`
  // gets a message whose value decodes as the RRef's type, or the error.
  void valueOf(const std::shared_ptr<detail::RRefState>& state, std::chrono::milliseconds timeout,
               std::function<void(rpc::Result<rpc::DecodedMessage>&&)> done);
  // Sends a "dg.rref.fetch" of `id` to `owner` (reply: the value).
  void fetch(const std::string& owner, RRefId id, std::chrono::milliseconds timeout,
             std::function<void(rpc::Result<rpc::DecodedMessage>&&)> done);
  // Owner: the value of `id` if it is resolved.
  std::optional<rpc::Result<detail::OwnedValue>> tryValue(RRefId id);
  rpc::Executor& executor();
  // The user fork `fork` was confirmed by its owner (or failed to be): sends a deferred deletion.
  void confirmUser(ForkId fork, bool ownerKnowsIt);
  rpc::Error ownerLost(const std::string& owner, const rpc::Error& cause) const;
  // The calling thread blocks next until `ready()`, for an answer from `owner` already asked for: it may
  // read its connection to `owner` meanwhile (rpc::Agent::readWhileWaiting).
  void readWhileWaiting(const std::string& owner, const std::function<bool()>& ready);
  rpc::Agent::RawCompletion ownerReply(const std::string& owner,
                                       std::function<void(rpc::Result<rpc::DecodedMessage>&&)> done);

  // Handlers (owner side / parent side), called by the functions install() binds.
  rpc::Future<rpc::EncodeValueFn> serveCall(const rpc::DecodedMessage& message, const rpc::CallContext& ctx);
  rpc::Future<rpc::EncodeValueFn> serveFetch(RRefId id);
  void serveForkRequest(RRefId id, ForkId fork, const std::string& user);
  void serveDelete(RRefId id, ForkId fork);
  void serveChildAccept(ForkId fork);

 private:
  rpc::Future<rpc::EncodeValueFn> invokeMethod(const detail::OwnedValue& owned, const detail::CallHeader& header,
                                               const std::shared_ptr<rpc::DecodedMessage>& args,
                                               const rpc::CallContext& ctx);
  rpc::Result<rpc::EncodeValueFn> copyOf(const detail::OwnedValue& owned, const detail::CallHeader& header,
                                         const rpc::CallContext& ctx);
  rpc::Result<detail::OwnedValue> construct(const detail::CallHeader& header, const rpc::DecodedMessage& args,
                                            const rpc::CallContext& ctx);
  struct Waiter {
    std::function<void(rpc::Result<detail::OwnedValue>)> callback;
    bool inlineSafe = false;
  };
  void addWaiter(RRefId id, Waiter waiter);
  // Note [Call order]: runs `call` with the receiver's value once the calls numbered before it in its stream
  // ran; finishOrdered is called when its method returned and starts the next.
  using OrderedCall = std::function<void(rpc::Result<detail::OwnedValue>)>;
  void enqueueOrdered(RRefId id, uint64_t stream, uint64_t seq, OrderedCall call);
  void startOrdered(RRefId id, uint64_t stream, OrderedCall call);
  void finishOrdered(RRefId id, uint64_t stream);
  // Runs `waiter` with `value` (Note [Resolve wake-ups]): here when it is inline-safe, or when `onExecutor`
  // allows a plain one here; else posted. Inline runs nest at most rpc::detail::kMaxInlineDepth deep.
  void runWaiter(Waiter waiter, rpc::Result<detail::OwnedValue> value, bool onExecutor);
  // The method calls of one caller's reference on one RRef (Note [Call order]).
  struct CallStream {
    uint64_t next = 1;     // the number of the call that runs next
    bool running = false;  // a call of this stream is waiting for the value or running its method
    bool closed = false;   // the reference is gone: forget the stream once idle
    std::map<uint64_t, std::function<void(rpc::Result<detail::OwnedValue>)>> parked;  // arrived early
  };
  struct OwnerEntry {
    bool created = false;  // the creating call arrived (before: a placeholder made by an early message)
    std::optional<rpc::Result<detail::OwnedValue>> value;  // set once resolved
    std::vector<Waiter> waiters;
    std::map<ForkId, std::string> forks;  // user forks the owner knows, and the worker holding each
    int64_t localRefs = 0;
    std::unordered_map<uint64_t, CallStream> streams;
    int64_t orderedCalls = 0;  // calls parked or running in `streams`
  };
  struct UserEntry {
    RRefId id;
    std::string owner;
    std::weak_ptr<detail::RRefState> state;
    bool confirmed = false;
    bool released = false;  // every handle is gone: delete once confirmed
    // Note [Deferred fork requests]: a fork received from another user whose fork request still waits in
    // the outbox (not sent yet), and that user (the parent).
    bool requestQueued = false;
    std::string parent;
  };
  struct PendingChild {
    std::shared_ptr<detail::RRefState> parent;  // kept until the child is accepted (Note [Parent kept])
    std::string receiver;
  };

  // Caller holds mutex_.
  OwnerEntry& entryLocked(RRefId id);
  // The reference of `stream` is gone: forget the stream now if idle, else once its last call ran.
  void closeStreamLocked(OwnerEntry& entry, uint64_t stream);
  // Erases `id` when nothing refers to it; returns the erased entry (destroy it outside the lock).
  std::unique_ptr<OwnerEntry> maybeFreeLocked(RRefId id);
  void resolve(RRefId id, rpc::Result<detail::OwnedValue> value);
  void tombstoneLocked(ForkId fork);
  // Note [Control messages]: an idempotent control call, retried on timeout.
  // `send` issues the call; `done(delivered)` runs once it ended (delivered: the worker answered).
  void sendControl(const std::string& worker, std::function<rpc::Future<void>(rpc::Agent&)> send,
                   std::function<void(bool delivered)> done = {}, int attempt = 0);
  // Note [Batched settlements]: deletions and child accepts wait in a per-worker outbox, sent together by
  // the flusher thread.
  struct ForkRequest {
    detail::WireRRef fork;
    std::string parent;
  };
  struct Outbox {
    std::vector<ForkRequest> forkRequests;  // Note [Deferred fork requests]
    std::vector<detail::WireRRef> deletes;
    std::vector<uint64_t> accepts;
  };
  void sendDelete(const std::string& owner, RRefId id, ForkId fork);
  void sendChildAccept(const std::string& parent, ForkId fork);
  void queueSettlement(const std::string& worker, const std::function<void(Outbox&)>& add);
  void runFlusher();
  void flushOutbox();   // sends everything queued now (any thread)
  void stopFlusher();   // the agent closed (or the context dies): drop the outbox, join the flusher
  // The agent for one send, or nullptr once it closed (Note [Agent lifetime]).
  rpc::Agent* beginUse();
  void endUse();

  const std::string name_;
  const uint32_t rank_;
  const std::vector<std::string> workers_;  // by rank
  rpc::Executor* const executor_;
  std::atomic<uint64_t> nextCounter_{1};

  mutable std::mutex useMutex_;
  std::condition_variable useChanged_;
  rpc::Agent* agent_;  // GUARDED_BY(useMutex_): nullptr once the agent closed
  int activeUses_ = 0;  // GUARDED_BY(useMutex_)

  mutable std::mutex mutex_;
  std::map<std::pair<uint32_t, uint64_t>, std::unique_ptr<OwnerEntry>> owned_;  // GUARDED_BY(mutex_)
  std::unordered_map<ForkId, UserEntry> users_table_;                             // GUARDED_BY(mutex_)
  std::unordered_map<ForkId, PendingChild> children_;                             // GUARDED_BY(mutex_)
  std::unordered_set<ForkId> tombstones_;                                         // GUARDED_BY(mutex_)
  std::deque<ForkId> tombstoneOrder_;                                             // GUARDED_BY(mutex_)
  std::set<std::string> deadPeers_;                                               // GUARDED_BY(mutex_)
  std::atomic<size_t> pendingControl_{0};

  std::mutex outboxMutex_;
  std::condition_variable outboxChanged_;
  std::map<std::string, Outbox> outbox_;          // GUARDED_BY(outboxMutex_)
  std::atomic<size_t> queuedSettlements_{0};      // entries in outbox_ (written under outboxMutex_)
  std::thread flusher_;                           // GUARDED_BY(outboxMutex_): started on first use
  bool flusherIdle_ = false;                      // GUARDED_BY(outboxMutex_): waiting for an entry
  bool flushNow_ = false;                         // GUARDED_BY(outboxMutex_): shutting down, send at once
  bool flusherStopped_ = false;                   // GUARDED_BY(outboxMutex_)
};

}  // namespace distgrad::rref
