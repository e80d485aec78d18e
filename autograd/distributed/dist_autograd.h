// Distributed autograd: one backward pass across every worker a forward pass touched through RPC, RRefs
// and RemoteModules (ARCHITECTURE §7, docs/dist_autograd.md).
//
//   rpc::Registry reg;
//   autograd::distributed::install(reg);            // on every worker, before Agent::start
//   auto agent = rpc::Agent::start(options, reg);
//   {
//     autograd::distributed::DistContext ctx(*agent);   // active on this thread until it ends
//     Tensor h = agent->rpcSync("worker1", kStage1, x);  // SendBackward here, RecvBackward on worker1
//     Tensor loss = crossEntropy(linear(h, w), labels);
//     ctx.backward({loss});                              // gradients flow back to every worker
//     Tensor gw = ctx.gradients().get(w);                // per context: .grad is never touched
//     optimizer.step(ctx);                               // DistributedOptimizer (models/optim)
//   }                                                    // leaving releases the context everywhere
//
// While a context is active on a thread, every RPC, remote() and toHere() made on that thread carries its
// id; tensors that require grad in its arguments or results record a SendBackward node on the sender and a
// RecvBackward node on the receiver (sharing a message id), and the callee's handler runs inside the same
// context, so further hops (A→B→C) and cycles (A→B→A) join it too; so do methods called through an RRef,
// also when they waited at the owner for the object. A handler's own asynchronous continuations do not
// inherit the context: one that makes calls activates it with rpc::AutogradContextScope(ctx.autogradContext).
//
// Backward modes (BackwardOptions::mode): kExact (default) waits only for the sends the roots depend on,
// known from what the forward recorded (each message carries the ids of the messages upstream of it; the
// root sends each worker its plan alongside the gradients), so a send whose result no root uses is never
// waited for; kFast is PyTorch's algorithm: every send of the context is assumed to receive a gradient,
// which waits (until the deadline) when one never does.
// Gradients accumulate per context on each worker (gradients()), also over several backward passes of
// one context (retainGraph). An error on any worker fails the root's backward with that worker's name and
// message; the deadline and the cancellation token abort the pass on every worker.
// Thread-safety: a DistContext is used by one thread at a time (activate() hands it to others); the
// free functions may be called from any thread. Nothing here blocks an executor thread except the
// synchronous backward(), which must not be called on the agent's executor (use backwardAsync there).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "rpc/agent.h"
#include "rpc/autograd_hook.h"
#include "rpc/cancellation.h"
#include "rpc/future.h"
#include "rpc/registry.h"
#include "tensor/tensor.h"

namespace distgrad::autograd::distributed {

// Binds the "dg.autograd.*" functions and the agent hook (rpc/autograd_hook.h) into `registry`. Every
// worker of a job that uses distributed autograd calls it before Agent::start.
void install(rpc::Registry& registry);

enum class BackwardMode : uint8_t {
  kExact = 0,  // wait only for the sends the roots depend on (discovered before gradients flow)
  kFast = 1,   // PyTorch's: wait for every send of the context
};
const char* backwardModeName(BackwardMode mode);

struct BackwardOptions {
  BackwardMode mode = BackwardMode::kExact;
  // Keep saved tensors so the graph can be run again (gradients keep accumulating in the context).
  bool retainGraph = false;
  // Bound on the whole pass: 0 = the agent's Options::defaultTimeout; negative = none.
  std::chrono::milliseconds timeout{0};
  // Cancelling it aborts the pass on every worker; the backward fails with `cancelled`.
  rpc::CancellationToken cancel;
  // Called once when the root worker's own part of the pass has run (Note [Local part done] in state.cpp):
  // every node of the pass on this worker has run and the gradients for other workers have been handed to
  // the agent, while the pass may still run elsewhere (the backward's future completes when every worker is
  // done). Not called when the pass fails first. Runs on the thread that ran this worker's last node, outside
  // the engine's locks, so it may start another backward (a pipeline's last stage starts the next
  // micro-batch's once this one's gradients have left it); it must not block. Empty: nothing is called.
  std::function<void()> localDone;
};

// The gradients one context accumulated on one worker: leaf tensor -> gradient (a snapshot; the tensors
// are the gradients themselves, not copies).
class Gradients {
 public:
  // The gradient of `leaf`, or an undefined tensor when none arrived.
  Tensor get(const Tensor& leaf) const;
  bool contains(const Tensor& leaf) const { return get(leaf).defined(); }
  size_t size() const { return items_.size(); }
  // (leaf, gradient) pairs, in no particular order.
  const std::vector<std::pair<Tensor, Tensor>>& items() const { return items_; }

 private:
  friend class DistAutogradState;
  std::vector<std::pair<Tensor, Tensor>> items_;
};

class DistAutogradState;

// One distributed autograd context, created on this worker (16-bit worker id = this agent's rank, 48-bit
// counter). RAII: the constructor makes it active on the constructing thread, the destructor (or end())
// deactivates it there and releases it on every worker it touched.
class DistContext {
 public:
  explicit DistContext(rpc::Agent& agent);
  ~DistContext();
  DistContext(DistContext&& other) noexcept;
  DistContext& operator=(DistContext&&) = delete;
  DistContext(const DistContext&) = delete;
  DistContext& operator=(const DistContext&) = delete;

  uint64_t id() const { return id_; }

  // Runs the distributed backward from `roots` (each a one-element tensor receiving gradient 1, or with
  // explicit `grads`, one per root) and returns once every worker has finished its part. Throws RpcError
  // (the failing worker's name and message; timeout; cancelled; disconnected) or ValueError (bad roots).
  void backward(const std::vector<Tensor>& roots, const BackwardOptions& options = {},
                const std::vector<Tensor>& grads = {});
  void backward(const Tensor& root, const BackwardOptions& options = {}) {
    backward(std::vector<Tensor>{root}, options);
  }
  rpc::Future<void> backwardAsync(const std::vector<Tensor>& roots, const BackwardOptions& options = {},
                                  const std::vector<Tensor>& grads = {});

  // This worker's gradients of this context.
  Gradients gradients() const;

  // Makes this context active on the calling thread for the guard's scope (threads other than the one
  // that created it: a pipeline's stage threads, a handler's continuation).
  rpc::AutogradContextScope activate() const { return rpc::AutogradContextScope(id_); }

  // Deactivates the context on this thread (if the constructor activated it here) and releases it on every
  // worker it touched. Idempotent; the destructor calls it.
  void end();

 private:
  std::shared_ptr<DistAutogradState> state_;
  uint64_t id_ = 0;
  uint64_t previous_ = 0;   // the context active on the creating thread before this one
  std::thread::id thread_;  // the creating thread
};

// Runs a distributed backward pass of context `contextId` rooted at THIS worker, which takes part in the
// context (a handler called in it: joined here now if its messages carried no grad tensor yet) but did not
// create it: e.g.
// a pipeline's last stage starting a micro-batch's backward from the loss it computed, without a round trip
// to the driver that owns the context. Same roots, gradients and options as DistContext::backwardAsync;
// completes once every worker has finished its part. The creator still ends the context (its end() releases
// it everywhere; a pass still running then fails). ValueError when the context is unknown here or released.
rpc::Future<void> backwardAsync(rpc::Agent& agent, uint64_t contextId, const std::vector<Tensor>& roots,
                                const BackwardOptions& options = {}, const std::vector<Tensor>& grads = {});

// Gradients of context `contextId` on this worker, e.g. in a handler that steps an optimizer for a
// context created elsewhere. Throws ValueError when this worker does not know the context (never joined,
// or released).
Gradients gradientsOf(rpc::Agent& agent, uint64_t contextId);

// Folds this worker's gradients of context `from` into context `into` (Note [Gradient folding] in
// state.cpp): what `from` holds here moves into `into` (added to its gradients), and every gradient `from`
// accumulates here later goes there too. For code that steps on the SUM of several contexts' gradients
// (DistributedOptimizer::step(contextIds), e.g. a pipeline's one context per micro-batch): the sum is
// unchanged, but the worker holds one gradient per leaf instead of one per context. From then on
// gradientsOf(from) here has nothing that `into` did not take; once `into` is released here, `from` keeps
// its later gradients itself. Folding again into the same context does nothing; a context created elsewhere
// and not yet seen here is joined (as its first message would: fold only into a context this worker takes
// part in, or it stays until the agent closes). Throws ValueError when a context is unknown here or
// released, when from == into, when `from` already folds into another context, or when `into` folds into
// another one itself (fold into that one: no cycles).
void foldGradients(rpc::Agent& agent, uint64_t from, uint64_t into);

// Completes once this worker's own part of a backward pass of context `contextId` has run here (Note [Local
// part done] in state.cpp): every node of the pass on this worker has run and its gradients for other
// workers were handed to the agent, so the context's gradients here are final for that pass, while the pass
// may still run elsewhere. At once when a pass's part already ran here (the first pass counts: with
// retainGraph, later passes add to the gradients after it). For code that acts on this worker's gradients
// as soon as they are complete, e.g. a pipeline stage stepping its optimizer part after its last backward
// (optim::DistributedOptimizer::stepAfterBackwardAsync). Fails when the context is released here (its
// release reason, or kCancelled), when a pass of it fails before a part ran here, when the agent shuts
// down, or when `cancel` is cancelled (its reason: a handler passes its call's token, so the caller's
// deadline ends the wait); it waits otherwise, so ask only on a worker that takes part in the backward.
// Like foldGradients, a context created elsewhere and not yet seen here is joined; one that nothing but
// the wait used here is released here when the wait is cancelled. Throws ValueError when the context is
// unknown here (created here and ended, or released).
rpc::Future<void> whenLocalPartDone(rpc::Agent& agent, uint64_t contextId, const rpc::CancellationToken& cancel = {});

// Contexts this worker currently holds (created or joined, not yet released): a gauge for leak checks.
size_t liveContexts(rpc::Agent& agent);

}  // namespace distgrad::autograd::distributed
