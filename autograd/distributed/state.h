// The per-agent side of distributed autograd (docs/dist_autograd.md): the context table, the Send/Recv
// nodes the forward records through rpc::AutogradHook, and the backward passes (discovery, gradient
// propagation, completion, abort, release). Users reach it through dist_autograd.h.
// Thread-safety: every method may be called from any thread. `mutex_` guards the context table; each
// Context has its own mutex for its nodes and pass; gradients have a third. Locks are taken in that order,
// never held across an RPC send or a node's backward.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "autograd/graph_task.h"
#include "autograd/node.h"
#include "rpc/agent.h"
#include "rpc/timer.h"
#include "rpc/trace.h"

namespace distgrad::autograd::distributed {

// The sender's end of one message of a context: its gradients arrive from the receiver and flow on into
// the graph that produced the sent tensors (one output and one next edge per sent grad tensor).
class SendBackward final : public Node {
 public:
  SendBackward(uint64_t messageId, std::string peer);
  std::vector<Tensor> apply(std::vector<Tensor>&& gradOutputs) override { return std::move(gradOutputs); }
  const uint64_t messageId;
  const std::string peer;  // the receiver
};

// The receiver's end: the received grad tensors are its outputs; running it sends their gradients back to
// the sender's SendBackward (the distributed engine does that; a local backward reaching it is an error).
class RecvBackward final : public Node {
 public:
  RecvBackward(uint64_t contextId, uint64_t messageId, std::string peer);
  std::vector<Tensor> apply(std::vector<Tensor>&& gradOutputs) override;
  const uint64_t contextId;
  const uint64_t messageId;
  const std::string peer;  // the sender
  // The sender's closure (rpc::AutogradSend): messages upstream of this one; set before the node is shared.
  bool closureKnown = false;
  std::vector<uint64_t> closure;
  // CUDA over RPC: the inverse of the device map the forward message came with (empty: it had none), so
  // the gradients land on the devices the sent tensors were on (rpc/device_map.h).
  rpc::DeviceMap gradientDeviceMap;
};

// Wire forms of the "dg.autograd.*" messages.
struct PropagateRequest {  // gradients for the sender's SendBackward `messageId`
  uint64_t contextId = 0;
  uint64_t passId = 0;
  uint64_t messageId = 0;
  uint8_t mode = 0;  // BackwardMode
  bool retainGraph = false;
  std::vector<Tensor> grads;  // one per output of the SendBackward (undefined: none)
  template <class V>
  void visitFields(V& v) {
    v("contextId", contextId);
    v("passId", passId);
    v("messageId", messageId);
    v("mode", mode);
    v("retainGraph", retainGraph);
    v("grads", grads);
  }
};

// EXACT mode: these sends of the receiver will receive a gradient in this pass. kDiscover: walk on from
// them (Note [Exact discovery]); kPlan: they are all of the receiver's (Note [Exact plans]).
struct DiscoverRequest {
  uint64_t contextId = 0;
  uint64_t passId = 0;
  bool retainGraph = false;
  std::vector<uint64_t> messageIds;
  template <class V>
  void visitFields(V& v) {
    v("contextId", contextId);
    v("passId", passId);
    v("retainGraph", retainGraph);
    v("messageIds", messageIds);
  }
};

enum class ControlKind : uint8_t { kRelease = 0, kAbort = 1 };

struct ControlRequest {  // release a context / abort a pass, forwarded along the context's workers
  uint8_t kind = 0;      // ControlKind
  uint64_t contextId = 0;
  uint64_t passId = 0;  // kAbort
  // Why (kAbort always; kRelease when a worker died, empty message for a normal release).
  uint8_t errorKind = 0;  // rpc::ErrorKind of the reason
  std::string message;
  std::string worker;
  // The workers this message reaches without the receiver's help (Note [Control forwarding] in state.cpp).
  std::vector<std::string> covered;
  template <class V>
  void visitFields(V& v) {
    v("kind", kind);
    v("contextId", contextId);
    v("passId", passId);
    v("errorKind", errorKind);
    v("message", message);
    v("worker", worker);
    v("covered", covered);
  }
};
// Longest `covered` list a worker accepts (ranks are 16-bit).
inline constexpr size_t kMaxCovered = size_t{1} << 16;

inline const rpc::Function<void(PropagateRequest)> kPropagate{"dg.autograd.propagate"};
inline const rpc::Function<void(DiscoverRequest)> kDiscover{"dg.autograd.discover"};
inline const rpc::Function<void(DiscoverRequest)> kPlan{"dg.autograd.plan"};
inline const rpc::Function<void(ControlRequest)> kControl{"dg.autograd.control"};

class DistAutogradState final : public rpc::AgentExtension,
                                public rpc::AutogradHook,
                                public std::enable_shared_from_this<DistAutogradState> {
 public:
  // The state of `agent`; ValueError when its registry did not install distributed autograd.
  static std::shared_ptr<DistAutogradState> of(rpc::Agent& agent);
  explicit DistAutogradState(rpc::Agent& agent);
  ~DistAutogradState() override;

  const std::string& name() const { return name_; }
  // TEST-ONLY: closures longer than `limit` ids are sent as unknown (0: every non-empty one), so backward
  // passes through this worker's messages use discovery (Note [Exact discovery]).
  void setClosureLimitForTesting(size_t limit) { closureLimit_ = limit; }
  rpc::Executor& executor() const { return *executor_; }
  uint64_t createContext();
  // Drops the context here and (forward) tells every worker it exchanged messages with, except `from` and
  // those `covered` lists (Note [Control forwarding] in state.cpp). `freeOnExecutor`: the graphs and
  // gradients are freed by a task on the executor, not here (Note [Control in order] in state.cpp).
  void releaseContext(uint64_t contextId, const std::string& from, std::optional<rpc::Error> reason, bool forward,
                      bool freeOnExecutor = false, std::vector<std::string> covered = {});
  Gradients gradients(uint64_t contextId);
  // Note [Gradient folding] in the .cpp.
  void foldGradients(uint64_t from, uint64_t into);
  // Note [Local part done] in the .cpp (joins a context created elsewhere, as foldGradients does).
  rpc::Future<void> whenLocalPartDone(uint64_t contextId, const rpc::CancellationToken& cancel);
  size_t liveContexts() const;

  // The root's side of DistContext::backward. With `drainHere`, the discovery is awaited and the local
  // part of the backward runs on the calling thread; otherwise on the executor. With `join`, a context
  // created elsewhere that this worker has not joined yet (its calls in it carried no grad tensor) is joined
  // here, as a received grad tensor would (backwardAsync(agent, contextId, ...)).
  rpc::Future<void> backward(uint64_t contextId, const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
                             const BackwardOptions& options, bool drainHere, bool join = false);

  // Handlers of the "dg.autograd.*" functions.
  rpc::Future<void> onPropagate(PropagateRequest request, const rpc::CallContext& call);
  rpc::Future<void> onDiscover(DiscoverRequest request, const rpc::CallContext& call);
  void onPlan(const DiscoverRequest& request, const rpc::CallContext& call);
  void onControl(const ControlRequest& request, const std::string& from);

  // rpc::AutogradHook
  rpc::AutogradSend onSend(uint64_t contextId, const std::string& peer,
                           const std::vector<Tensor>& gradTensors) override;
  std::shared_ptr<Node> onReceive(const rpc::AutogradIds& ids, const std::string& peer,
                                  std::vector<TensorMeta> gradMetas) override;
  // rpc::AgentExtension
  void onPeerDown(const std::string& peer, const rpc::Error& error) override;
  void onAgentClosed() override;

 private:
  struct Pass;
  struct Context;
  using Clock = std::chrono::steady_clock;

  std::shared_ptr<Context> find(uint64_t contextId, bool join);
  // ValueError (unknown / released) or the RpcError the context was released with. Caller holds mutex_
  // (throwReleased takes it).
  [[noreturn]] void throwUnknown(uint64_t contextId) const;
  [[noreturn]] void throwReleased(uint64_t contextId) const;
  // A pass of `ctx` that may be (re)placed by pass `passId`: error text when another one is running.
  std::shared_ptr<Pass> passFor(Context& ctx, uint64_t passId, BackwardMode mode, bool retainGraph,
                                Clock::time_point deadline);
  // EXACT: walks the graph from `starts`, activates the sends behind every RecvBackward it reaches (own
  // sends at once, peers' through kDiscover) and completes when every worker reached has done the same.
  rpc::Future<void> discover(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass,
                             std::vector<Node*> starts, std::unique_lock<std::mutex>& lock);
  // Note [Exact plans]: the messages whose sends receive a gradient when the backward starts at `roots`,
  // from the closures the forward recorded; nullopt when a closure is unknown (discovery is used then).
  std::optional<std::vector<uint64_t>> planFrom(const std::vector<Edge>& roots) const;
  // Sends each other worker its part of a plan; the calls count as the pass's outstanding work.
  void sendPlans(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass,
                 std::map<uint64_t, std::vector<uint64_t>> byRank);
  // Counts `answered` (a call of the pass, already counted in outstanding) down when it completes; an
  // error fails the pass.
  void track(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass, rpc::Future<void> answered);
  // Builds the pass's GraphTask over its starts (roots + sends expected to receive a gradient).
  void createTask(Context& ctx, Pass& pass);
  void startGradients(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass);
  // Delivers `grads` into SendBackward `send` of the pass (validated); a clear error when unexpected.
  std::optional<rpc::Error> deliverToSend(Context& ctx, Pass& pass, uint64_t messageId, std::vector<Tensor> grads);
  // Runs ready nodes until none is left (one runner per pass; other threads only deliver).
  void drain(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass,
             std::unique_lock<std::mutex>& lock);
  void sendGradients(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass, RecvBackward& recv,
                     std::vector<Tensor> grads, std::unique_lock<std::mutex>& lock);
  void finishIfDone(Context& ctx, Pass& pass);
  void cancelTimer(Pass& pass);
  // Fails the pass (its waiters get `error`); the root also tells every worker of the context to abort.
  void failPass(Context& ctx, Pass& pass, rpc::Error error);
  // whenLocalPartDone's cancellation: fails waiter `waiter` with `reason`; a context nothing else used here
  // (joined by the wait alone) is released here.
  void cancelLocalWait(const std::shared_ptr<Context>& ctx, uint64_t waiter, const rpc::Error& reason);
  // Sends `request` on to `peers` but `from` and those its `covered` lists (Note [Control forwarding]).
  void broadcast(const std::set<std::string>& peers, const std::string& from, ControlRequest request);
  // Sends `fn(request)` to `peer` outside any context; a failed future when the agent is gone.
  template <typename Req>
  rpc::Future<void> call(const std::string& peer, const rpc::Function<void(Req)>& fn, const Req& request,
                         std::chrono::milliseconds timeout, const rpc::DeviceMap* deviceMap = nullptr);
  rpc::Error localError(rpc::ErrorKind kind, const std::string& message) const;
  // Timeout for a call the pass makes: the time left to its deadline plus a grace (-1: no deadline).
  std::chrono::milliseconds remaining(const Pass& pass) const;

  const std::string name_;
  const uint64_t rank_;
  rpc::Executor* executor_;
  const std::chrono::milliseconds defaultTimeout_;
  // The agent's trace worker: a backward run on a user thread records for this agent (docs/tracing.md).
  const trace::WorkerSlot traceWorker_;

  std::mutex agentMutex_;
  rpc::Agent* agent_;  // GUARDED_BY(agentMutex_): null once the agent closed

  mutable std::mutex mutex_;
  std::unordered_map<uint64_t, std::shared_ptr<Context>> contexts_;  // GUARDED_BY(mutex_)
  // Released contexts (and why), so a late message cannot bring one back; bounded, oldest first out.
  std::unordered_map<uint64_t, std::optional<rpc::Error>> released_;  // GUARDED_BY(mutex_)
  std::deque<uint64_t> releasedOrder_;                                // GUARDED_BY(mutex_)
  std::mutex timerMutex_;                                             // innermost: taken under a Context's mutex
  std::unique_ptr<rpc::TimerQueue> timers_;  // GUARDED_BY(timerMutex_), made on the first deadline

  // Longest closure this worker sends (Note [Exact plans]); lowered by tests to force discovery.
  std::atomic<size_t> closureLimit_{rpc::kMaxAutogradClosure};
  std::atomic<uint64_t> nextContext_{1};
  std::atomic<uint64_t> nextMessage_{1};
  std::atomic<uint64_t> nextPass_{1};
  std::atomic<uint64_t> nextWaiter_{1};  // whenLocalPartDone's waiters
};

}  // namespace distgrad::autograd::distributed
