#include "autograd/distributed/state.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <map>
#include <utility>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "rpc/trace.h"

namespace distgrad::autograd::distributed {

namespace {

constexpr const char* kExtensionKey = "dg.dist_autograd";
constexpr uint64_t kCounterBits = 48;
constexpr uint64_t kCounterMask = (uint64_t{1} << kCounterBits) - 1;
// Released context ids remembered so late messages cannot revive them.
constexpr size_t kReleasedMemory = 1 << 16;
// Nodes one send may walk to compute its closure (Note [Exact plans]); beyond, the closure is unknown.
constexpr size_t kMaxClosureWalk = 1 << 16;

uint64_t rankOf(uint64_t id) { return id >> kCounterBits; }

// Bytes of defined gradients, for the trace.
int64_t gradientBytes(const std::vector<Tensor>& grads) {
  int64_t bytes = 0;
  for (const auto& g : grads) {
    if (g.defined()) bytes += static_cast<int64_t>(g.nbytes());
  }
  return bytes;
}

// The closure of a message carrying tensors whose gradients flow into `edges` (Note [Exact plans]), or
// false when it is unknown.
bool closureOf(const std::vector<Edge>& edges, size_t limit, std::vector<uint64_t>& out) {
  std::unordered_set<const Node*> seen;
  std::unordered_set<uint64_t> ids;
  std::vector<const Node*> stack;
  for (const auto& e : edges) {
    if (e.valid()) stack.push_back(e.fn.get());
  }
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (seen.size() > kMaxClosureWalk) return false;
    if (const auto* recv = dynamic_cast<const RecvBackward*>(node)) {
      if (!recv->closureKnown) return false;
      ids.insert(recv->messageId);
      ids.insert(recv->closure.begin(), recv->closure.end());
      if (ids.size() > limit) return false;
      continue;
    }
    for (const auto& e : node->nextEdges()) {
      if (e.valid()) stack.push_back(e.fn.get());
    }
  }
  out.assign(ids.begin(), ids.end());
  std::sort(out.begin(), out.end());
  return true;
}

uint64_t makeId(uint64_t rank, std::atomic<uint64_t>& counter) {
  const uint64_t n = counter.fetch_add(1, std::memory_order_relaxed);
  DG_CHECK(n <= kCounterMask, "distributed autograd: id counter exhausted (2^48 ids)");
  return (rank << kCounterBits) | n;
}

std::string hex(uint64_t id) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%llx", static_cast<unsigned long long>(id));
  return buffer;
}

}  // namespace

// Note [Distributed backward] (docs/dist_autograd.md has the full protocol)
// The forward leaves, per context and worker, SendBackward nodes (keyed by autograd message id) and
// RecvBackward nodes. A backward pass (id chosen by the root) runs one GraphTask per worker whose starts
// are the roots (on the root) and the sends expected to receive a gradient: every send of the context in
// FAST mode, the sends discovered in EXACT mode. Running a RecvBackward sends its gradients to the
// sender's SendBackward (kPropagate). Completion: the root's pass completes when its task is done and all
// its kPropagate calls have completed; a worker answers the FIRST kPropagate of a pass only when its own
// pass is complete in that sense, later ones at once (their work is covered by the first), so the root's
// completion implies every worker's (Dijkstra-Scholten: the first messages form a tree rooted at the root).
// Cycles (A->B->A) cannot deadlock: the root's task exists before any gradient arrives back, so such
// arrivals are "later" ones.
// Errors travel back the same way (a failed node fails its worker's pass, which fails the caller's
// kPropagate); the root then tells every worker to abort (kControl/kAbort, forwarded once per worker).
//
// Note [Local part done]
// The root's caller may ask to hear when the root's OWN part of the pass has run (BackwardOptions::
// localDone), long before the pass completes: the completion waits for every other worker, the local part
// only for this worker's nodes. It is the moment the root's task is done (every node of the pass here has
// run, the gradients of every RecvBackward here handed to the agent) at the end of a drain that did not
// fail the pass. A task that is done stays done, so it fires at most once; the callback is taken out of the
// pass under the context's mutex and called after the drain has let go of it (running = false, lock
// released), so it may start another pass, of this context or another, on this thread. A pipeline's last
// stage uses it to start micro-batch m + 1's backward as soon as m's gradients have left the stage
// (models/pipeline/rpc_pipeline.cpp, Note [Loss on the last stage]).
// Every worker, root or not, also marks the context when a pass's part here has run that way (the end of a
// drain that left the task done; a non-root worker's pass completes later, once its own kPropagate calls
// are answered): whenLocalPartDone's futures complete then, or at once when it already happened. Then this
// worker's gradients of the context are final, so a pipeline stage steps its optimizer part as soon as its
// last micro-batch's backward has left it (LocalOptimizer::stepContextsAfterBackward), as the local
// pipeline does, instead of after the whole pass and a round trip through the driver. The futures fail
// when the context is released here, or a pass of it fails, before a part ran here.
//
// Note [Exact plans]
// The forward records, for every message with grad tensors, its closure: the ids of every message whose
// received tensors the sent ones were computed from, transitively (the sender walks its graph back from the
// sent tensors to the RecvBackward nodes there and adds their closures; RecvBackward keeps the closure that
// came with its message). At backward time the root walks from the roots to the RecvBackward nodes they
// reach; those messages and their closures are exactly the messages whose sends will receive a gradient
// (a send receives one iff its RecvBackward is reached, and everything upstream of a reached RecvBackward's
// send is in its closure). The root keeps its own part and sends each other worker its part (kPlan), all
// at once and without waiting: a worker buffers gradients that arrive before its plan. No round trip is
// added to the backward. A closure over kMaxAutogradClosure ids, or a walk over kMaxClosureWalk nodes, is
// "unknown"; a pass that reaches an unknown closure falls back to discovery.
//
// Note [Exact discovery]
// The fallback. Before gradients flow, the root walks its graph from the roots; each RecvBackward it
// reaches means the matching send on the peer will receive a gradient. kDiscover tells that peer, which walks on from
// those sends, and so on; each kDiscover completes when the sub-walks it caused have completed, and a worker walks each
// node at most once per pass, so discovery terminates (the forward is a DAG over time). After it, each worker knows
// exactly which of its sends get a gradient, and its GraphTask waits for those only.

SendBackward::SendBackward(uint64_t messageId, std::string peer)
    : Node("SendBackward"), messageId(messageId), peer(std::move(peer)) {}

RecvBackward::RecvBackward(uint64_t contextId, uint64_t messageId, std::string peer)
    : Node("RecvBackward"), contextId(contextId), messageId(messageId), peer(std::move(peer)) {}

std::vector<Tensor> RecvBackward::apply(std::vector<Tensor>&&) {
  throw ValueError("a local backward reached a tensor received from " + peer + " inside distributed autograd context " +
                   std::to_string(contextId) + ": run the backward with DistContext::backward of that context");
}

struct DistAutogradState::Pass {
  uint64_t id = 0;
  BackwardMode mode = BackwardMode::kExact;
  bool retainGraph = false;
  bool isRoot = false;
  Clock::time_point deadline = Clock::time_point::max();
  // EXACT: sends that receive a gradient, and nodes already walked by discovery.
  std::unordered_set<uint64_t> activeSends;
  std::unordered_set<Node*> walked;
  // EXACT: activeSends is complete (a plan came, or discovery made the pass); gradients that arrive before
  // are buffered (Note [Exact plans]).
  bool planned = false;
  std::vector<std::pair<uint64_t, std::vector<Tensor>>> buffered;
  bool gotGradients = false;  // the first kPropagate of the pass arrived (Note [Distributed backward])
  // Root only.
  std::vector<Edge> roots;
  std::vector<Tensor> rootGrads;
  rpc::TimerId timer = rpc::kInvalidTimerId;
  std::optional<rpc::CancellationRegistration> cancelRegistration;

  std::unique_ptr<GraphTask> task;
  bool running = false;    // a thread is draining the task
  size_t outstanding = 0;  // kPropagate calls not yet answered
  bool finished = false;
  std::optional<rpc::Error> error;
  std::vector<rpc::Promise<void>> waiters;
  std::function<void()> localDone;  // root only: Note [Local part done]

  bool busy() const { return task != nullptr && !finished; }
};

struct DistAutogradState::Context {
  explicit Context(uint64_t id) : id(id) {}
  const uint64_t id;
  std::mutex mutex;
  std::unordered_map<uint64_t, std::shared_ptr<SendBackward>> sends;  // GUARDED_BY(mutex)
  std::unordered_map<uint64_t, std::shared_ptr<RecvBackward>> recvs;  // GUARDED_BY(mutex)
  std::set<std::string> peers;  // GUARDED_BY(mutex): workers it exchanged messages with
  std::shared_ptr<Pass> pass;   // GUARDED_BY(mutex): the latest pass on this worker
  // Note [Local part done]: a pass's part here has run (whenLocalPartDone), and who waits for one.
  bool localPartRan = false;                                          // GUARDED_BY(mutex)
  std::vector<std::pair<uint64_t, rpc::Promise<void>>> localWaiters;  // GUARDED_BY(mutex): (waiter id, promise)
  uint64_t abortedPass = 0;     // GUARDED_BY(mutex): last pass an abort was forwarded for
  bool released = false;        // GUARDED_BY(mutex)

  std::mutex gradMutex;
  std::unordered_map<const tensor::TensorImpl*, std::pair<Tensor, Tensor>> grads;  // GUARDED_BY(gradMutex)
  // Note [Gradient folding]: the context this one's gradients go to instead (foldGradients), or null.
  std::shared_ptr<Context> sink;  // GUARDED_BY(gradMutex)
  // Set by releaseContext: a context folding into this one keeps its gradients itself from then on.
  std::atomic<bool> dropped{false};

  void accumulate(const Tensor& leaf, Tensor grad) {
    std::shared_ptr<Context> target;
    {
      std::lock_guard<std::mutex> lock(gradMutex);
      if (sink && sink->dropped.load()) sink.reset();
      target = sink;
      if (!target) return accumulateLocked(leaf, std::move(grad));
    }
    // Outside this context's lock: the sink takes its own (a chain of sinks ends: foldGradients refuses
    // any fold that would close a cycle).
    target->accumulate(leaf, std::move(grad));
  }

  void accumulateLocked(const Tensor& leaf, Tensor grad) {
    // A gradient lives on its leaf's device (CUDA leaves included: the sum below runs there).
    DG_CHECK(grad.device() == leaf.device(), "distributed autograd: a gradient on ", grad.device().str(),
             " for a leaf on ", leaf.device().str());
    auto [it, fresh] = grads.try_emplace(leaf.implPtr().get(), leaf, Tensor());
    if (fresh) {
      // Keep the incoming buffer when nobody else can see it; otherwise a private copy, so an optimizer
      // that updates gradients in place never writes into another tensor (as AccumulateGrad does).
      const bool exclusive = grad.implPtr().use_count() == 1 && grad.storage().useCount() == 1 && grad.isContiguous();
      it->second.second = exclusive ? std::move(grad) : grad.cloneData();
    } else if (!addInPlace(it->second.second, grad)) {
      NoGradGuard noGrad;
      it->second.second = add(it->second.second, grad).detach();
    }
  }

  // Adds `grad` into `sum` in place when `sum` is this context's private buffer (no Gradients snapshot, no
  // view holds it: they would see it change) and both are contiguous CPU floats of one shape. Saves a
  // buffer per addition: with folded contexts (Note [Gradient folding]) every micro-batch adds here, and
  // an out-of-place sum would briefly hold two copies of the layer.
  static bool addInPlace(Tensor& sum, const Tensor& grad) {
    if (sum.implPtr().use_count() != 1 || sum.storage().useCount() != 1) return false;
    if (!sum.isContiguous() || !grad.isContiguous() || sum.shape() != grad.shape() || sum.dtype() != grad.dtype() ||
        !sum.device().isCpu() || !grad.device().isCpu()) {
      return false;
    }
    // Distinct buffers (sum's storage is its own, checked above): said so, the loop vectorises. Without it
    // GCC left it scalar, 1.6% of rpc_pipeline's CPU (a ResNet-18 stage accumulates every micro-batch here).
    auto run = [n = sum.numel()](auto* __restrict out, const auto* __restrict in) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) out[i] += in[i];
    };
    if (sum.dtype() == DType::kFloat32) {
      run(sum.data<float>(), grad.data<float>());
    } else if (sum.dtype() == DType::kFloat64) {
      run(sum.data<double>(), grad.data<double>());
    } else {
      return false;
    }
    return true;
  }
};

// ---- lifetime and the context table ----

std::shared_ptr<DistAutogradState> DistAutogradState::of(rpc::Agent& agent) {
  auto extension = agent.extension(kExtensionKey, [](rpc::Agent& a) -> std::shared_ptr<rpc::AgentExtension> {
    throw ValueError("distributed autograd is not installed on worker " + a.name() +
                     ": call autograd::distributed::install(registry) before Agent::start");
  });
  return std::static_pointer_cast<DistAutogradState>(extension);
}

DistAutogradState::DistAutogradState(rpc::Agent& agent)
    : name_(agent.name()),
      rank_(static_cast<uint64_t>(agent.rank())),
      executor_(&agent.executor()),
      defaultTimeout_(agent.options().defaultTimeout),
      traceWorker_(agent.traceWorker()),
      agent_(&agent) {
  DG_CHECK(agent.rank() >= 0 && agent.rank() < (1 << 16), "distributed autograd supports ranks below 65536, got ",
           agent.rank());
}

DistAutogradState::~DistAutogradState() {
  std::lock_guard<std::mutex> lock(timerMutex_);
  if (timers_) timers_->shutdown();
}

uint64_t DistAutogradState::createContext() {
  {
    std::lock_guard<std::mutex> lock(agentMutex_);
    DG_CHECK(agent_ != nullptr, "DistContext: worker ", name_, " is shut down");
  }
  const uint64_t id = makeId(rank_, nextContext_);
  std::lock_guard<std::mutex> lock(mutex_);
  contexts_.emplace(id, std::make_shared<Context>(id));
  return id;
}

void DistAutogradState::throwReleased(uint64_t contextId) const {
  std::lock_guard<std::mutex> lock(mutex_);
  throwUnknown(contextId);
}

void DistAutogradState::throwUnknown(uint64_t contextId) const {
  auto it = released_.find(contextId);
  if (it != released_.end()) {
    if (it->second) throw rpc::RpcError(*it->second);
    throw ValueError("distributed autograd context " + std::to_string(contextId) + " was released on worker " + name_);
  }
  throw ValueError("worker " + name_ + " does not know distributed autograd context " + std::to_string(contextId));
}

std::shared_ptr<DistAutogradState::Context> DistAutogradState::find(uint64_t contextId, bool join) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = contexts_.find(contextId);
  if (it != contexts_.end()) return it->second;
  // A context created elsewhere is joined on first contact; one created here is never re-created.
  if (!join || (contextId >> kCounterBits) == rank_ || released_.count(contextId)) throwUnknown(contextId);
  return contexts_.emplace(contextId, std::make_shared<Context>(contextId)).first->second;
}

void DistAutogradState::releaseContext(uint64_t contextId, const std::string& from, std::optional<rpc::Error> reason,
                                       bool forward, bool freeOnExecutor, std::vector<std::string> covered) {
  std::shared_ptr<Context> ctx;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = contexts_.find(contextId);
    if (it != contexts_.end()) {
      ctx = std::move(it->second);
      contexts_.erase(it);
    }
    if (released_.emplace(contextId, reason).second) {
      releasedOrder_.push_back(contextId);
      if (releasedOrder_.size() > kReleasedMemory) {
        released_.erase(releasedOrder_.front());
        releasedOrder_.pop_front();
      }
    }
  }
  if (!ctx) return;
  std::set<std::string> peers;
  std::unordered_map<uint64_t, std::shared_ptr<SendBackward>> sends;
  std::unordered_map<uint64_t, std::shared_ptr<RecvBackward>> recvs;
  std::shared_ptr<Pass> pass;
  ctx->dropped.store(true);  // Note [Gradient folding]
  {
    std::lock_guard<std::mutex> lock(ctx->mutex);
    ctx->released = true;
    peers = ctx->peers;
    sends.swap(ctx->sends);  // the graphs are freed outside the lock
    recvs.swap(ctx->recvs);
    pass = ctx->pass;
    if (pass && !pass->finished) {
      failPass(
          *ctx, *pass,
          reason ? *reason
                 : localError(rpc::ErrorKind::kCancelled, "distributed autograd context " + std::to_string(contextId) +
                                                              " was released during its backward pass"));
    }
    for (auto& waiter : ctx->localWaiters) {  // Note [Local part done]
      waiter.second.setError(reason ? *reason
                                    : localError(rpc::ErrorKind::kCancelled,
                                                 "distributed autograd context " + std::to_string(contextId) +
                                                     " was released before a backward pass of it ran on " + name_));
    }
    ctx->localWaiters.clear();
  }
  if (forward) {
    ControlRequest request;
    request.kind = static_cast<uint8_t>(ControlKind::kRelease);
    request.contextId = contextId;
    if (reason) {  // a worker's death travels on, so every worker's pass fails with it
      request.errorKind = static_cast<uint8_t>(reason->kind);
      request.message = reason->message;
      request.worker = reason->worker;
    }
    request.covered = std::move(covered);
    broadcast(peers, from, std::move(request));
  }
  if (freeOnExecutor) {  // a refused task frees them here, as it is destroyed
    (void)executor_->post(
        [ctx = std::move(ctx), sends = std::move(sends), recvs = std::move(recvs), pass = std::move(pass)] {});
  }
}

rpc::Future<void> DistAutogradState::whenLocalPartDone(uint64_t contextId, const rpc::CancellationToken& cancel) {
  std::shared_ptr<Context> ctx = find(contextId, /*join=*/true);
  const uint64_t waiter = nextWaiter_.fetch_add(1);
  rpc::Future<void> future;
  {
    std::lock_guard<std::mutex> lock(ctx->mutex);
    if (ctx->released) {
      // future stays invalid: thrown below, outside the lock
    } else if (ctx->localPartRan) {
      return rpc::makeReadyFuture(*executor_);
    } else {
      rpc::Promise<void> promise(*executor_);
      future = promise.getFuture();
      ctx->localWaiters.emplace_back(waiter, std::move(promise));
    }
  }
  if (!future.valid()) throwReleased(contextId);  // released between the lookup and the lock
  // A wait that is cancelled (its call's deadline) gives up, and a context only it joined goes with it.
  auto registration = std::make_shared<rpc::CancellationRegistration>(
      cancel.onCancel([weak = weak_from_this(), ctx, waiter](const rpc::Error& reason) {
        if (auto self = weak.lock()) self->cancelLocalWait(ctx, waiter, reason);
      }));
  // Posted, not inline: a completion under the context's mutex must not wait here for a cancellation
  // callback that waits for that mutex.
  return std::move(future).then([registration] {});
}

void DistAutogradState::cancelLocalWait(const std::shared_ptr<Context>& ctx, uint64_t waiter,
                                        const rpc::Error& reason) {
  std::optional<rpc::Promise<void>> promise;
  bool unused = false;
  {
    std::lock_guard<std::mutex> lock(ctx->mutex);
    auto it = std::find_if(ctx->localWaiters.begin(), ctx->localWaiters.end(),
                           [&](const auto& w) { return w.first == waiter; });
    if (it == ctx->localWaiters.end()) return;  // completed meanwhile
    promise.emplace(std::move(it->second));
    ctx->localWaiters.erase(it);
    unused = !ctx->released && ctx->localWaiters.empty() && ctx->peers.empty() && ctx->sends.empty() &&
             ctx->recvs.empty() && !ctx->pass;
  }
  if (unused) releaseContext(ctx->id, name_, std::nullopt, /*forward=*/false);
  promise->setError(reason);
}

// Note [Gradient folding]
// A step over the sum of several contexts' gradients (DistributedOptimizer::step(contextIds): a pipeline
// runs one context per micro-batch) would otherwise keep one gradient per leaf per context on every worker
// until the step: M copies of a stage's parameters at M micro-batches. foldGradients(from, into) makes
// `from` a forwarder: what it holds moves into `into` (added), and whatever it accumulates later goes there
// too, so the sum over the contexts is unchanged and the worker holds one gradient per leaf (plus, for the
// moment of an addition, the one being added). A chain (a into b, b into c) is followed; a fold that would
// close a cycle is refused (the target must not fold itself at the moment of the fold, checked under both
// contexts' locks, so no cycle can form). Once `into` is released here (a failed step), `from` keeps its
// later gradients itself.
void DistAutogradState::foldGradients(uint64_t from, uint64_t into) {
  DG_CHECK(from != into, "foldGradients on worker ", name_, ": context ", from, " cannot fold into itself");
  std::shared_ptr<Context> source = find(from, /*join=*/true);
  std::shared_ptr<Context> target = find(into, /*join=*/true);
  std::unordered_map<const tensor::TensorImpl*, std::pair<Tensor, Tensor>> moved;
  bool targetReleased = false;
  {
    std::scoped_lock lock(source->gradMutex, target->gradMutex);
    if (source->sink == target) return;  // folded before: idempotent
    DG_CHECK(source->sink == nullptr, "foldGradients on worker ", name_, ": context ", from,
             " already folds its gradients into context ", source->sink->id, ", not ", into);
    DG_CHECK(target->sink == nullptr, "foldGradients on worker ", name_, ": context ", into,
             " folds its own gradients into context ", target->sink->id, " (fold into that one)");
    targetReleased = target->dropped.load();
    if (!targetReleased) {
      source->sink = target;
      moved.swap(source->grads);
    }
  }
  if (targetReleased) throwReleased(into);
  for (auto& [impl, entry] : moved) target->accumulate(entry.first, std::move(entry.second));
}

Gradients DistAutogradState::gradients(uint64_t contextId) {
  auto ctx = find(contextId, false);
  Gradients out;
  std::lock_guard<std::mutex> lock(ctx->gradMutex);
  out.items_.reserve(ctx->grads.size());
  for (const auto& [impl, entry] : ctx->grads) out.items_.push_back(entry);
  return out;
}

size_t DistAutogradState::liveContexts() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return contexts_.size();
}

// ---- the forward: rpc::AutogradHook ----

rpc::AutogradSend DistAutogradState::onSend(uint64_t contextId, const std::string& peer,
                                            const std::vector<Tensor>& gradTensors) {
  std::shared_ptr<Context> ctx;
  try {
    ctx = find(contextId, true);
  } catch (const std::exception&) {
    // A message that needs nothing from a context that is gone here (a reply finishing after the release,
    // a late call of a thread still holding the id) goes without it: the receiver must not join it.
    if (gradTensors.empty()) return {};
    throw;
  }
  rpc::AutogradSend sent;
  sent.messageId = makeId(rank_, nextMessage_);
  std::shared_ptr<SendBackward> node;
  if (!gradTensors.empty()) {
    node = std::make_shared<SendBackward>(sent.messageId, peer);
    for (const auto& t : gradTensors) {
      node->nextEdges().push_back(gradientEdge(t));
      node->inputMeta().push_back(TensorMeta::of(t));
      node->outputMeta().push_back(TensorMeta::of(t));
    }
    sent.closureKnown = closureOf(node->nextEdges(), closureLimit_.load(), sent.closure);  // Note [Exact plans]
    if (!sent.closureKnown) sent.closure.clear();
  }
  {
    std::lock_guard<std::mutex> lock(ctx->mutex);
    if (!ctx->released) {
      if (peer != name_) ctx->peers.insert(peer);
      if (node) ctx->sends.emplace(sent.messageId, std::move(node));
      return sent;
    }
  }
  if (gradTensors.empty()) return {};
  throwReleased(contextId);
}

std::shared_ptr<Node> DistAutogradState::onReceive(const rpc::AutogradIds& ids, const std::string& peer,
                                                   std::vector<TensorMeta> gradMetas) {
  auto ctx = find(ids.contextId, true);
  std::unique_lock<std::mutex> lock(ctx->mutex);
  if (ctx->released) {
    lock.unlock();
    throwReleased(ids.contextId);
  }
  if (peer != name_) ctx->peers.insert(peer);
  if (gradMetas.empty()) return nullptr;
  auto [it, fresh] = ctx->recvs.try_emplace(ids.messageId);
  if (!fresh) {
    throw ValueError("worker " + peer + " reused autograd message id " + hex(ids.messageId) + " in context " +
                     std::to_string(ids.contextId));
  }
  auto node = std::make_shared<RecvBackward>(ids.contextId, ids.messageId, peer);
  node->closureKnown = ids.closureKnown;
  node->closure = ids.closure;
  node->gradientDeviceMap = ids.senderDeviceMap.inverse();
  node->outputs().resize(gradMetas.size());
  node->outputMeta() = std::move(gradMetas);
  it->second = node;
  return node;
}

// ---- the backward ----

std::chrono::milliseconds DistAutogradState::remaining(const Pass& pass) const {
  if (pass.deadline == Clock::time_point::max()) return std::chrono::milliseconds(-1);
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(pass.deadline - Clock::now());
  // The pass's own deadline (the root's timer) decides, with its clearer message; the calls it makes
  // expire a little later, so they only matter when that timer cannot fire (a worker's view of the pass).
  const auto grace = std::max(std::chrono::milliseconds(50), left / 10);
  return std::max(left, std::chrono::milliseconds(1)) + grace;
}

rpc::Error DistAutogradState::localError(rpc::ErrorKind kind, const std::string& message) const {
  rpc::Error error{kind, message, name_, {}};
  return error;
}

std::shared_ptr<DistAutogradState::Pass> DistAutogradState::passFor(Context& ctx, uint64_t passId, BackwardMode mode,
                                                                    bool retainGraph, Clock::time_point deadline) {
  if (ctx.pass && ctx.pass->id == passId) return ctx.pass;
  if (ctx.pass && ctx.pass->busy()) {
    throw rpc::RpcError(
        localError(rpc::ErrorKind::kFailed, "another backward pass is still running in distributed autograd context " +
                                                std::to_string(ctx.id) + " on worker " + name_));
  }
  auto pass = std::make_shared<Pass>();
  pass->id = passId;
  pass->mode = mode;
  pass->retainGraph = retainGraph;
  pass->deadline = deadline;
  ctx.pass = pass;
  return pass;
}

rpc::Future<void> DistAutogradState::backward(uint64_t contextId, const std::vector<Tensor>& roots,
                                              const std::vector<Tensor>& grads, const BackwardOptions& options,
                                              bool drainHere, bool join) {
  trace::WorkerScope traceWorker(traceWorker_);  // the caller's thread runs nodes of the pass too
  DG_CHECK(!roots.empty(), "distributed backward: no roots given");
  DG_CHECK(grads.empty() || grads.size() == roots.size(), "distributed backward: ", roots.size(), " roots but ",
           grads.size(), " gradients");
  std::vector<Edge> edges;
  std::vector<Tensor> rootGrads;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    DG_CHECK(r.defined() && r.requiresGrad(), "distributed backward: root ", i, " does not require grad");
    if (grads.empty()) {
      DG_CHECK(r.numel() == 1, "distributed backward: root ", i, " has shape ", tensor::shapeStr(r.shape()),
               "; an implicit gradient needs a one-element tensor (pass explicit gradients)");
      rootGrads.push_back(Tensor::ones(r.shape(), r.dtype(), r.device()));
    } else {
      DG_CHECK(grads[i].defined() && grads[i].shape() == r.shape() && grads[i].dtype() == r.dtype(),
               "distributed backward: gradient ", i, " must be a ", dtypeName(r.dtype()), " tensor of shape ",
               tensor::shapeStr(r.shape()));
      rootGrads.push_back(grads[i]);
    }
    edges.push_back(gradientEdge(r));
  }
  const auto timeout = options.timeout.count() == 0 ? defaultTimeout_ : options.timeout;
  const auto deadline = timeout.count() > 0 ? Clock::now() + timeout : Clock::time_point::max();

  auto ctx = find(contextId, join);
  std::unique_lock<std::mutex> lock(ctx->mutex);
  if (ctx->released) {
    lock.unlock();
    throwReleased(contextId);
  }
  if (ctx->pass && ctx->pass->busy()) {
    throw ValueError("distributed backward: another backward pass is running in context " + std::to_string(contextId));
  }
  auto pass = passFor(*ctx, makeId(rank_, nextPass_), options.mode, options.retainGraph, deadline);
  pass->isRoot = true;
  pass->roots = edges;
  pass->rootGrads = std::move(rootGrads);
  pass->localDone = options.localDone;
  rpc::Promise<void> promise(*executor_);
  rpc::Future<void> done = promise.getFuture();
  pass->waiters.push_back(std::move(promise));

  std::weak_ptr<DistAutogradState> weak = weak_from_this();
  auto abortWith = [weak, ctx, pass](rpc::Error error) {
    auto self = weak.lock();
    if (!self) return;
    std::lock_guard<std::mutex> l(ctx->mutex);
    if (!pass->finished) self->failPass(*ctx, *pass, std::move(error));
  };
  if (deadline != Clock::time_point::max()) {
    std::string detail = options.mode == BackwardMode::kFast
                             ? " (FAST mode waits for a gradient for every send of the context; a send whose "
                               "result no root uses never receives one: BackwardMode::kExact does not wait for it)"
                             : "";
    rpc::Error error =
        localError(rpc::ErrorKind::kTimeout, "distributed backward of context " + std::to_string(contextId) + " (" +
                                                 backwardModeName(options.mode) + " mode) did not finish within " +
                                                 std::to_string(timeout.count()) + " ms" + detail);
    std::lock_guard<std::mutex> l(timerMutex_);
    if (!timers_) timers_ = std::make_unique<rpc::TimerQueue>();
    pass->timer = timers_->schedule(deadline, [abortWith, error] { abortWith(error); });
  }

  // The root's starts are known before any gradient can come back to it, and its own completion is what
  // the backward waits for: gradients arriving here are "later" ones (Note [Distributed backward]).
  pass->planned = true;
  pass->gotGradients = true;
  std::map<uint64_t, std::vector<uint64_t>> plans;  // other workers' parts of the plan, by rank
  rpc::Future<void> discovered = [&] {
    if (options.mode == BackwardMode::kFast) return rpc::makeReadyFuture(*executor_);
    if (auto plan = planFrom(edges)) {  // Note [Exact plans]
      for (uint64_t id : *plan) {
        if (rankOf(id) != rank_) {
          plans[rankOf(id)].push_back(id);
        } else if (ctx->sends.count(id) != 0) {
          pass->activeSends.insert(id);
        } else {
          plans.clear();
          return rpc::makeErrorFuture<void>(
              localError(rpc::ErrorKind::kFailed, "the forward record of context " + std::to_string(contextId) +
                                                      " names message " + hex(id) + ", which worker " + name_ +
                                                      " never sent"),
              *executor_);
        }
      }
      return rpc::makeReadyFuture(*executor_);
    }
    std::vector<Node*> starts;
    for (const auto& e : edges) starts.push_back(e.fn.get());
    return discover(ctx, pass, std::move(starts), lock);
  }();
  lock.unlock();
  // Before the gradients: on each link a worker's plan precedes the gradients sent to it.
  if (!plans.empty()) sendPlans(ctx, pass, std::move(plans));
  // Registered outside the lock (a token cancelled already runs the callback inline); the callback only
  // posts the abort, so dropping the registration never waits on a callback that waits on our locks.
  auto registration = options.cancel.onCancel([abortWith, this](const rpc::Error& reason) {
    rpc::Error error = localError(rpc::ErrorKind::kCancelled, "distributed backward cancelled: " + reason.message);
    (void)executor_->post([abortWith, error] { abortWith(error); });
  });
  {
    std::lock_guard<std::mutex> l(ctx->mutex);
    pass->cancelRegistration.emplace(std::move(registration));
  }
  // A token cancelled before the pass starts aborts it here, before any gradient moves: the posted abort
  // above could be overtaken by a pass that finishes at once (startGradients skips a finished pass).
  if (auto reason = options.cancel.reason()) {
    abortWith(localError(rpc::ErrorKind::kCancelled, "distributed backward cancelled: " + reason->message));
  }
  if (drainHere) {
    auto result = discovered.result();
    if (!result.ok()) {
      std::lock_guard<std::mutex> l(ctx->mutex);
      if (!pass->finished) failPass(*ctx, *pass, result.error());
    } else {
      startGradients(ctx, pass);
    }
  } else {
    (void)std::move(discovered).then([weak, ctx, pass](rpc::Result<void>&& result) {
      auto self = weak.lock();
      if (!self) return;
      if (!result.ok()) {
        std::lock_guard<std::mutex> l(ctx->mutex);
        if (!pass->finished) self->failPass(*ctx, *pass, result.error());
      } else {
        self->startGradients(ctx, pass);
      }
    });
  }
  return done;
}

std::optional<std::vector<uint64_t>> DistAutogradState::planFrom(const std::vector<Edge>& roots) const {
  std::unordered_set<const Node*> seen;
  std::unordered_set<uint64_t> plan;
  std::vector<const Node*> stack;
  for (const auto& e : roots) {
    if (e.valid()) stack.push_back(e.fn.get());
  }
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (const auto* recv = dynamic_cast<const RecvBackward*>(node)) {
      if (!recv->closureKnown) return std::nullopt;
      plan.insert(recv->messageId);
      plan.insert(recv->closure.begin(), recv->closure.end());
      continue;
    }
    for (const auto& e : node->nextEdges()) {
      if (e.valid()) stack.push_back(e.fn.get());
    }
  }
  return std::vector<uint64_t>(plan.begin(), plan.end());
}

void DistAutogradState::sendPlans(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass,
                                  std::map<uint64_t, std::vector<uint64_t>> byRank) {
  std::vector<std::string> workers;
  {
    std::lock_guard<std::mutex> lock(agentMutex_);
    if (agent_ != nullptr) workers = agent_->workerNames();
  }
  std::unique_lock<std::mutex> lock(ctx->mutex);
  for (auto& [rank, ids] : byRank) {
    if (pass->finished) return;
    if (rank >= workers.size()) {
      failPass(*ctx, *pass,
               localError(rpc::ErrorKind::kFailed, "the forward record of context " + std::to_string(ctx->id) +
                                                       " names message " + hex(ids.front()) + " of rank " +
                                                       std::to_string(rank) + ", which is not a worker"));
      return;
    }
    DiscoverRequest request;
    request.contextId = ctx->id;
    request.passId = pass->id;
    request.retainGraph = pass->retainGraph;
    request.messageIds = std::move(ids);
    ++pass->outstanding;
    const auto timeout = remaining(*pass);
    lock.unlock();
    track(ctx, pass, call(workers[rank], kPlan, request, timeout));
    lock.lock();
  }
}

void DistAutogradState::track(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass,
                              rpc::Future<void> answered) {
  std::weak_ptr<DistAutogradState> weak = weak_from_this();
  (void)std::move(answered).then([weak, ctx, pass](rpc::Result<void>&& result) {
    auto self = weak.lock();
    if (!self) return;
    std::lock_guard<std::mutex> l(ctx->mutex);
    --pass->outstanding;
    if (pass->finished) return;
    if (!result.ok()) {
      self->failPass(*ctx, *pass, result.error());
    } else {
      self->finishIfDone(*ctx, *pass);
    }
  });
}

rpc::Future<void> DistAutogradState::discover(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass,
                                              std::vector<Node*> starts, std::unique_lock<std::mutex>& lock) {
  // Note [Exact discovery]. Own sends behind self-received messages are activated here at once.
  std::map<std::string, std::vector<uint64_t>> byPeer;
  while (!starts.empty()) {
    Node* node = starts.back();
    starts.pop_back();
    if (node == nullptr || !pass->walked.insert(node).second) continue;
    if (auto* recv = dynamic_cast<RecvBackward*>(node)) {
      if (recv->peer != name_) {
        byPeer[recv->peer].push_back(recv->messageId);
      } else if (auto it = ctx->sends.find(recv->messageId); it != ctx->sends.end()) {
        if (pass->activeSends.insert(recv->messageId).second) starts.push_back(it->second.get());
      }
      continue;
    }
    for (const auto& e : node->nextEdges()) {
      if (e.valid()) starts.push_back(e.fn.get());
    }
  }
  if (byPeer.empty()) return rpc::makeReadyFuture(*executor_);
  std::vector<rpc::Future<void>> calls;
  const auto timeout = remaining(*pass);
  const uint64_t passId = pass->id;
  const bool retain = pass->retainGraph;
  lock.unlock();
  for (auto& [peer, ids] : byPeer) {
    DiscoverRequest request;
    request.contextId = ctx->id;
    request.passId = passId;
    request.retainGraph = retain;
    request.messageIds = std::move(ids);
    calls.push_back(call(peer, kDiscover, request, timeout));
  }
  lock.lock();
  return rpc::whenAll(std::move(calls)).then([](std::vector<rpc::Result<void>>&& results) -> rpc::Result<void> {
    for (auto& r : results) {
      if (!r.ok()) return r.error();
    }
    return {};
  });
}

rpc::Future<void> DistAutogradState::onDiscover(DiscoverRequest request, const rpc::CallContext& call) {
  auto ctx = find(request.contextId, false);
  std::unique_lock<std::mutex> lock(ctx->mutex);
  const auto deadline = call.timeout.count() > 0 ? Clock::now() + call.timeout : Clock::time_point::max();
  auto pass = passFor(*ctx, request.passId, BackwardMode::kExact, request.retainGraph, deadline);
  pass->planned = true;  // discovery completes everywhere before the root lets gradients flow
  if (pass->mode != BackwardMode::kExact || pass->task) {
    throw rpc::RpcError(localError(rpc::ErrorKind::kFailed, "discovery for pass " + hex(request.passId) +
                                                                " of context " + std::to_string(ctx->id) +
                                                                " arrived after its gradients (protocol error)"));
  }
  std::vector<Node*> starts;
  for (uint64_t id : request.messageIds) {
    auto it = ctx->sends.find(id);
    if (it == ctx->sends.end()) {
      throw rpc::RpcError(localError(rpc::ErrorKind::kFailed, "worker " + call.caller +
                                                                  " asked for gradients of message " + hex(id) +
                                                                  ", which worker " + name_ +
                                                                  " never sent in context " + std::to_string(ctx->id)));
    }
    if (pass->activeSends.insert(id).second) starts.push_back(it->second.get());
  }
  return discover(ctx, pass, std::move(starts), lock);
}

void DistAutogradState::onPlan(const DiscoverRequest& request, const rpc::CallContext& call) {
  auto ctx = find(request.contextId, false);
  std::unique_lock<std::mutex> lock(ctx->mutex);
  const auto deadline = call.timeout.count() > 0 ? Clock::now() + call.timeout : Clock::time_point::max();
  auto pass = passFor(*ctx, request.passId, BackwardMode::kExact, request.retainGraph, deadline);
  if (pass->finished) return;  // aborted before its plan came
  if (pass->planned || pass->mode != BackwardMode::kExact) {
    throw rpc::RpcError(localError(rpc::ErrorKind::kFailed, "a second plan for pass " + hex(request.passId) +
                                                                " of context " + std::to_string(ctx->id) +
                                                                " (protocol error)"));
  }
  for (uint64_t id : request.messageIds) {
    if (ctx->sends.count(id) == 0) {
      throw rpc::RpcError(localError(rpc::ErrorKind::kFailed, "the plan from " + call.caller + " names message " +
                                                                  hex(id) + ", which worker " + name_ +
                                                                  " never sent in context " + std::to_string(ctx->id)));
    }
  }
  pass->activeSends.insert(request.messageIds.begin(), request.messageIds.end());
  pass->planned = true;
  if (pass->buffered.empty()) return;
  createTask(*ctx, *pass);
  auto buffered = std::move(pass->buffered);
  pass->buffered.clear();
  for (auto& [messageId, grads] : buffered) {
    if (auto error = deliverToSend(*ctx, *pass, messageId, std::move(grads))) {
      failPass(*ctx, *pass, *error);
      return;
    }
  }
  drain(ctx, pass, lock);
}

void DistAutogradState::createTask(Context& ctx, Pass& pass) {
  std::vector<Edge> starts = pass.roots;
  for (const auto& [id, send] : ctx.sends) {
    if (pass.mode == BackwardMode::kFast || pass.activeSends.count(id)) starts.push_back(Edge{send, 0});
  }
  GraphTaskOptions options;
  options.retainGraph = pass.retainGraph;
  // Leaves accumulate into the context (never .grad). The context outlives the task (it owns the pass).
  options.leafSink = [&ctx](AccumulateGrad& leaf, Tensor grad) { ctx.accumulate(leaf.variable(), std::move(grad)); };
  pass.task = std::make_unique<GraphTask>(starts, std::move(options));
}

void DistAutogradState::startGradients(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass) {
  std::unique_lock<std::mutex> lock(ctx->mutex);
  if (pass->finished) return;
  createTask(*ctx, *pass);
  for (size_t i = 0; i < pass->roots.size(); ++i) pass->task->deliver(pass->roots[i], pass->rootGrads[i]);
  pass->rootGrads.clear();
  drain(ctx, pass, lock);
}

std::optional<rpc::Error> DistAutogradState::deliverToSend(Context& ctx, Pass& pass, uint64_t messageId,
                                                           std::vector<Tensor> grads) {
  auto it = ctx.sends.find(messageId);
  if (it == ctx.sends.end() || !pass.task->contains(it->second.get())) {
    return localError(rpc::ErrorKind::kFailed, "gradients for message " + hex(messageId) + " of context " +
                                                   std::to_string(ctx.id) + ", which this backward pass on worker " +
                                                   name_ + " does not expect");
  }
  SendBackward& send = *it->second;
  if (grads.size() != send.numOutputs()) {
    return localError(rpc::ErrorKind::kFailed, "message " + hex(messageId) + " carried " +
                                                   std::to_string(send.numOutputs()) + " grad tensors but " +
                                                   std::to_string(grads.size()) + " gradients came back");
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& meta = send.outputMeta()[i];
    if (grads[i].defined() && (grads[i].shape() != meta.shape || grads[i].dtype() != meta.dtype)) {
      return localError(rpc::ErrorKind::kFailed, "gradient " + std::to_string(i) + " for message " + hex(messageId) +
                                                     " is " + dtypeName(grads[i].dtype()) + " " +
                                                     tensor::shapeStr(grads[i].shape()) + ", but the sent tensor was " +
                                                     dtypeName(meta.dtype) + " " + tensor::shapeStr(meta.shape));
    }
    // CUDA over RPC: the gradient must come back on the sent tensor's device (the receiver answers with the
    // inverse of the forward's device map); anything else is a map mismatch, never silently moved.
    if (grads[i].defined() && grads[i].device() != meta.device) {
      return localError(rpc::ErrorKind::kFailed, "gradient " + std::to_string(i) + " for message " + hex(messageId) +
                                                     " arrived on " + grads[i].device().str() +
                                                     ", but the sent tensor was on " + meta.device.str() +
                                                     " (the receiver's device map back to " + name_ +
                                                     " is not the inverse of the forward's)");
    }
  }
  pass.task->deliverAll(it->second.get(), std::move(grads));
  return std::nullopt;
}

rpc::Future<void> DistAutogradState::onPropagate(PropagateRequest request, const rpc::CallContext& call) {
  if (trace::enabled()) {
    trace::instant("autograd.recv_gradients", trace::Category::kAutograd,
                        {static_cast<int64_t>(request.contextId), static_cast<int64_t>(request.messageId),
                         gradientBytes(request.grads)});
  }
  auto ctx = find(request.contextId, false);
  std::unique_lock<std::mutex> lock(ctx->mutex);
  DG_CHECK(request.mode <= static_cast<uint8_t>(BackwardMode::kFast), "unknown backward mode ", int(request.mode));
  const auto mode = static_cast<BackwardMode>(request.mode);
  const auto deadline = call.timeout.count() > 0 ? Clock::now() + call.timeout : Clock::time_point::max();
  auto pass = passFor(*ctx, request.passId, mode, request.retainGraph, deadline);
  if (mode != pass->mode) {
    throw rpc::RpcError(localError(rpc::ErrorKind::kFailed, "gradients of pass " + hex(request.passId) + " in " +
                                                                backwardModeName(mode) + " mode, but the pass is " +
                                                                backwardModeName(pass->mode)));
  }
  if (mode == BackwardMode::kFast) pass->planned = true;  // every send of the context is expected
  if (pass->finished) {
    throw rpc::RpcError(pass->error
                            ? *pass->error
                            : localError(rpc::ErrorKind::kFailed, "gradients for message " + hex(request.messageId) +
                                                                      " arrived after the pass finished"));
  }
  // Note [Distributed backward]: the first gradient's call completes with this worker's whole pass.
  const bool first = !pass->gotGradients;
  pass->gotGradients = true;
  rpc::Future<void> answer = [&] {
    if (!first) return rpc::makeReadyFuture(*executor_);
    rpc::Promise<void> promise(*executor_);
    auto future = promise.getFuture();
    pass->waiters.push_back(std::move(promise));
    return future;
  }();
  if (!pass->planned) {  // Note [Exact plans]: this worker's plan is still on its way
    pass->buffered.emplace_back(request.messageId, std::move(request.grads));
    return answer;
  }
  if (!pass->task) createTask(*ctx, *pass);
  if (auto error = deliverToSend(*ctx, *pass, request.messageId, std::move(request.grads))) {
    failPass(*ctx, *pass, *error);
    throw rpc::RpcError(*error);
  }
  drain(ctx, pass, lock);
  return answer;
}

void DistAutogradState::drain(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass,
                              std::unique_lock<std::mutex>& lock) {
  if (pass->running) return;  // the running thread picks up what was just delivered
  pass->running = true;
  while (!pass->finished) {
    Node* node = pass->task->popReady();
    if (node == nullptr) break;
    std::vector<Tensor> inputs = pass->task->takeInputs(node);
    auto* recv = dynamic_cast<RecvBackward*>(node);
    lock.unlock();
    std::vector<Tensor> out;
    std::optional<rpc::Error> failure;
    const int64_t runBeginNs = trace::enabled() ? trace::nowNs() : 0;
    try {
      // A RecvBackward's gradients go back to the peer that sent its tensors; hooks on those tensors
      // (registerHook, retainGrad) run first, as they would on a local node.
      if (recv != nullptr) {
        inputs = pass->task->runPreHooks(*node, std::move(inputs));
      } else {
        out = pass->task->run(*node, std::move(inputs));
      }
    } catch (const std::exception& e) {
      failure = localError(rpc::ErrorKind::kRemote,
                           "distributed backward failed on worker " + name_ + " in " + node->name() + ": " + e.what());
    }
    if (runBeginNs != 0) {
      // docs/tracing.md: one span per node run in a distributed pass, named by the node.
      trace::recordSpan(trace::intern(node->name()), trace::Category::kAutograd, runBeginNs,
                             trace::nowNs(), {static_cast<int64_t>(ctx->id), static_cast<int64_t>(pass->id)});
    }
    lock.lock();
    if (failure) {
      if (!pass->finished) failPass(*ctx, *pass, *failure);
      break;
    }
    if (pass->finished) break;
    pass->task->finish(node, std::move(out));
    if (recv != nullptr) {
      // Running a RecvBackward is sending its gradients: its post-hooks run once they were handed to the
      // agent (a pipeline stage's backward ends there, Note [Stage backward bracket] in
      // models/pipeline/rpc_pipeline.cpp, so the stage computes nothing else before they left).
      const bool postHooks = !recv->postHooks().empty();
      std::vector<Tensor> sent = postHooks ? inputs : std::vector<Tensor>{};
      sendGradients(ctx, pass, *recv, std::move(inputs), lock);
      if (postHooks) {
        lock.unlock();
        try {
          pass->task->runPostHooks(*node, sent);
        } catch (const std::exception& e) {
          failure = localError(rpc::ErrorKind::kRemote, "distributed backward failed on worker " + name_ + " in " +
                                                            node->name() + "'s post-hook: " + e.what());
        }
        lock.lock();
        if (failure) {
          if (!pass->finished) failPass(*ctx, *pass, *failure);
          break;
        }
      }
    }
  }
  pass->running = false;
  // Note [Local part done]: before the completion, which may follow at once (nothing outstanding).
  if (!pass->finished && pass->task && pass->task->done()) {
    std::vector<std::pair<uint64_t, rpc::Promise<void>>> waiters;
    if (!ctx->localPartRan) {
      ctx->localPartRan = true;
      waiters.swap(ctx->localWaiters);
    }
    std::function<void()> localDone = std::exchange(pass->localDone, nullptr);
    if (localDone || !waiters.empty()) {
      lock.unlock();
      for (auto& waiter : waiters) waiter.second.setValue();
      if (localDone) localDone();
      lock.lock();
    }
  }
  finishIfDone(*ctx, *pass);
}

void DistAutogradState::sendGradients(const std::shared_ptr<Context>& ctx, const std::shared_ptr<Pass>& pass,
                                      RecvBackward& recv, std::vector<Tensor> grads,
                                      std::unique_lock<std::mutex>& lock) {
  if (recv.peer == name_) {  // a message of this worker to itself: no RPC
    if (auto error = deliverToSend(*ctx, *pass, recv.messageId, std::move(grads))) failPass(*ctx, *pass, *error);
    return;
  }
  PropagateRequest request;
  request.contextId = ctx->id;
  request.passId = pass->id;
  request.messageId = recv.messageId;
  request.mode = static_cast<uint8_t>(pass->mode);
  request.retainGraph = pass->retainGraph;
  if (trace::enabled()) {
    trace::instant("autograd.send_gradients", trace::Category::kAutograd,
                        {static_cast<int64_t>(ctx->id), static_cast<int64_t>(recv.messageId), gradientBytes(grads)});
  }
  request.grads = std::move(grads);
  ++pass->outstanding;
  const auto timeout = remaining(*pass);
  const std::string peer = recv.peer;
  // The gradients go back through the inverse of the forward message's device map (when it had one; else
  // the agent's map for the sender, rpc/device_map.h).
  const rpc::DeviceMap* deviceMap = recv.gradientDeviceMap.empty() ? nullptr : &recv.gradientDeviceMap;
  lock.unlock();
  track(ctx, pass, call(peer, kPropagate, request, timeout, deviceMap));
  lock.lock();
}

void DistAutogradState::cancelTimer(Pass& pass) {
  if (pass.timer == rpc::kInvalidTimerId) return;
  std::lock_guard<std::mutex> lock(timerMutex_);
  if (timers_) timers_->cancel(pass.timer);
  pass.timer = rpc::kInvalidTimerId;
}

void DistAutogradState::finishIfDone(Context& ctx, Pass& pass) {
  if (pass.finished || pass.running || pass.outstanding != 0 || !pass.task || !pass.task->done()) return;
  pass.finished = true;
  cancelTimer(pass);
  pass.task.reset();
  for (auto& waiter : pass.waiters) waiter.setValue();
  pass.waiters.clear();
  (void)ctx;
}

void DistAutogradState::failPass(Context& ctx, Pass& pass, rpc::Error error) {
  DG_ASSERT(!pass.finished, "failPass on a finished pass");
  pass.finished = true;
  pass.error = error;
  cancelTimer(pass);
  for (auto& waiter : pass.waiters) waiter.setError(error);
  pass.waiters.clear();
  if (!ctx.localPartRan) {  // Note [Local part done]
    for (auto& waiter : ctx.localWaiters) waiter.second.setError(error);
    ctx.localWaiters.clear();
  }
  if (pass.isRoot && ctx.abortedPass != pass.id) {
    ctx.abortedPass = pass.id;
    ControlRequest request;
    request.kind = static_cast<uint8_t>(ControlKind::kAbort);
    request.contextId = ctx.id;
    request.passId = pass.id;
    request.errorKind = static_cast<uint8_t>(error.kind);
    request.message = error.message;
    request.worker = error.worker;
    broadcast(ctx.peers, name_, request);
  }
}

// Note [Control in order]: dg.autograd.control (release, abort) is an inline function (Note [Inline
// handlers] in rpc/agent.cpp): it runs as soon as it is read, before any call that came after it on the same
// connection starts. On the executor it could run after them: a driver that ended a context and then ran
// the next micro-batch's backward saw worker1 add that backward's gradients into the context it had
// folded into, still alive there, which the release then dropped (Note [Gradient folding]: a folding
// context keeps its gradients once its target is released; a failure of
// AContextFoldingIntoAReleasedOneKeepsItsGradients, about 1 run in 300 with the other core busy). It takes
// short locks and sends its forwards asynchronously, and leaves the freeing of a released context's graphs
// to the executor.
void DistAutogradState::onControl(const ControlRequest& request, const std::string& from) {
  DG_CHECK(request.kind <= static_cast<uint8_t>(ControlKind::kAbort), "unknown control kind ", int(request.kind));
  DG_CHECK(request.errorKind <= static_cast<uint8_t>(rpc::ErrorKind::kRemote), "unknown error kind ",
           int(request.errorKind));
  DG_CHECK(request.covered.size() <= kMaxCovered, "control message lists ", request.covered.size(),
           " workers reached (at most ", kMaxCovered, ")");
  if (static_cast<ControlKind>(request.kind) == ControlKind::kRelease) {
    std::optional<rpc::Error> reason;
    if (!request.message.empty()) {
      reason = rpc::Error{static_cast<rpc::ErrorKind>(request.errorKind), request.message, request.worker, {}};
    }
    // Where the message was read (the loop, a thread reading its connection): a big graph's saved tensors
    // take a while to free, which the executor does instead.
    releaseContext(request.contextId, from, std::move(reason), true, rpc::Executor::current() != executor_,
                   request.covered);
    return;
  }
  std::shared_ptr<Context> ctx;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = contexts_.find(request.contextId);
    if (it == contexts_.end()) return;
    ctx = it->second;
  }
  std::set<std::string> peers;
  {
    std::lock_guard<std::mutex> lock(ctx->mutex);
    if (ctx->abortedPass == request.passId) return;  // forwarded once per worker
    ctx->abortedPass = request.passId;
    peers = ctx->peers;
    if (ctx->pass && ctx->pass->id == request.passId && !ctx->pass->finished) {
      failPass(*ctx, *ctx->pass,
               rpc::Error{static_cast<rpc::ErrorKind>(request.errorKind), request.message, request.worker, {}});
    }
  }
  broadcast(peers, from, request);
}

// Note [Control forwarding]
// A release or abort floods the context's workers along their peer sets (every worker that holds the
// context exchanged a message in it with one that does). Each message lists the workers already reached or
// being sent it (`covered`: the senders up the flood, the workers they send it to), and a receiver forwards
// only to its peers outside that list: they get it from someone else. Without the list, workers that all
// talked to each other sent it to each other again: a pipeline's driver ending a micro-batch's context
// made four control messages where two do (each stage forwarded to the other), and the next step's first
// calls queued behind them on the stages.
void DistAutogradState::broadcast(const std::set<std::string>& peers, const std::string& from, ControlRequest request) {
  std::set<std::string> covered(request.covered.begin(), request.covered.end());
  std::vector<std::string> targets;
  for (const auto& peer : peers) {
    if (peer != from && peer != name_ && !covered.count(peer)) targets.push_back(peer);
  }
  if (targets.empty()) return;
  covered.insert(from);
  covered.insert(name_);
  covered.insert(targets.begin(), targets.end());
  request.covered.assign(covered.begin(), covered.end());
  for (const auto& peer : targets) {
    // Fire and forget: a peer that is gone releases its side when it notices (onPeerDown).
    (void)call(peer, kControl, request, defaultTimeout_);
  }
}

template <typename Req>
rpc::Future<void> DistAutogradState::call(const std::string& peer, const rpc::Function<void(Req)>& fn,
                                          const Req& request, std::chrono::milliseconds timeout,
                                          const rpc::DeviceMap* deviceMap) {
  std::lock_guard<std::mutex> lock(agentMutex_);
  if (agent_ == nullptr) {
    return rpc::makeErrorFuture<void>(localError(rpc::ErrorKind::kFailed, "worker " + name_ + " is shut down"),
                                      *executor_);
  }
  rpc::AutogradContextScope outside(0);  // protocol messages belong to no context
  rpc::CallOptions options;
  options.timeout = timeout;
  if (deviceMap != nullptr) options.deviceMap = *deviceMap;
  return agent_->rpcAsyncWith(options, peer, fn, request);
}

void DistAutogradState::onPeerDown(const std::string& peer, const rpc::Error& error) {
  std::vector<uint64_t> touched;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, ctx] : contexts_) {
      std::lock_guard<std::mutex> l(ctx->mutex);
      if (ctx->peers.count(peer)) touched.push_back(id);
    }
  }
  for (uint64_t id : touched) {
    rpc::Error reason{rpc::ErrorKind::kDisconnected,
                      "worker " + peer + " of distributed autograd context " + std::to_string(id) + " is gone (" +
                          error.message + "); the context was released on " + name_,
                      peer,
                      {}};
    releaseContext(id, peer, reason, true);
  }
}

void DistAutogradState::onAgentClosed() {
  {
    std::lock_guard<std::mutex> lock(agentMutex_);
    agent_ = nullptr;
  }
  std::unordered_map<uint64_t, std::shared_ptr<Context>> contexts;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    contexts.swap(contexts_);
  }
  for (auto& [id, ctx] : contexts) {
    std::lock_guard<std::mutex> lock(ctx->mutex);
    ctx->released = true;
    if (ctx->pass && !ctx->pass->finished) {
      failPass(*ctx, *ctx->pass, localError(rpc::ErrorKind::kFailed, "worker " + name_ + " shut down"));
    }
    for (auto& waiter : ctx->localWaiters) {
      waiter.second.setError(localError(rpc::ErrorKind::kFailed, "worker " + name_ + " shut down"));
    }
    ctx->localWaiters.clear();
  }
}

}  // namespace distgrad::autograd::distributed
