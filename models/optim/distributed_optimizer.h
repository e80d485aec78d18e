// DistributedOptimizer: one optimizer step over parameters that live on several workers, driven by the
// gradients one distributed autograd context accumulated on each of them (ARCHITECTURE §7, issue 5).
//
//   rpc::Registry reg;
//   rref::RRefContext::install(reg);
//   autograd::distributed::install(reg);
//   models::optim::DistributedOptimizer::install(reg);        // on every worker that may own parameters
//   ...
//   std::vector<rref::RRef<Tensor>> params = stage1.remoteParameters();   // RemoteModule on worker1
//   DistributedOptimizer opt(*agent, OptimizerSpec::sgd({.learningRate = 0.05, .momentum = 0.9}),
//                            params, head.parameters());               // head: a local module
//   {
//     autograd::distributed::DistContext ctx(*agent);
//     Tensor loss = mseLoss(head.forward(stage1.forward(x)), y);
//     ctx.backward(loss);
//     opt.step(ctx);             // every owner steps concurrently on ctx's gradients
//   }
//
// Like PyTorch's DistributedOptimizer, the parameter RRefs are grouped by owner and each remote owner gets
// one LocalOptimizer (created there with remote(), holding an ordinary SGD/Adam over that owner's
// parameters: the RRefs' local values, the parameter tensors themselves). Parameters of this worker (plain
// tensors in `localParams`, and RRefs this worker owns) get one LocalOptimizer in this process. A step sends
// one call to each remote owner and runs this worker's part meanwhile; each part reads its worker's
// gradients of the context (autograd::distributed::gradientsOf) and calls Optimizer::step(grads): a
// parameter without a gradient in that context is left alone (its optimizer state does not advance).
//
// Parameters must be leaf CPU float32/float64 contiguous tensors, each listed once (Optimizer's rules,
// checked on their owner when the optimizer is built: the constructor reports the owner's refusal).
//
// Serialisation (Note [Optimizer step locks] in the .cpp): every worker keeps one lock per parameter tensor
// for all the LocalOptimizers it holds, and a step takes the locks of all its parameters (in one global
// order, so steps over overlapping parameter sets cannot deadlock) for its whole update. Steps of one
// optimizer for several contexts, and steps of several DistributedOptimizers over the same parameters,
// therefore apply one after the other on each owner, never interleaved within a tensor; the order between
// them is the order in which they reach the locks. Steps over disjoint parameters run in parallel. A step
// waiting for a lock holds no thread (the locks queue callbacks). StepLockGuard takes the same locks.
//
// Errors: a failing owner's error comes back naming that worker (several failing owners: one RpcError
// listing each). The spec is validated on the caller (ValueError at construction) and again on every owner
// (the spec is wire input there).
//
// Thread-safety: a DistributedOptimizer may be stepped from several threads at once (see above); the
// constructor and step() block (never call them on an agent's executor thread: use stepAsync there, and
// build the optimizer outside handlers). The agent must outlive the optimizer's use; destroying the
// optimizer releases its LocalOptimizers on their owners.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "models/optim/adam.h"
#include "models/optim/optimizer.h"
#include "models/optim/sgd.h"
#include "rpc/agent.h"
#include "rpc/class.h"
#include "rpc/future.h"
#include "rpc/registry.h"
#include "rref/rref.h"
#include "tensor/tensor.h"

namespace distgrad::models::optim {

// Which optimizer to build on every owner, and its options: a value that travels to the owners. The fields
// mirror SgdOptions (kind "sgd"), AdamOptions (kind "adam") and AdamWOptions (kind "adamw"); the options of
// the other kinds must keep their defaults (a spec with kind "sgd" and amsgrad = true is a mistake and is
// refused).
struct OptimizerSpec {
  std::string kind = "sgd";
  double learningRate = 0.01;
  // SGD
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  // all kinds
  double weightDecay = 0.0;
  // Adam, AdamW
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  bool amsgrad = false;

  static OptimizerSpec sgd(const SgdOptions& options);
  static OptimizerSpec adam(const AdamOptions& options);
  static OptimizerSpec adamw(const AdamWOptions& options);

  // Throws ValueError naming the field, its value and what is expected: an unknown kind, a value the
  // kind's optimizer refuses, or an option of another kind changed from its default.
  void validate() const;
  // A new optimizer of this kind over `parameters` (validates first).
  std::unique_ptr<Optimizer> make(std::vector<Tensor> parameters) const;
  // "sgd(lr=0.05, momentum=0.9, ...)": for messages.
  std::string describe() const;

  template <class V>
  void visitFields(V& v) {
    v("kind", kind);
    v("learningRate", learningRate);
    v("momentum", momentum);
    v("dampening", dampening);
    v("nesterov", nesterov);
    v("weightDecay", weightDecay);
    v("beta1", beta1);
    v("beta2", beta2);
    v("eps", eps);
    v("amsgrad", amsgrad);
  }
};

namespace detail {
class ParameterLock;
}

// Holds the step locks (Note [Optimizer step locks] in the .cpp) of `params` on `agent`'s worker: while it
// lives, no LocalOptimizer of that worker updates them (their steps wait, without holding a thread), e.g.
// to read or save parameters that trainers step concurrently, consistently. The constructor blocks until
// the steps in progress on them have finished; it must not run on the agent's executor threads
// (ValueError).
class StepLockGuard {
 public:
  StepLockGuard(rpc::Agent& agent, const std::vector<Tensor>& params);
  ~StepLockGuard();
  StepLockGuard(const StepLockGuard&) = delete;
  StepLockGuard& operator=(const StepLockGuard&) = delete;

 private:
  std::shared_ptr<const std::vector<std::shared_ptr<detail::ParameterLock>>> locks_;
};

// The part of a DistributedOptimizer on one worker (PyTorch's _LocalOptimizer): an optimizer of the spec's
// kind over that worker's parameters. Remote owners create it through DistributedOptimizer::install's
// binding; DistributedOptimizer makes the local one directly. Users normally never touch it.
// Thread-safety: step() may be called concurrently; steps serialise on the parameters' locks.
class LocalOptimizer {
 public:
  // On the owner: `params` are RRefs this worker owns (their values may still be in the making: the
  // optimizer is built once all resolved), `tensors` plain local tensors. Throws ValueError for a bad
  // spec or RRefs of another owner.
  LocalOptimizer(rpc::Agent& agent, OptimizerSpec spec, std::vector<rref::RRef<Tensor>> params,
                 std::vector<Tensor> tensors = {});
  ~LocalOptimizer();
  LocalOptimizer(const LocalOptimizer&) = delete;
  LocalOptimizer& operator=(const LocalOptimizer&) = delete;

  // Completes with the number of parameters once the optimizer is built, or with the error that kept it
  // from being built (unresolvable RRef, a parameter the optimizer refuses), naming this worker.
  rpc::Future<int64_t> ready(const rpc::CallContext& ctx) const;
  // One step on context `contextId`'s gradients of this worker; completes with the number of parameters
  // that had a gradient (and were updated). The update runs on the calling thread when the optimizer is
  // built and its parameters' locks are free, else on the agent's executor once they are (no thread waits
  // meanwhile). Errors name this worker: unknown context, the optimizer's refusal.
  rpc::Future<int64_t> step(const rpc::CallContext& ctx, uint64_t contextId);
  // The same, outside a call (the DistributedOptimizer's own part).
  rpc::Future<int64_t> stepHere(rpc::Agent& agent, uint64_t contextId);
  // One step on the SUM of the gradients of several contexts of this worker (a pipeline's micro-batches,
  // each in its own context): each parameter's gradient is the sum of its gradients in the contexts that
  // hold one (a parameter without a gradient in any of them is left alone). Completes with the number of
  // parameters updated. Errors name this worker: no context ids, a context id listed twice, a context this
  // worker does not know (nothing is updated then).
  rpc::Future<int64_t> stepContexts(const rpc::CallContext& ctx, std::vector<uint64_t> contextIds);
  rpc::Future<int64_t> stepContextsHere(rpc::Agent& agent, std::vector<uint64_t> contextIds);
  // stepContexts once this worker's part of a backward pass of EVERY context in `contextIds` has run here
  // (autograd::distributed::whenLocalPartDone): sent before or while the backwards run, it waits here
  // without holding a thread and steps as soon as this worker's gradients are final, while the backwards
  // may still run elsewhere. Fails (nothing updated) when a context is released here or its backward fails
  // before that, or when the call is cancelled (its deadline), naming this worker.
  rpc::Future<int64_t> stepContextsAfterBackward(const rpc::CallContext& ctx, std::vector<uint64_t> contextIds);
  rpc::Future<int64_t> stepContextsAfterBackwardHere(rpc::Agent& agent, std::vector<uint64_t> contextIds,
                                                     const rpc::CancellationToken& cancel = {});
  rpc::Future<int64_t> readyHere(rpc::Agent& agent) const;

  // LocalOptimizers alive on `agent`'s worker (a gauge for tests and leak checks).
  static size_t liveCount(rpc::Agent& agent);

 struct State;  // the optimizer and its build status, shared with pending work

 private:
  std::shared_ptr<State> state_;
};

// The rpc::Class of LocalOptimizer (the remote object DistributedOptimizer creates on each owner).
const rpc::Class<LocalOptimizer>& localOptimizerClass();

}  // namespace distgrad::models::optim

DG_RREF_CLASS(distgrad::models::optim::LocalOptimizer, distgrad::models::optim::localOptimizerClass());

namespace distgrad::models::optim {

class DistributedOptimizer {
 public:
  // Groups `params` by owner, creates a LocalOptimizer on each remote owner and one here for `localParams`
  // and the RRefs this worker owns, and waits until all are built. Throws ValueError (bad spec, no
  // parameters, empty RRef) or RpcError naming the owner that refused (e.g. a parameter that is not a
  // leaf).
  DistributedOptimizer(rpc::Agent& agent, OptimizerSpec spec, std::vector<rref::RRef<Tensor>> params,
                       std::vector<Tensor> localParams = {});
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  // Binds LocalOptimizer (its class and constructor) on a worker that may own parameters; call before
  // Agent::start, beside rref::RRefContext::install and autograd::distributed::install.
  static void install(rpc::Registry& registry);

  // One step of every owner on the gradients of context `contextId` (owners concurrently; this worker's
  // part on the calling thread). Throws RpcError naming the failing owner(s).
  void step(uint64_t contextId);
  void step(const autograd::distributed::DistContext& context) { step(context.id()); }
  // One step of every owner on the sum of the gradients of several contexts (e.g. one context per
  // micro-batch of a pipeline: the result equals one step on the whole batch's gradients). One call per
  // remote owner, whatever the number of contexts. Throws ValueError for an empty list or a repeated id,
  // RpcError naming the owner(s) that do not know one of the contexts (those owners update nothing).
  void step(const std::vector<uint64_t>& contextIds);
  // The same without blocking: this worker's part runs on the calling thread before it returns (when its
  // parameters' locks are free; else later on the executor), the remote owners' parts on their workers;
  // the future completes when all finished.
  rpc::Future<void> stepAsync(uint64_t contextId);
  rpc::Future<void> stepAsync(const std::vector<uint64_t>& contextIds);
  // stepAsync(contextIds) issued BEFORE the backwards finish (e.g. with a pipeline's forwards): each owner
  // steps as soon as its own part of one backward pass of every context has run there
  // (LocalOptimizer::stepContextsAfterBackward), as a local pipeline's stage steps right after its last
  // backward, instead of after the slowest worker's part and a round trip through this worker. Every owner
  // must take part in a backward of every context (an owner that never does waits until the contexts are
  // released: releasing them, e.g. ending them after a failed backward, fails the step with the release's
  // reason, and each owner updates nothing). The future completes when every owner has stepped.
  rpc::Future<void> stepAfterBackwardAsync(const std::vector<uint64_t>& contextIds);

  const OptimizerSpec& spec() const { return spec_; }
  // The workers holding a part of this optimizer: the remote owners in first-appearance order, then this
  // worker if it has parameters.
  std::vector<std::string> owners() const;
  size_t numParameters() const { return numParameters_; }

 private:
  rpc::Future<void> stepParts(const std::vector<uint64_t>& contextIds, bool afterBackward);
  struct RemotePart {
    std::string owner;
    rref::RRef<LocalOptimizer> optimizer;
  };
  rpc::Agent* agent_;
  OptimizerSpec spec_;
  std::vector<RemotePart> remote_;
  std::shared_ptr<LocalOptimizer> local_;
  size_t numParameters_ = 0;
};

}  // namespace distgrad::models::optim
