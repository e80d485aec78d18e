#include "rref/context.h"

#include <algorithm>
#include <iostream>
#include <thread>

#include <capnp/message.h>

#include "rpc/autograd_hook.h"
#include "rpc/trace.h"
#include "rref/rref.h"

namespace distgrad::rref {

namespace {

const char* const kExtensionKey = "dg.rref";
// Control messages (Note [Control messages]). Each is idempotent: a retry after a lost answer is harmless.
// Note [Batched settlements]: fork requests, user deletions and child accepts for one worker, sent together.
const rpc::Function<void(std::vector<detail::WireRRef>, std::vector<detail::WireRRef>, std::vector<uint64_t>)>
    kSettle{"dg.rref.settle"};
// How long a deletion or accept waits in the outbox for others to join it.
constexpr auto kSettleWindow = std::chrono::microseconds(1000);
constexpr int kControlAttempts = 5;
// Note [Value in creation reply]: the largest value (its Cap'n Proto encoding, in 8-byte words) a creation
// reply carries.
constexpr size_t kMaxCarriedWords = 512;
constexpr size_t kMaxTombstones = size_t{1} << 16;

std::pair<uint32_t, uint64_t> keyOf(RRefId id) { return {id.ownerWorkerId, id.localId}; }

std::string describe(RRefId id) {
  return "RRef(" + std::to_string(id.ownerWorkerId) + ":" + std::to_string(id.localId >> 48) + "." +
         std::to_string(id.localId & ((uint64_t{1} << 48) - 1)) + ")";
}

rpc::Future<rpc::EncodeValueFn> failedFuture(rpc::Executor& executor, rpc::Error error) {
  rpc::Promise<rpc::EncodeValueFn> promise(executor);
  promise.setError(std::move(error));
  return promise.getFuture();
}

// Note [Value in creation reply]: whether `value` may travel in a creation reply. It is encoded once
// into a scratch message without an agent's scope (so an RRef inside fails to encode and forks nothing):
// carried only when that succeeds with no payload (tensors stay with fetch, which hands each toHere its
// own buffers) and at most kMaxCarriedWords words. Small values cost well under a microsecond here.
bool carriable(const rpc::EncodeValueFn& value) {
  if (!value) return false;
  try {
    capnp::word first[64] = {};  // the scratch's first segment (zeroed, as capnp requires): no allocation
    capnp::MallocMessageBuilder scratch(kj::arrayPtr(first, 64));
    rpc::EncodeContext ctx;
    value(scratch.initRoot<rpc::wire::Value>(), ctx);
    return ctx.payloads().empty() && ctx.references().empty() && scratch.sizeInWords() <= kMaxCarriedWords;
  } catch (...) {
    return false;
  }
}

// The value of a creation reply: null (no value), or a struct whose one field is the value.
rpc::EncodeValueFn creationReply(rpc::EncodeValueFn carried) {
  if (!carried) return {};
  return [carried = std::move(carried)](rpc::wire::Value::Builder out, rpc::EncodeContext& ctx) {
    auto fields = out.initStruct(1);
    carried(fields[0].initValue(), ctx);
  };
}

}  // namespace

// ---- handles ----

namespace detail {

RRefState::RRefState(std::shared_ptr<RRefContext> ctx, RRefId rrefId, ForkId forkId, std::string ownerName,
                     bool owned)
    : context(std::move(ctx)),
      id(rrefId),
      fork(forkId),
      owner(std::move(ownerName)),
      isOwner(owned),
      stream(owned ? context->nextId() : forkId) {
  confirmed.store(owned);
}

RRefState::~RRefState() {
  try {
    context->release(*this);
  } catch (const std::exception& e) {
    std::cerr << "[distgrad rref] releasing " << describe(id) << " failed: " << e.what() << "\n";
  }
}

void CreationReply::whenReplied(Waiter waiter) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!replied_) {
      waiters_.push_back(std::move(waiter));
      return;
    }
  }
  // The outcome is immutable once replied_ is set: read it without the lock.
  waiter(view());
}

void CreationReply::complete(rpc::Result<rpc::DecodedMessage> reply) {
  // The carried value is the reply's only field; a reply without one is null.
  bool carries = false;
  if (reply.ok()) {
    try {
      carries = reply.value().value().isStruct();
    } catch (...) {
      carries = true;  // malformed: decoding the view reports it
    }
  }
  std::vector<Waiter> waiters;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (replied_) return;
    replied_ = true;
    if (!reply.ok()) {
      error_ = reply.error();
    } else if (carries) {
      reply_.emplace(std::move(reply).value());
    } else {
      error_ = rpc::Error::failed("the creation reply carries no value");
      error_.remoteType = kNotCarriedType;
    }
    waiters.swap(waiters_);
  }
  for (auto& waiter : waiters) waiter(view());
}

std::optional<rpc::Result<rpc::DecodedMessage>> CreationReply::ifReplied() const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!replied_) return std::nullopt;
  }
  return view();
}

rpc::Result<rpc::DecodedMessage> CreationReply::view() const {
  if (!reply_) return error_;
  return reply_->fieldView(0);
}

}  // namespace detail

// ---- setup ----

std::shared_ptr<RRefContext> RRefContext::of(rpc::Agent& agent) {
  auto extension = agent.extension(kExtensionKey, [](rpc::Agent& a) -> std::shared_ptr<rpc::AgentExtension> {
    return std::make_shared<RRefContext>(a);
  });
  return std::static_pointer_cast<RRefContext>(extension);
}

void RRefContext::install(rpc::Registry& registry) {
  // Note [Unclaimed references]: forks carried by messages nobody decodes come back here.
  registry.setReferenceSink([](rpc::Agent& agent) -> std::shared_ptr<rpc::ReferenceSink> { return of(agent); });
  // Table updates under one lock: inline on the loop, no hand-off (Note [Inline handlers] in rpc/agent.cpp).
  registry.bind(
      kSettle,
      [](const rpc::CallContext& ctx, std::vector<detail::WireRRef> forks, std::vector<detail::WireRRef> deletes,
         std::vector<uint64_t> accepts) {
        auto self = RRefContext::of(*ctx.agent);
        // Registrations first: a fork is never deleted in the batch that registers it (its deletion waits
        // for this answer, Note [User deletion]), but keep the order obvious.
        for (const detail::WireRRef& f : forks) self->serveForkRequest(f.id, f.fork, ctx.caller);
        for (const detail::WireRRef& d : deletes) self->serveDelete(d.id, d.fork);
        for (uint64_t fork : accepts) self->serveChildAccept(fork);
      },
      rpc::Dispatch::kInline);
  rpc::BoundFunction call;
  call.name = detail::kCallFunction;
  call.signature = "dg.rref.call(header,args)";
  call.hash = detail::kCallHash;
  call.invoke = [](const rpc::DecodedMessage& message, const rpc::CallContext& ctx, rpc::Executor&) {
    return RRefContext::of(*ctx.agent)->serveCall(message, ctx);
  };
  registry.bindEntry(std::move(call));
  rpc::BoundFunction fetch;
  fetch.name = detail::kFetchFunction;
  fetch.signature = "dg.rref.fetch(rref)";
  fetch.hash = detail::kFetchHash;
  // Answers from the table, or later through a callback when the value resolves: never blocks, so it runs
  // on the loop and a fetch of a ready value costs the callee no thread hand-off (Note [Inline handlers]).
  fetch.dispatch = rpc::Dispatch::kInline;
  fetch.invoke = [](const rpc::DecodedMessage& message, const rpc::CallContext& ctx,
                    rpc::Executor& executor) -> rpc::Future<rpc::EncodeValueFn> {
    auto args = message.decodeArgs<RRefId>();
    if (!args.ok()) return failedFuture(executor, args.error());
    return RRefContext::of(*ctx.agent)->serveFetch(std::get<0>(args.value()));
  };
  registry.bindEntry(std::move(fetch));
}

RRefContext::RRefContext(rpc::Agent& agent)
    : name_(agent.name()),
      rank_(static_cast<uint32_t>(agent.rank())),
      workers_(agent.workerNames()),
      executor_(&agent.executor()),
      agent_(&agent) {}

RRefContext::~RRefContext() { stopFlusher(); }

std::string RRefContext::workerOfRank(uint32_t rank) const {
  if (rank >= workers_.size()) {
    throw rpc::CodecError("RRef owner rank " + std::to_string(rank) + " is not in this job (" +
                          std::to_string(workers_.size()) + " workers)");
  }
  return workers_[rank];
}

uint32_t RRefContext::rankOf(const std::string& worker) const {
  auto it = std::find(workers_.begin(), workers_.end(), worker);
  if (it == workers_.end()) {
    std::string names;
    for (const auto& w : workers_) names += (names.empty() ? "" : ", ") + w;
    DG_CHECK(false, "rref: unknown worker '", worker, "' (workers: ", names, ")");
  }
  return static_cast<uint32_t>(it - workers_.begin());
}

rpc::Executor& RRefContext::executor() { return *executor_; }

rpc::Agent* RRefContext::beginUse() {
  std::lock_guard<std::mutex> lock(useMutex_);
  if (agent_ == nullptr) return nullptr;
  ++activeUses_;
  return agent_;
}

void RRefContext::endUse() {
  std::lock_guard<std::mutex> lock(useMutex_);
  if (--activeUses_ == 0) useChanged_.notify_all();
}

bool RRefContext::withAgent(const std::function<void(rpc::Agent&)>& use) {
  rpc::Agent* agent = beginUse();
  if (agent == nullptr) return false;
  try {
    use(*agent);
  } catch (...) {
    endUse();
    throw;
  }
  endUse();
  return true;
}

rpc::Error RRefContext::ownerLost(const std::string& owner, const rpc::Error& cause) const {
  rpc::Error error = rpc::Error::disconnected("OwnerLost: " + owner + ", the owner of the RRef, is gone (" +
                                             cause.message + ")");
  error.worker = owner;
  error.remoteType = kOwnerLostType;
  return error;
}

size_t RRefContext::ownedCount() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return owned_.size();
}
size_t RRefContext::userCount() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return users_table_.size();
}
size_t RRefContext::pendingChildCount() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return children_.size();
}
size_t RRefContext::pendingControlCount() const { return pendingControl_.load() + queuedSettlements_.load(); }

// ---- sending ----


// The completion of a call to `owner`: a disconnection from the owner becomes OwnerLost, an error reply
// becomes the error, a value reply is passed on.
rpc::Agent::RawCompletion RRefContext::ownerReply(const std::string& owner,
                                                  std::function<void(rpc::Result<rpc::DecodedMessage>&&)> done) {
  return [self = shared_from_this(), owner, done = std::move(done)](rpc::Result<rpc::DecodedMessage>&& reply) {
    if (!reply.ok()) {
      rpc::Error error = reply.error();
      if (error.kind == rpc::ErrorKind::kDisconnected && (error.worker == owner || error.worker.empty())) {
        error = self->ownerLost(owner, error);
      }
      return done(std::move(error));
    }
    if (reply.value().kind() == rpc::MessageKind::kError) return done(*reply.value().fields().error);
    done(std::move(reply));
  };
}

void RRefContext::callOwner(const std::string& owner, const detail::CallHeader& header, rpc::EncodeValueFn args,
                            std::function<void(rpc::Result<rpc::DecodedMessage>&&)> done,
                            detail::RRefState* orderedBy, const rpc::CallOptions& options) {
  rpc::Agent* agent = beginUse();
  if (agent == nullptr) {
    done(rpc::Error::failed("agent " + name_ + " is shut down: RRef call refused"));
    return;
  }
  auto encode = [&header, &args, orderedBy](rpc::wire::Value::Builder out, rpc::EncodeContext& ctx) {
    auto fields = out.initStruct(2);
    if (args) {
      args(fields[1].initValue(), ctx);
    } else {
      fields[1].initValue().setNull();
    }
    if (orderedBy == nullptr) {
      rpc::Codec<detail::CallHeader>::encode(fields[0].initValue(), header, ctx);
      return;
    }
    // Numbered after the arguments encoded: a call that fails to encode never leaves a gap in its stream
    // (Note [Call order]).
    detail::CallHeader numbered = header;
    numbered.stream = orderedBy->stream;
    numbered.seq = orderedBy->lastCall.fetch_add(1) + 1;
    rpc::Codec<detail::CallHeader>::encode(fields[0].initValue(), numbered, ctx);
  };
  agent->rpcRaw(options, owner, detail::kCallFunction, detail::kCallHash, encode, ownerReply(owner, std::move(done)));
  endUse();
}

// Note [Value in creation reply] (the user's side): toHere of a value made by this process's remote()
// takes it from the creation reply when that carried it; one issued before the reply came waits for it
// instead of sending a fetch, so remote() + toHere() is one message each way. When the reply carries no
// value (too large, tensors or RRefs inside, an error, an object) or the call did not end with a reply
// (timed out: the value took longer than the agent's default timeout), a fetch follows, which answers as
// before; only OwnerLost ends the wait at once. An explicit timeout bounds this toHere alone, so it
// fetches at once unless the value is already here.
void RRefContext::valueOf(const std::shared_ptr<detail::RRefState>& state, std::chrono::milliseconds timeout,
                          std::function<void(rpc::Result<rpc::DecodedMessage>&&)> done) {
  // A fetch sent later (from the thread that completes the creation call) belongs to this toHere's
  // distributed autograd context all the same: its answer's tensors join the caller's graph.
  const uint64_t autogradContext = rpc::activeAutogradContext();
  auto fetchValue = [self = shared_from_this(), state, timeout, autogradContext](
                        std::function<void(rpc::Result<rpc::DecodedMessage>&&)> then) {
    rpc::AutogradContextScope active(autogradContext);
    // The handle is kept until the answer, so the user's deletion cannot overtake the fetch.
    self->fetch(state->owner, state->id, timeout,
                [keep = state, then = std::move(then)](rpc::Result<rpc::DecodedMessage>&& reply) {
                  then(std::move(reply));
                });
  };
  if (!state->creation) return fetchValue(std::move(done));
  auto onReply = [fetchValue, done](rpc::Result<rpc::DecodedMessage> value) mutable {
    if (value.ok() || isOwnerLost(value.error())) return done(std::move(value));
    fetchValue(std::move(done));
  };
  if (timeout.count() == 0) return state->creation->whenReplied(std::move(onReply));
  // Only a value already here; otherwise the fetch, bounded by `timeout`.
  auto ready = state->creation->ifReplied();
  if (ready && ready->ok()) return done(std::move(*ready));
  fetchValue(std::move(done));
}

void RRefContext::fetch(const std::string& owner, RRefId id, std::chrono::milliseconds timeout,
                        std::function<void(rpc::Result<rpc::DecodedMessage>&&)> done) {
  rpc::Agent* agent = beginUse();
  if (agent == nullptr) {
    done(rpc::Error::failed("agent " + name_ + " is shut down: RRef fetch refused"));
    return;
  }
  rpc::CallOptions options;
  options.timeout = timeout;
  auto encode = [id](rpc::wire::Value::Builder out, rpc::EncodeContext& ctx) {
    rpc::detail::TupleCodec<std::tuple<RRefId>, RRefId>::encode(out, std::make_tuple(id), ctx);
  };
  agent->rpcRaw(options, owner, detail::kFetchFunction, detail::kFetchHash, encode, ownerReply(owner, std::move(done)));
  endUse();
}

void RRefContext::readWhileWaiting(const std::string& owner, const std::function<bool()>& ready) {
  rpc::Agent* agent = beginUse();
  if (agent == nullptr) return;
  struct EndUse {
    RRefContext* context;
    ~EndUse() { context->endUse(); }
  } endUse{this};
  agent->readWhileWaiting(owner, ready);
}

// Note [Control messages]: fork requests, child accepts and user deletions are calls of idempotent
// functions (a fork already known, a deleted fork or an accepted child is a no-op; deleted forks are
// remembered as tombstones so a late duplicate fork request cannot resurrect one). A call that timed out or
// met an overloaded peer is retried (kControlAttempts in all); one to a dead worker is dropped, since the
// death itself settles the count (Note [Worker death]).
void RRefContext::sendControl(const std::string& worker, std::function<rpc::Future<void>(rpc::Agent&)> send,
                              std::function<void(bool)> done, int attempt) {
  bool dead = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dead = deadPeers_.count(worker) != 0;
  }
  if (dead) {
    if (done) done(false);  // outside the lock: it confirms forks (confirmUser takes mutex_)
    return;
  }
  rpc::Agent* agent = beginUse();
  if (agent == nullptr) {
    if (done) done(false);
    return;
  }
  ++pendingControl_;
  // Reference-counting traffic belongs to no distributed autograd context, whatever the thread's is.
  rpc::Future<void> future = [&] {
    rpc::AutogradContextScope outside(0);
    return send(*agent);
  }();
  endUse();
  auto self = shared_from_this();
  // Note [Control answers inline]: what follows an answer is bookkeeping and more asynchronous sends
  // (confirm a fork, send a deferred deletion or a child accept, retry): short, non-blocking and
  // thread-agnostic, so it runs on the thread that completed the call (the transport loop, as a creation
  // reply's confirmation already does) instead of waking an executor thread per control message. Those
  // wake-ups competed with the RPCs being measured on the same workers (bench_rref: one per operation in
  // remote_tohere, three in fork_third_fetch).
  (void)std::move(future).then(rpc::kInlineSafe, [self, worker, send = std::move(send), done = std::move(done),
                                                  attempt](rpc::Result<void>&& result) mutable {
    if (!result.ok()) {
      const auto kind = result.error().kind;
      if ((kind == rpc::ErrorKind::kTimeout || kind == rpc::ErrorKind::kOverloaded) &&
          attempt + 1 < kControlAttempts) {
        self->sendControl(worker, std::move(send), std::move(done), attempt + 1);
        --self->pendingControl_;
        return;
      }
      if (kind != rpc::ErrorKind::kDisconnected) {
        std::cerr << "[distgrad rref] " << self->name_ << ": control message to " << worker
                  << " failed: " << result.error().describe() << "\n";
      }
    }
    if (done) done(result.ok());
    --self->pendingControl_;
  });
}

// Note [Batched settlements]
// A user deletion and a child accept used to be one call each, sent by the thread that dropped the last
// handle: in remote() + toHere() + drop, the deletion's encoding and send ran inside the operation, and its
// call, answer and wake-ups on both workers competed with the next operation (bench_rref remote_tohere).
// Both are now queued per worker (the outbox) and sent as one "dg.rref.settle(deletes, accepts)" call by
// the context's flusher thread, at most kSettleWindow after the first of them was queued (a graceful
// shutdown flushes at once). The guarantees are unchanged: the owner still hears of every deletion, only
// later (which can only keep a value longer); a deletion is still queued only once its fork is confirmed
// (Note [User deletion]); each entry is idempotent, so the batch is retried as a whole (Note [Control
// messages]); a batch to a dead worker is dropped (its death settled the count); queued entries count in
// pendingControlCount(), so shutdown and the leak checks wait for them.
void RRefContext::sendDelete(const std::string& owner, RRefId id, ForkId fork) {
  queueSettlement(owner, [&](Outbox& box) { box.deletes.push_back(detail::WireRRef{id, fork}); });
}

void RRefContext::sendChildAccept(const std::string& parent, ForkId fork) {
  queueSettlement(parent, [&](Outbox& box) { box.accepts.push_back(fork); });
}

void RRefContext::queueSettlement(const std::string& worker, const std::function<void(Outbox&)>& add) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(outboxMutex_);
    if (flusherStopped_) return;  // the agent closed: nothing is sent any more (Note [Agent lifetime])
    add(outbox_[worker]);
    ++queuedSettlements_;
    if (!flusher_.joinable()) flusher_ = std::thread([this] { runFlusher(); });
    wake = flusherIdle_;
    flusherIdle_ = false;
  }
  if (wake) outboxChanged_.notify_one();
}

void RRefContext::runFlusher() {
  std::unique_lock<std::mutex> lock(outboxMutex_);
  while (!flusherStopped_) {
    if (outbox_.empty()) {
      flusherIdle_ = true;
      outboxChanged_.wait(lock, [&] { return flusherStopped_ || !outbox_.empty(); });
      flusherIdle_ = false;
      continue;
    }
    // Let more settlements join the batch (woken early by a flush request or the agent closing).
    outboxChanged_.wait_for(lock, kSettleWindow, [&] { return flusherStopped_ || flushNow_; });
    if (flusherStopped_) break;
    lock.unlock();
    flushOutbox();
    lock.lock();
  }
}

void RRefContext::flushOutbox() {
  std::map<std::string, Outbox> batches;
  size_t count = 0;
  {
    std::lock_guard<std::mutex> lock(outboxMutex_);
    batches.swap(outbox_);
    for (const auto& [worker, box] : batches) {
      count += box.forkRequests.size() + box.deletes.size() + box.accepts.size();
    }
  }
  // Fork requests: sent now unless their handle was released meanwhile (release() cancelled them).
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [worker, box] : batches) {
      std::erase_if(box.forkRequests, [&](const ForkRequest& request) {
        auto it = users_table_.find(request.fork.fork);
        if (it == users_table_.end() || !it->second.requestQueued) return true;
        it->second.requestQueued = false;  // in flight: its answer confirms the fork
        return false;
      });
    }
  }
  // Counted as control calls from here (sendControl) before the queue count drops, so the total never
  // reads zero in between.
  auto self = shared_from_this();
  for (auto& [worker, box] : batches) {
    if (box.forkRequests.empty() && box.deletes.empty() && box.accepts.empty()) continue;
    auto batch = std::make_shared<Outbox>(std::move(box));
    const std::string peer = worker;
    std::vector<detail::WireRRef> forks;
    for (const ForkRequest& request : batch->forkRequests) forks.push_back(request.fork);
    sendControl(
        peer,
        [peer, batch, forks = std::move(forks)](rpc::Agent& agent) {
          return agent.rpcAsync(peer, kSettle, forks, batch->deletes, batch->accepts);
        },
        [self, batch](bool delivered) {
          // Note [Fork on receive]: the owner knows the forks now; their parents may let go (even when the
          // owner is gone).
          for (const ForkRequest& request : batch->forkRequests) {
            self->confirmUser(request.fork.fork, delivered);
            self->sendChildAccept(request.parent, request.fork.fork);
          }
        });
  }
  std::lock_guard<std::mutex> lock(outboxMutex_);
  if (!flusherStopped_) queuedSettlements_ -= count;  // stopFlusher zeroed it
}

void RRefContext::stopFlusher() {
  std::thread flusher;
  {
    std::lock_guard<std::mutex> lock(outboxMutex_);
    flusherStopped_ = true;
    queuedSettlements_ = 0;
    outbox_.clear();
    flusher.swap(flusher_);
  }
  outboxChanged_.notify_all();
  if (!flusher.joinable()) return;
  if (flusher.get_id() == std::this_thread::get_id()) {
    flusher.detach();  // the flusher dropped the context's last reference: it returns right after
  } else {
    flusher.join();
  }
}

// ---- handles of this process ----

std::shared_ptr<detail::RRefState> RRefContext::makeOwnerHandle(RRefId id) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++entryLocked(id).localRefs;
  }
  return std::make_shared<detail::RRefState>(shared_from_this(), id, 0, name_, /*isOwner=*/true);
}

std::shared_ptr<detail::RRefState> RRefContext::makeOwned(detail::OwnedValue value) {
  const RRefId id{rank_, nextId()};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    OwnerEntry& entry = entryLocked(id);
    entry.created = true;
    entry.value = rpc::Result<detail::OwnedValue>(std::move(value));
    ++entry.localRefs;
  }
  return std::make_shared<detail::RRefState>(shared_from_this(), id, 0, name_, /*isOwner=*/true);
}

std::shared_ptr<detail::RRefState> RRefContext::makeUserHandle(RRefId id, ForkId fork, bool confirmed) {
  const std::string owner = workerOfRank(id.ownerWorkerId);
  auto state = std::make_shared<detail::RRefState>(shared_from_this(), id, fork, owner, /*isOwner=*/false);
  state->confirmed.store(confirmed);
  std::lock_guard<std::mutex> lock(mutex_);
  UserEntry entry;
  entry.id = id;
  entry.owner = owner;
  entry.state = state;
  entry.confirmed = confirmed;
  users_table_[fork] = std::move(entry);
  return state;
}

// Note [User deletion]: the last handle of a fork in this process is gone. Its owner must hear of it
// (G2), but only after it knew the fork: an unconfirmed fork (its creating call or fork request not
// answered yet) is marked released and its deletion is sent by confirmUser. Otherwise a deletion could
// overtake the fork request and the owner would free a value another fork still needs.
void RRefContext::release(detail::RRefState& state) {
  if (state.isOwner) {
    std::unique_ptr<OwnerEntry> freed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = owned_.find(keyOf(state.id));
      if (it == owned_.end()) return;
      --it->second->localRefs;
      closeStreamLocked(*it->second, state.stream);
      freed = maybeFreeLocked(state.id);
    }
    return;  // `freed` (the value) is destroyed here, outside the lock
  }
  bool sendNow = false;
  bool ownerDead = false;
  std::string cancelledParent;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = users_table_.find(state.fork);
    if (it == users_table_.end()) return;
    ownerDead = deadPeers_.count(it->second.owner) != 0;
    if (it->second.requestQueued && state.lastCall.load() == 0) {
      // Note [Deferred fork requests]: the owner never heard of this fork and never will: the parent's
      // reference covered it all along. A child accept settles it.
      cancelledParent = it->second.parent;
      users_table_.erase(it);
    } else if (it->second.confirmed || ownerDead) {
      users_table_.erase(it);
      sendNow = !ownerDead;
    } else {
      it->second.released = true;
    }
  }
  if (sendNow) sendDelete(state.owner, state.id, state.fork);
  if (!cancelledParent.empty()) {
    {
      std::lock_guard<std::mutex> lock(outboxMutex_);
      auto box = outbox_.find(state.owner);
      if (box != outbox_.end()) {
        // Still queued: take it out (the flusher, if it took the batch already, drops it: the entry is gone).
        const size_t before = box->second.forkRequests.size();
        std::erase_if(box->second.forkRequests,
                      [&](const ForkRequest& request) { return request.fork.fork == state.fork; });
        queuedSettlements_ -= before - box->second.forkRequests.size();
      }
    }
    sendChildAccept(cancelledParent, state.fork);
  }
}

void RRefContext::confirmUser(ForkId fork, bool ownerKnowsIt) {
  std::optional<UserEntry> toDelete;
  // Declared before the lock: if the user drops its RRef meanwhile, this may be the last reference, and
  // ~RRefState (release) takes mutex_, so it must run after the lock is released.
  std::shared_ptr<detail::RRefState> state;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = users_table_.find(fork);
    if (it == users_table_.end()) return;
    it->second.confirmed = true;
    state = it->second.state.lock();
    if (state) state->confirmed.store(true);
    if (it->second.released) {
      if (ownerKnowsIt && deadPeers_.count(it->second.owner) == 0) toDelete = it->second;
      users_table_.erase(it);
    }
  }
  if (toDelete) sendDelete(toDelete->owner, toDelete->id, fork);
}

// Note [Fork on send]: every RRef written into a message gets a new fork id for its receiver.
//  - Sent by the owner: the owner adds the fork to its table at once, held by the receiver (Note [Early
//    fork registration]); the receiver's reference is confirmed on arrival.
//  - Sent by a user: the sender keeps its own reference alive as a pending child (Note [Parent kept])
//    until the receiver says the owner knows the new fork (child accept). So the owner's count never
//    drops to zero while a reference is in flight between users (G1).
// A message to an unknown worker is refused here (a CodecError fails its encoding, nothing registered);
// one to a worker known dead registers nothing: the agent refuses the send, and the death already settled
// that worker's forks (Note [Worker death]), so a fork registered now would never be dropped.
detail::WireRRef RRefContext::fork(const std::shared_ptr<detail::RRefState>& state, const std::string& peer) {
  if (peer != name_ && std::find(workers_.begin(), workers_.end(), peer) == workers_.end()) {
    throw rpc::CodecError("cannot send an RRef to unknown worker '" + peer + "'");
  }
  const ForkId child = nextId();
  std::lock_guard<std::mutex> lock(mutex_);
  if (deadPeers_.count(peer) != 0) return detail::WireRRef{state->id, child};
  if (state->isOwner) {
    entryLocked(state->id).forks[child] = peer;
  } else {
    children_[child] = PendingChild{state, peer};
  }
  return detail::WireRRef{state->id, child};
}

void RRefContext::unfork(const std::shared_ptr<detail::RRefState>& state, ForkId fork) {
  std::unique_ptr<OwnerEntry> freed;
  PendingChild child;  // released after the lock (it may hold this process's last handle)
  std::lock_guard<std::mutex> lock(mutex_);
  if (state->isOwner) {
    auto it = owned_.find(keyOf(state->id));
    if (it == owned_.end()) return;
    it->second->forks.erase(fork);
    freed = maybeFreeLocked(state->id);
  } else {
    auto it = children_.find(fork);
    if (it == children_.end()) return;
    child = std::move(it->second);
    children_.erase(it);
  }
  // `freed` and `child` are declared before the guard: they die after it is released.
}

// Note [Unclaimed references]: every message lists the forks its value carries (rpc: the envelope's
// `references`, Note [Carried references] in rpc/agent.cpp). A received message dropped before a codec
// decoded one of them (a call of an unknown function or with a mismatched signature, refused because the
// worker is shutting down, whose arguments failed to decode, a pipelined call whose receiver failed or
// whose constructor does not exist, a reply that came after its caller stopped waiting, and any path that
// drops a message in the future)
// hands the unclaimed forks here when its last view goes. Each is settled as if it had been received and
// its handle dropped at once, with the fewest messages:
//  - this worker owns it: from itself (a self call), the fork registered on send is removed; from a user,
//    child accept to that parent (Note [Phantom fork]: the owner's table never held it);
//  - sent by its owner, which registered it for us: a user deletion;
//  - sent by another user: the owner never heard of the fork, so child accept to the parent is all (it
//    lets go of the reference it kept for the child, Note [Parent kept]); no fork request is needed.
void RRefContext::onUnclaimedReferences(const std::string& from, std::vector<rpc::CarriedReference> refs) {
  for (const rpc::CarriedReference& ref : refs) {
    if (ref.id.ownerWorkerId >= workers_.size()) continue;  // not a reference of this job: nothing to settle
    const std::string& owner = workers_[ref.id.ownerWorkerId];
    if (from == name_) {
      // From this worker to itself: undo the send's registration directly.
      std::unique_ptr<OwnerEntry> freed;
      PendingChild child;
      std::lock_guard<std::mutex> lock(mutex_);
      if (owner == name_) {
        auto it = owned_.find(keyOf(ref.id));
        if (it == owned_.end()) continue;
        it->second->forks.erase(ref.fork);
        freed = maybeFreeLocked(ref.id);
      } else if (auto it = children_.find(ref.fork); it != children_.end()) {
        child = std::move(it->second);
        children_.erase(it);
      }
      continue;  // `freed` and `child` die after the lock
    }
    if (owner != name_ && from == owner) {
      sendDelete(owner, ref.id, ref.fork);
    } else {
      sendChildAccept(from, ref.fork);
    }
  }
}

// Note [Deferred fork requests]
// A user receiving a fork from another user used to send its fork request to the owner at once; in the
// usual pattern (a handler receives an RRef, fetches it or calls it, returns) that request, its answer and
// the deletion that followed were three control messages on the owner's connection around the one fetch
// that mattered (bench_rref fork_third_fetch). The request now waits in the outbox (Note [Batched
// settlements]) like a deletion, for at most the settle window. When the handle is released before it was
// sent, and it issued no ordered method call (whose stream the owner would keep), the request is taken out
// and a child accept to the parent is all that is sent: the owner never hears of the fork, exactly as for a
// fork nobody decoded (Note [Unclaimed references]). This is safe because the parent keeps its reference
// until the child accepts (Note [Parent kept], G1): everything the child did — fetches and calls, which
// also keep the handle until answered — happened while the owner's count could not reach zero. Otherwise
// the request goes out with the batch and its answer confirms the fork and sends the child accept, as
// before. Cost: a long-lived fork is confirmed (and its parent released) up to one window later, and a
// parent that dies meanwhile leaves the child unregistered for that much longer than the request's flight.

// Note [Fork on receive]: the receiver of a fork, sent by `from` (the parent):
//  - the owner itself: a local reference. From itself (a self call) it removes the fork it registered on
//    send; from a user it answers child accept at once (Note [Phantom fork]: the fork never enters the
//    owner's table, the local reference counts instead).
//  - a user, from the owner: already registered, confirmed.
//  - a user, from another user: a fork request to the owner (Note [Deferred fork requests]); once
//    answered, the reference is confirmed and a child accept goes to the parent, which then drops its
//    pending child.
std::shared_ptr<detail::RRefState> RRefContext::receive(const detail::WireRRef& wire, const std::string& from) {
  const std::string owner = workerOfRank(wire.id.ownerWorkerId);
  if (owner == name_) {
    auto handle = makeOwnerHandle(wire.id);
    if (from == name_) {
      std::lock_guard<std::mutex> lock(mutex_);
      entryLocked(wire.id).forks.erase(wire.fork);
    } else {
      sendChildAccept(from, wire.fork);
    }
    return handle;
  }
  if (from == owner) return makeUserHandle(wire.id, wire.fork, /*confirmed=*/true);
  auto handle = makeUserHandle(wire.id, wire.fork, /*confirmed=*/false);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = users_table_.find(wire.fork);
    if (it != users_table_.end()) {
      it->second.requestQueued = true;
      it->second.parent = from;
    }
  }
  // Note [Deferred fork requests]: queued, not sent; its answer confirms the fork and sends the child accept.
  queueSettlement(owner, [&](Outbox& box) { box.forkRequests.push_back(ForkRequest{wire, from}); });
  return handle;
}

// ---- owner side ----

RRefContext::OwnerEntry& RRefContext::entryLocked(RRefId id) {
  auto& slot = owned_[keyOf(id)];
  if (!slot) slot = std::make_unique<OwnerEntry>();
  return *slot;
}

// The owner frees a value exactly when nothing refers to it: no user fork, no local reference, no call
// waiting for it, and its creating call has arrived (before that, a placeholder made by an early fork
// request or pipelined call must stay).
std::unique_ptr<RRefContext::OwnerEntry> RRefContext::maybeFreeLocked(RRefId id) {
  auto it = owned_.find(keyOf(id));
  if (it == owned_.end()) return nullptr;
  OwnerEntry& entry = *it->second;
  if (!entry.created || !entry.forks.empty() || entry.localRefs > 0 || !entry.waiters.empty() ||
      entry.orderedCalls > 0) {
    return nullptr;
  }
  auto freed = std::move(it->second);
  owned_.erase(it);
  return freed;
}

void RRefContext::tombstoneLocked(ForkId fork) {
  if (!tombstones_.insert(fork).second) return;
  tombstoneOrder_.push_back(fork);
  if (tombstoneOrder_.size() > kMaxTombstones) {
    tombstones_.erase(tombstoneOrder_.front());
    tombstoneOrder_.pop_front();
  }
}

// Note [Resolve wake-ups]
// A pipelined value is usually waited for by a fetch (serveFetch, a local toHere): a waiter that only
// completes a promise, whose own continuations go where they belong (the reply to the I/O loop, a
// then() to the executor). Posting such a waiter to the executor cost one more thread wake-up on every
// hop of a pipeline (measured: 4 wake-ups per stage hand-off, against 1 in a local pipeline), so waiters
// marked inline-safe run on the thread that resolves the value, like then(kInlineSafe, f) continuations
// (ARCHITECTURE §3), and inside whenResolved when the value is already there. A plain waiter (a method
// call queued on its receiver) is user code: resolve() posts it as before (the resolving thread is often a
// module's compute loop, which must not run another object's method in its place), except that a
// whenResolved on an executor thread finding the value ready runs it right there: that thread is serving
// the call anyway (serveCall), and posting it would only hand the same work to another thread. Inline
// runs nest at most rpc::detail::kMaxInlineDepth deep on a thread; deeper ones are posted.
void RRefContext::runWaiter(Waiter waiter, rpc::Result<detail::OwnedValue> value, bool onExecutor) {
  if ((waiter.inlineSafe || onExecutor) && rpc::detail::enterInline()) {
    waiter.callback(std::move(value));
    rpc::detail::leaveInline();
    return;
  }
  auto task = [callback = std::move(waiter.callback), value = std::move(value)]() mutable {
    callback(std::move(value));
  };
  if (!executor_->post(task)) task();
}

void RRefContext::resolve(RRefId id, rpc::Result<detail::OwnedValue> value) {
  std::vector<Waiter> waiters;
  std::unique_ptr<OwnerEntry> freed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = owned_.find(keyOf(id));
    if (it == owned_.end() || it->second->value) return;  // freed meanwhile: nobody wants the value
    it->second->value = value;
    waiters = std::move(it->second->waiters);
    it->second->waiters.clear();
    freed = maybeFreeLocked(id);
  }
  // The posted ones first, so they start while the inline ones run.
  for (auto& waiter : waiters) {
    if (!waiter.inlineSafe) runWaiter(std::move(waiter), value, /*onExecutor=*/false);
  }
  for (auto& waiter : waiters) {
    if (waiter.inlineSafe) runWaiter(std::move(waiter), value, /*onExecutor=*/false);
  }
}

void RRefContext::whenResolved(RRefId id, std::function<void(rpc::Result<detail::OwnedValue>)> callback) {
  addWaiter(id, Waiter{std::move(callback), false});
}

void RRefContext::whenResolved(RRefId id, std::function<void(rpc::Result<detail::OwnedValue>)> callback,
                               rpc::InlineSafe) {
  addWaiter(id, Waiter{std::move(callback), true});
}

void RRefContext::addWaiter(RRefId id, Waiter waiter) {
  std::optional<rpc::Result<detail::OwnedValue>> ready;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    OwnerEntry& entry = entryLocked(id);
    if (entry.value) {
      ready = *entry.value;
    } else {
      if (trace::enabled()) {
        // Traced: the wait from now until the waiter runs with the value (docs/tracing.md, rref.wait).
        waiter.callback = [callback = std::move(waiter.callback), since = trace::nowNs(),
                           owner = int64_t{id.ownerWorkerId},
                           local = static_cast<int64_t>(id.localId)](rpc::Result<detail::OwnedValue> value) {
          trace::recordAsync("rref.wait", trace::Category::kRRef, since, trace::nowNs(), {owner, local});
          callback(std::move(value));
        };
      }
      entry.waiters.push_back(std::move(waiter));
      return;
    }
  }
  runWaiter(std::move(waiter), std::move(*ready), executor_->isCurrentThread());
}

std::optional<rpc::Result<detail::OwnedValue>> RRefContext::tryValue(RRefId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = owned_.find(keyOf(id));
  if (it == owned_.end()) return std::nullopt;
  return it->second->value;
}

rpc::Result<detail::OwnedValue> RRefContext::construct(const detail::CallHeader& header,
                                                       const rpc::DecodedMessage& args, const rpc::CallContext& ctx) {
  auto cls = ctx.agent->registry().resolveClass(header.target, name_);
  if (!cls.ok()) return cls.error();
  auto ctor = cls.value()->findConstructor(header.hash, name_);
  if (!ctor.ok()) return ctor.error();
  auto object = ctor.value()->construct(args, ctx);
  if (!object.ok()) return object.error();
  return detail::OwnedValue{std::move(object).value(), {}};
}

// Note [Copying objects]: toHere of an RRef to an object is a copy made by the object's class: a class
// with a codec (visitFields, or a Codec specialisation with rpc::kHasObjectCodec) and a copy constructor is
// snapshotted by its copy constructor when the call's turn comes (after the reference's earlier calls,
// Note [Call order]) and sent with its codec; the copy is the caller's own (changing it changes nothing at
// the owner). A class without one is refused with an error saying its objects cannot be copied, on
// the caller before anything is sent (RRef<T>::toHere checks T) and here (the owner's class decides).
rpc::Result<rpc::EncodeValueFn> RRefContext::copyOf(const detail::OwnedValue& owned, const detail::CallHeader& header,
                                                    const rpc::CallContext& ctx) {
  if (!owned.object) return owned.value;  // a value: a copy of it, as fetch sends
  auto cls = ctx.agent->registry().resolveClass(owned.object.className, name_);
  if (!cls.ok()) return cls.error();
  if (owned.object.className != header.target) {
    return rpc::Error::failed(describe(header.receiver) + " holds an object of class '" + owned.object.className +
                              "', not '" + header.target + "'")
        .onWorker(name_);
  }
  if (!cls.value()->copy) {
    return rpc::Error::failed(describe(header.receiver) + " holds an object of class '" + owned.object.className +
                              "', which cannot be copied: the class has no codec (give it visitFields and a "
                              "copy constructor); call its methods instead")
        .onWorker(name_);
  }
  auto copy = cls.value()->copy(owned.object);
  if (!copy.ok()) {
    rpc::Error error = copy.error();
    error.worker = name_;
    return error;
  }
  return copy;
}

rpc::Future<rpc::EncodeValueFn> RRefContext::invokeMethod(const detail::OwnedValue& owned,
                                                          const detail::CallHeader& header,
                                                          const std::shared_ptr<rpc::DecodedMessage>& args,
                                                          const rpc::CallContext& ctx) {
  if (!owned.object) {
    rpc::Error error = rpc::Error::failed("method '" + header.target + "::" + header.method + "' called on " +
                                          describe(header.receiver) + ", which holds a value, not an object");
    error.worker = name_;
    return failedFuture(*executor_, std::move(error));
  }
  auto cls = ctx.agent->registry().resolveClass(owned.object.className, name_);
  if (!cls.ok()) return failedFuture(*executor_, cls.error());
  auto method = cls.value()->findMethod(header.method, header.hash, name_);
  if (!method.ok()) return failedFuture(*executor_, method.error());
  return method.value()->invoke(owned.object, *args, ctx, *executor_);
}

// Note [Promise pipelining]: calls on an RRef are sent to its owner at once, whether or not the value
// exists yet, and wait there: whenResolved queues them on the owner's entry (a placeholder if even the
// creating call has not arrived: calls from one worker travel in order, but their handlers may start in
// any order on the executor; the method calls of one reference still run in issue order, Note [Call
// order]) and resolve() posts them when the value arrives (Note [Resolve wake-ups]). So
// a.remote(f).remote(g).remote(h) is three one-way sends and one round trip of latency, and no executor
// thread waits for a value. The caller keeps its reference to the receiver until the owner answered the
// call, so the receiver is never freed while a call for it is queued.
rpc::Future<rpc::EncodeValueFn> RRefContext::serveCall(const rpc::DecodedMessage& message,
                                                       const rpc::CallContext& ctx) {
  auto header = rpc::detail::guard("malformed rref call header", [&] {
    rpc::DecodeContext decode(message.payloads(), rpc::kMaxValueDepth, message.scope());
    return rpc::Codec<detail::CallHeader>::decode(message.fieldView(0).value(), decode);
  });
  if (!header.ok()) {
    rpc::Error error = header.error();
    error.worker = name_;
    return failedFuture(*executor_, std::move(error));
  }
  const detail::CallHeader h = std::move(header).value();
  auto args = std::make_shared<rpc::DecodedMessage>(message.fieldView(1));
  auto self = shared_from_this();
  const auto kind = static_cast<detail::CallKind>(h.kind);
  // Method calls wait for their receiver's value, and for the calls issued before them through the same
  // reference (Note [Call order]).
  auto onReceiver = [this, &h](OrderedCall call) {
    if (h.seq == 0) return whenResolved(h.receiver, std::move(call));
    enqueueOrdered(h.receiver, h.stream, h.seq, std::move(call));
  };
  if (kind == detail::CallKind::kCopy) {
    // Note [Copying objects]: toHere of an object, ordered after the reference's earlier calls.
    auto promise = std::make_shared<rpc::Promise<rpc::EncodeValueFn>>(*executor_);
    auto future = promise->getFuture();
    onReceiver([self, promise, h, ctx](rpc::Result<detail::OwnedValue> receiver) {
      if (!receiver.ok()) return promise->setError(receiver.error());
      promise->setResult(self->copyOf(receiver.value(), h, ctx));
    });
    return future;
  }
  if (kind == detail::CallKind::kMethodValue) {
    auto promise = std::make_shared<rpc::Promise<rpc::EncodeValueFn>>(*executor_);
    auto future = promise->getFuture();
    onReceiver([self, promise, h, args, ctx](rpc::Result<detail::OwnedValue> receiver) {
      if (!receiver.ok()) return promise->setError(receiver.error());
      // whenResolved may run this later on an executor thread: the method runs inside the call's
      // distributed autograd context all the same (calls it makes join the caller's pass).
      rpc::AutogradContextScope active(ctx.autogradContext);
      (void)self->invokeMethod(receiver.value(), h, args, ctx)
          .then(rpc::kInlineSafe, [promise](rpc::Result<rpc::EncodeValueFn>&& r) { promise->setResult(std::move(r)); });
    });
    return future;
  }
  if (kind != detail::CallKind::kFunction && kind != detail::CallKind::kConstruct &&
      kind != detail::CallKind::kMethodStore) {
    return failedFuture(*executor_, rpc::Error::failed("unknown rref call kind " + std::to_string(h.kind)).onWorker(name_));
  }
  {
    // Note [Creation confirms]: the owner registers the caller's fork as the call arrives, before it
    // answers; that answer (whenever it comes, Note [Value in creation reply]) is what confirms the
    // caller's reference.
    std::lock_guard<std::mutex> lock(mutex_);
    OwnerEntry& entry = entryLocked(h.result);
    entry.created = true;
    if (h.resultFork != 0 && tombstones_.count(h.resultFork) == 0 && deadPeers_.count(ctx.caller) == 0) {
      entry.forks[h.resultFork] = ctx.caller;
    }
  }
  const RRefId result = h.result;
  // Note [Value in creation reply]
  // remote() + toHere() used to be two calls travelling back to back (the creating call, answered at
  // once, and a fetch answered with the value): two messages to decode and dispatch at the owner, two
  // replies and two wake-ups at the caller, measured 1.26-2.02x a plain round trip. Now the owner answers
  // the creating call of a value (function, method-store) once the value is resolved — right away for a
  // function that returns it, which is the common case — and the answer carries the value when it is
  // small and plain (carriable(): no tensor, no RRef, at most kMaxCarriedWords), and only when a user
  // made the RRef (the owner's own toHere is local). The caller's toHere takes the value from that answer,
  // waiting for it when issued before it came (RRefContext::valueOf): one message each way, as a plain
  // RPC. Objects are answered at once (their toHere is an ordered copy call, Note [Copying objects]).
  // Reference counting is unchanged: the fork is registered as the call arrives (Note [Creation
  // confirms]), the answer still confirms it, and a deletion of an unconfirmed fork still waits for it
  // (Note [User deletion]) — only for longer when the value takes long, which keeps nothing alive that
  // the fork did not keep anyway. A creation that outlives the caller's default timeout is treated as
  // before (a timed-out creation is taken as known: the deletion is idempotent), and its toHere falls
  // back to a fetch; a carried value contains no RRef, so a late answer settles nothing. Errors are not
  // carried (the fetch that follows reports them).
  auto reply = std::make_shared<rpc::Promise<rpc::EncodeValueFn>>(*executor_);
  auto replied = reply->getFuture();
  const bool offer = h.resultFork != 0 && ctx.caller != name_;  // a user made it: it may want the value
  auto store = [self, result, reply, offer](rpc::Result<rpc::EncodeValueFn>&& value) {
    rpc::EncodeValueFn carried;
    if (value.ok() && offer && carriable(value.value())) carried = value.value();
    if (!value.ok()) {
      self->resolve(result, value.error());
    } else {
      self->resolve(result, detail::OwnedValue{{}, std::move(value).value()});
    }
    reply->setValue(creationReply(std::move(carried)));
  };
  if (kind == detail::CallKind::kFunction) {
    auto fn = ctx.agent->registry().find(h.target);
    if (!fn) {
      store(rpc::Error::unimplemented("no function '" + h.target + "' on " + name_).onWorker(name_));
    } else if (fn->hash != h.hash) {
      store(rpc::Error::unimplemented("function '" + h.target + "' on " + name_ + " has signature " +
                                      fn->signature + ", which does not match the caller's")
                .onWorker(name_));
    } else {
      (void)fn->invoke(*args, ctx, *executor_).then(rpc::kInlineSafe, store);
    }
  } else if (kind == detail::CallKind::kConstruct) {
    resolve(result, construct(h, *args, ctx));
    reply->setValue(creationReply({}));
  } else {
    onReceiver([self, h, args, ctx, store](rpc::Result<detail::OwnedValue> receiver) mutable {
      if (!receiver.ok()) return store(receiver.error());
      rpc::AutogradContextScope active(ctx.autogradContext);  // as for kMethodValue above
      (void)self->invokeMethod(receiver.value(), h, args, ctx).then(rpc::kInlineSafe, std::move(store));
    });
  }
  std::unique_ptr<OwnerEntry> freed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    freed = maybeFreeLocked(result);
  }
  return replied;
}

// Note [Call order]: the method calls one reference issues on its RRef (rpcAsync, rpcSync, remote, and
// toHere of an object) run at the owner in the order they were issued, including calls that wait for a
// value that is not resolved yet: each call after the previous one's method returned (a method returning
// a Future has returned once it handed back the future; what it then runs may overlap the next call).
// Calls of different references (other workers, other forks, other RRefs) are not ordered with each other.
// Each reference is a stream: its id (the fork on a user, a fresh id for an owner's handle) and a call
// number taken after the call's arguments encoded (an encoding failure leaves no gap) travel in the call's
// header. The owner runs a stream's calls one at a time in number order; a call that arrives early (the
// executor started handlers of later messages first) is parked until its turn. A stream is forgotten once
// its reference is gone (the user's deletion, the owner handle's release) and its last call ran; parked or
// running calls keep their receiver's entry alive.
void RRefContext::enqueueOrdered(RRefId id, uint64_t stream, uint64_t seq, OrderedCall call) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    OwnerEntry& entry = entryLocked(id);
    CallStream& s = entry.streams[stream];
    if (seq < s.next || !s.parked.try_emplace(seq, std::move(call)).second) {
      // A number already used: a duplicate message (never sent twice by this protocol). Run it unordered
      // rather than lose it.
      std::cerr << "[distgrad rref] " << name_ << ": call " << seq << " of stream " << stream << " on "
                << describe(id) << " arrived twice\n";
      seq = 0;
    } else {
      ++entry.orderedCalls;
      if (s.running || s.parked.begin()->first != s.next) return;
      call = std::move(s.parked.begin()->second);
      s.parked.erase(s.parked.begin());
      s.running = true;
    }
  }
  if (seq == 0) return whenResolved(id, std::move(call));
  startOrdered(id, stream, std::move(call));
}

void RRefContext::startOrdered(RRefId id, uint64_t stream, OrderedCall call) {
  whenResolved(id, [self = shared_from_this(), id, stream, call = std::move(call)](
                       rpc::Result<detail::OwnedValue> value) mutable {
    call(std::move(value));
    self->finishOrdered(id, stream);
  });
}

void RRefContext::finishOrdered(RRefId id, uint64_t stream) {
  OrderedCall next;
  std::unique_ptr<OwnerEntry> freed;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = owned_.find(keyOf(id));
    if (it == owned_.end()) return;  // the agent closed meanwhile
    OwnerEntry& entry = *it->second;
    --entry.orderedCalls;
    auto s = entry.streams.find(stream);
    if (s == entry.streams.end()) return;
    s->second.running = false;
    ++s->second.next;
    auto& parked = s->second.parked;
    if (!parked.empty() && parked.begin()->first == s->second.next) {
      next = std::move(parked.begin()->second);
      parked.erase(parked.begin());
      s->second.running = true;
    } else if (parked.empty() && s->second.closed) {
      entry.streams.erase(s);
    }
    if (!next) freed = maybeFreeLocked(id);
  }
  if (next) startOrdered(id, stream, std::move(next));
}

void RRefContext::closeStreamLocked(OwnerEntry& entry, uint64_t stream) {
  auto s = entry.streams.find(stream);
  if (s == entry.streams.end()) return;
  if (!s->second.running && s->second.parked.empty()) {
    entry.streams.erase(s);
  } else {
    s->second.closed = true;
  }
}

rpc::Future<rpc::EncodeValueFn> RRefContext::serveFetch(RRefId id) {
  auto promise = std::make_shared<rpc::Promise<rpc::EncodeValueFn>>(*executor_);
  auto future = promise->getFuture();
  const std::string name = name_;
  // Only completes the reply's promise: inline-safe (Note [Resolve wake-ups]).
  whenResolved(
      id,
      [promise, id, name](rpc::Result<detail::OwnedValue> owned) {
        if (!owned.ok()) return promise->setError(owned.error());
        if (owned.value().object) {
          return promise->setError(rpc::Error::failed(describe(id) + " holds an object of class '" +
                                                      owned.value().object.className +
                                                      "': objects stay at their owner (call their methods)")
                                       .onWorker(name));
        }
        promise->setValue(owned.value().value);
      },
      rpc::kInlineSafe);
  return future;
}

void RRefContext::serveForkRequest(RRefId id, ForkId fork, const std::string& user) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (tombstones_.count(fork) != 0 || deadPeers_.count(user) != 0) return;
  entryLocked(id).forks[fork] = user;
}

void RRefContext::serveDelete(RRefId id, ForkId fork) {
  std::unique_ptr<OwnerEntry> freed;
  std::lock_guard<std::mutex> lock(mutex_);
  tombstoneLocked(fork);
  auto it = owned_.find(keyOf(id));
  if (it == owned_.end()) return;
  it->second->forks.erase(fork);
  closeStreamLocked(*it->second, fork);  // the fork's calls all arrived before its deletion
  freed = maybeFreeLocked(id);
  // `freed` must die outside the lock: it is declared before the guard.
}

void RRefContext::serveChildAccept(ForkId fork) {
  PendingChild child;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = children_.find(fork);
    if (it == children_.end()) return;
    child = std::move(it->second);
    children_.erase(it);
  }
  // child.parent is released here, outside the lock (it may be this process's last handle).
}

// Note [Worker death]: when `peer` dies, the owner drops every fork `peer` held (after the agent's
// heartbeat bound, or at once when its connection closed), the pending children sent to `peer` are let go,
// and forks owned by `peer` need no deletion any more. Waiters on RRefs `peer` owns fail through their
// calls, which the agent fails when the peer dies; the rref layer reports them as OwnerLost.
void RRefContext::onPeerDown(const std::string& peer, const rpc::Error&) {
  std::vector<std::unique_ptr<OwnerEntry>> freed;
  std::vector<PendingChild> children;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    deadPeers_.insert(peer);
    std::vector<RRefId> touched;
    for (auto& [key, entry] : owned_) {
      for (auto it = entry->forks.begin(); it != entry->forks.end();) {
        if (it->second == peer) {
          tombstoneLocked(it->first);
          it = entry->forks.erase(it);
        } else {
          ++it;
        }
      }
      touched.push_back(RRefId{key.first, key.second});
    }
    for (RRefId id : touched) {
      if (auto f = maybeFreeLocked(id)) freed.push_back(std::move(f));
    }
    for (auto it = children_.begin(); it != children_.end();) {
      if (it->second.receiver == peer) {
        children.push_back(std::move(it->second));
        it = children_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = users_table_.begin(); it != users_table_.end();) {
      // A fork whose request still waits in the outbox stays: the flusher's attempt (refused: the owner is
      // dead) confirms it and sends the parent its child accept (Note [Deferred fork requests]).
      if (it->second.owner == peer && it->second.released && !it->second.requestQueued) {
        it = users_table_.erase(it);
      } else {
        ++it;
      }
    }
  }
}

// Note [Shutdown releases users]: a graceful shutdown releases every user reference this process still
// holds, as if its handles were dropped (a confirmed fork's deletion goes now, an unconfirmed one's at its
// confirmation, Note [User deletion]), then waits, bounded by the shutdown deadline, until the owners
// answered and no control call or pending child is left, so no owner keeps forks of a worker that left
// (PyTorch releases user references at shutdown too). Handles still held afterwards are inert: release()
// finds no entry, and calls through them fail because the agent is shut down.
void RRefContext::onShutdown(std::chrono::steady_clock::time_point deadline) {
  std::vector<std::pair<ForkId, UserEntry>> toDelete;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = users_table_.begin(); it != users_table_.end();) {
      UserEntry& entry = it->second;
      if (entry.released) {
        ++it;  // already waiting for its confirmation
      } else if (entry.confirmed || deadPeers_.count(entry.owner) != 0) {
        if (deadPeers_.count(entry.owner) == 0) toDelete.emplace_back(it->first, entry);
        it = users_table_.erase(it);
      } else {
        entry.released = true;
        ++it;
      }
    }
  }
  for (const auto& [fork, entry] : toDelete) sendDelete(entry.owner, entry.id, fork);
  // Settlements queued from now on go out without waiting (Note [Batched settlements]); and those queued so
  // far.
  {
    std::lock_guard<std::mutex> lock(outboxMutex_);
    flushNow_ = true;
  }
  outboxChanged_.notify_all();
  flushOutbox();
  while (userCount() != 0 || pendingControlCount() != 0 || pendingChildCount() != 0) {
    if (std::chrono::steady_clock::now() >= deadline) {
      std::cerr << "[distgrad rref] " << name_ << ": shutdown deadline reached with " << userCount()
                << " user references, " << pendingControlCount() << " control calls and " << pendingChildCount()
                << " pending children left\n";
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Note [Agent lifetime]: handles may outlive their agent (a user keeps an RRef after shutdown). When the
// agent closes, sends stop (beginUse answers nullptr, after in-flight sends finished), queued calls fail,
// and the tables are dropped.
void RRefContext::onAgentClosed() {
  {
    std::unique_lock<std::mutex> lock(useMutex_);
    agent_ = nullptr;
    useChanged_.wait(lock, [&] { return activeUses_ == 0; });
  }
  stopFlusher();
  std::map<std::pair<uint32_t, uint64_t>, std::unique_ptr<OwnerEntry>> owned;
  std::unordered_map<ForkId, PendingChild> children;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    owned.swap(owned_);
    children.swap(children_);
    users_table_.clear();
  }
  const rpc::Error closed = rpc::Error::failed("agent " + name_ + " shut down").onWorker(name_);
  for (auto& [key, entry] : owned) {
    for (auto& waiter : entry->waiters) waiter.callback(closed);
  }
}

}  // namespace distgrad::rref
