#include "models/optim/distributed_optimizer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <utility>

#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "rpc/autograd_hook.h"
#include "rpc/detail/handler.h"
#include "rpc/trace.h"
#include "rref/context.h"

namespace distgrad::models::optim {

// ---- OptimizerSpec ----

OptimizerSpec OptimizerSpec::sgd(const SgdOptions& options) {
  OptimizerSpec spec;
  spec.kind = "sgd";
  spec.learningRate = options.learningRate;
  spec.momentum = options.momentum;
  spec.dampening = options.dampening;
  spec.weightDecay = options.weightDecay;
  spec.nesterov = options.nesterov;
  return spec;
}

OptimizerSpec OptimizerSpec::adam(const AdamOptions& options) {
  OptimizerSpec spec;
  spec.kind = "adam";
  spec.learningRate = options.learningRate;
  spec.beta1 = options.beta1;
  spec.beta2 = options.beta2;
  spec.eps = options.eps;
  spec.weightDecay = options.weightDecay;
  spec.amsgrad = options.amsgrad;
  return spec;
}

OptimizerSpec OptimizerSpec::adamw(const AdamWOptions& options) {
  OptimizerSpec spec = adam(AdamOptions{options.learningRate, options.beta1, options.beta2, options.eps,
                                        options.weightDecay, options.amsgrad});
  spec.kind = "adamw";
  return spec;
}

void OptimizerSpec::validate() const {
  const bool isSgd = kind == "sgd";
  const bool isAdam = kind == "adam" || kind == "adamw";
  DG_CHECK(isSgd || isAdam, "OptimizerSpec: unknown optimizer kind '", kind, "' (expected sgd, adam or adamw)");
  DG_CHECK(std::isfinite(learningRate) && learningRate >= 0, "OptimizerSpec(", kind,
           "): learningRate must be a finite number >= 0, got ", learningRate);
  DG_CHECK(std::isfinite(weightDecay) && weightDecay >= 0, "OptimizerSpec(", kind,
           "): weightDecay must be a finite number >= 0, got ", weightDecay);
  // The options of the other kind must keep their defaults: a changed one would be silently ignored.
  const OptimizerSpec defaults;
  if (isSgd) {
    DG_CHECK(std::isfinite(momentum) && momentum >= 0, "OptimizerSpec(sgd): momentum must be a finite number >= 0, got ",
             momentum);
    DG_CHECK(dampening >= 0 && dampening <= 1, "OptimizerSpec(sgd): dampening must be in [0, 1], got ", dampening);
    DG_CHECK(!nesterov || (momentum > 0 && dampening == 0),
             "OptimizerSpec(sgd): nesterov momentum requires momentum > 0 and dampening == 0, got momentum ", momentum,
             " and dampening ", dampening);
    DG_CHECK(beta1 == defaults.beta1 && beta2 == defaults.beta2 && eps == defaults.eps && !amsgrad,
             "OptimizerSpec(sgd): beta1, beta2, eps and amsgrad are Adam options and must keep their defaults "
             "for sgd, got beta1 ",
             beta1, ", beta2 ", beta2, ", eps ", eps, ", amsgrad ", amsgrad);
  } else {
    DG_CHECK(beta1 >= 0 && beta1 < 1, "OptimizerSpec(", kind, "): beta1 must be in [0, 1), got ", beta1);
    DG_CHECK(beta2 >= 0 && beta2 < 1, "OptimizerSpec(", kind, "): beta2 must be in [0, 1), got ", beta2);
    DG_CHECK(std::isfinite(eps) && eps >= 0, "OptimizerSpec(", kind, "): eps must be a finite number >= 0, got ", eps);
    DG_CHECK(momentum == defaults.momentum && dampening == defaults.dampening && !nesterov, "OptimizerSpec(", kind,
             "): momentum, dampening and nesterov are SGD options and must keep their defaults for ", kind,
             ", got momentum ", momentum, ", dampening ", dampening, ", nesterov ", nesterov);
  }
}

std::unique_ptr<Optimizer> OptimizerSpec::make(std::vector<Tensor> parameters) const {
  validate();
  if (kind == "sgd") {
    return std::make_unique<SGD>(std::move(parameters),
                                 SgdOptions{learningRate, momentum, dampening, weightDecay, nesterov});
  }
  if (kind == "adam") {
    return std::make_unique<Adam>(std::move(parameters),
                                  AdamOptions{learningRate, beta1, beta2, eps, weightDecay, amsgrad});
  }
  return std::make_unique<AdamW>(std::move(parameters),
                                 AdamWOptions{learningRate, beta1, beta2, eps, weightDecay, amsgrad});
}

std::string OptimizerSpec::describe() const {
  std::ostringstream out;
  out << kind << "(lr=" << learningRate;
  if (kind == "sgd") {
    out << ", momentum=" << momentum << ", dampening=" << dampening << ", nesterov=" << (nesterov ? "true" : "false");
  } else {
    out << ", beta1=" << beta1 << ", beta2=" << beta2 << ", eps=" << eps << ", amsgrad=" << (amsgrad ? "true" : "false");
  }
  out << ", weightDecay=" << weightDecay << ")";
  return out.str();
}

// ---- per-worker parameter locks ----

namespace detail {

// Note [Optimizer step locks]: every worker keeps one lock per parameter tensor (keyed by its TensorImpl),
// shared by all its LocalOptimizers and StepLockGuards, in the agent's extension slot. A LocalOptimizer
// holds the locks of its parameters (and the parameters themselves, so a key's address cannot be reused
// while its lock lives). A step acquires its locks in ascending address order, so steps (and guards) over
// overlapping sets never deadlock; it runs its update once it holds them all and releases them afterwards.
// The locks are asynchronous: a waiter is a callback queued on the lock (FIFO), not a blocked thread, so a
// step that waits never holds an executor thread (ARCHITECTURE §3) and an agent with one executor thread
// serves other calls meanwhile. A released lock goes to its first waiter, whose callback is posted to the
// waiter's executor (or run on the releasing thread when it has none: a StepLockGuard's wake-up).
class ParameterLock {
 public:
  // Calls `granted` once this lock is the caller's: at once on this thread when it is free, else when an
  // earlier holder released it (posted to `executor`, or on the releasing thread when it is null).
  void acquire(rpc::Executor* executor, std::function<void()> granted) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (held_) {
        waiters_.push_back({executor, std::move(granted)});
        return;
      }
      held_ = true;
    }
    granted();
  }

  void release() {
    Waiter next;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      DG_ASSERT(held_, "ParameterLock::release of a free lock");
      if (waiters_.empty()) {
        held_ = false;
        return;
      }
      next = std::move(waiters_.front());
      waiters_.pop_front();
    }
    // The lock passes to `next` (held_ stays true).
    if (next.executor == nullptr) return next.granted();
    auto shared = std::make_shared<std::function<void()>>(std::move(next.granted));
    // An executor that has shut down refuses the task: run it here rather than leave the lock held forever.
    if (!next.executor->post([shared] { (*shared)(); })) (*shared)();
  }

 private:
  struct Waiter {
    rpc::Executor* executor = nullptr;
    std::function<void()> granted;
  };
  std::mutex mutex_;
  bool held_ = false;            // GUARDED_BY(mutex_)
  std::deque<Waiter> waiters_;   // GUARDED_BY(mutex_)
};

using LockSet = std::vector<std::shared_ptr<ParameterLock>>;

// Acquires locks[index..] in order, then calls `done` (on whichever thread granted the last one).
void acquireAll(const std::shared_ptr<const LockSet>& locks, size_t index, rpc::Executor* executor,
                std::function<void()> done) {
  if (index == locks->size()) return done();
  (*locks)[index]->acquire(executor, [locks, index, executor, done = std::move(done)]() mutable {
    acquireAll(locks, index + 1, executor, std::move(done));
  });
}

void releaseAll(const LockSet& locks) {
  for (auto it = locks.rbegin(); it != locks.rend(); ++it) (*it)->release();
}

class StepLocks : public rpc::AgentExtension {
 public:
  static std::shared_ptr<StepLocks> of(rpc::Agent& agent) {
    return std::static_pointer_cast<StepLocks>(
        agent.extension("dg.optim.step_locks", [](rpc::Agent&) { return std::make_shared<StepLocks>(); }));
  }

  // The locks of `params`, in acquisition order (ascending TensorImpl address).
  std::shared_ptr<const LockSet> locksOf(const std::vector<Tensor>& params) {
    std::vector<std::pair<const tensor::TensorImpl*, std::shared_ptr<ParameterLock>>> found;
    std::lock_guard<std::mutex> lock(mutex_);
    // Lock sets are made rarely (a LocalOptimizer's construction, a guard): sweep freed parameters here.
    for (auto it = locks_.begin(); it != locks_.end();) {
      it = it->second.expired() ? locks_.erase(it) : std::next(it);
    }
    for (const Tensor& p : params) {
      const tensor::TensorImpl* key = p.implPtr().get();
      if (std::any_of(found.begin(), found.end(), [&](const auto& f) { return f.first == key; })) continue;
      std::shared_ptr<ParameterLock> l = locks_[key].lock();
      if (!l) {
        l = std::make_shared<ParameterLock>();
        locks_[key] = l;
      }
      found.emplace_back(key, std::move(l));
    }
    std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    auto out = std::make_shared<LockSet>();
    out->reserve(found.size());
    for (auto& entry : found) out->push_back(std::move(entry.second));
    return out;
  }

  std::atomic<size_t> liveOptimizers{0};

 private:
  std::mutex mutex_;
  std::unordered_map<const tensor::TensorImpl*, std::weak_ptr<ParameterLock>> locks_;  // GUARDED_BY(mutex_)
};

}  // namespace detail

StepLockGuard::StepLockGuard(rpc::Agent& agent, const std::vector<Tensor>& params) {
  DG_CHECK(!agent.executor().isCurrentThread(), "StepLockGuard: must not be taken on an executor thread of ",
           agent.name(), " (a step waiting for a lock held there could need that thread)");
  for (size_t i = 0; i < params.size(); ++i) DG_CHECK(params[i].defined(), "StepLockGuard: parameter ", i, " is undefined");
  locks_ = detail::StepLocks::of(agent)->locksOf(params);
  std::promise<void> granted;
  std::future<void> ready = granted.get_future();
  detail::acquireAll(locks_, 0, nullptr, [&granted] { granted.set_value(); });
  ready.wait();
}

StepLockGuard::~StepLockGuard() { detail::releaseAll(*locks_); }

namespace {

// An error of this worker's part: the exception as an Error naming `worker`, its message prefixed by
// what failed.
rpc::Error partError(std::exception_ptr exception, const std::string& worker, const std::string& what) {
  rpc::Error error = rpc::detail::handlerError(std::move(exception), worker);
  error.message = what + ": " + error.message;
  return error;
}

}  // namespace

// ---- LocalOptimizer ----

struct LocalOptimizer::State {
  std::string worker;
  OptimizerSpec spec;
  std::shared_ptr<detail::StepLocks> stepLocks;

  std::mutex mutex;
  bool finished = false;              // GUARDED_BY(mutex): built, or failed to build
  std::optional<rpc::Error> error;    // GUARDED_BY(mutex): why it could not be built
  std::vector<std::function<void()>> waiters;  // GUARDED_BY(mutex): run once finished

  // Written once before `finished` is set, read-only afterwards.
  std::unique_ptr<Optimizer> optimizer;
  std::shared_ptr<const detail::LockSet> locks;

  ~State() {
    if (stepLocks) stepLocks->liveOptimizers.fetch_sub(1);
  }

  void build(std::vector<Tensor> params) {
    std::optional<rpc::Error> failure;
    try {
      optimizer = spec.make(std::move(params));
      locks = stepLocks->locksOf(optimizer->parameters());
    } catch (...) {
      optimizer.reset();
      failure = partError(std::current_exception(), worker, "LocalOptimizer on " + worker + " (" + spec.describe() + ")");
    }
    std::vector<std::function<void()>> run;
    {
      std::lock_guard<std::mutex> lock(mutex);
      finished = true;
      error = std::move(failure);
      run.swap(waiters);
    }
    for (auto& w : run) w();
  }

  // Runs `then` now if finished, else once it is (on the thread that finishes the build).
  void whenFinished(std::function<void()> then) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (!finished) {
        waiters.push_back(std::move(then));
        return;
      }
    }
    then();
  }

  std::optional<rpc::Error> buildError() {
    std::lock_guard<std::mutex> lock(mutex);
    return error;
  }
};

namespace {

// "context 7" or "contexts 7, 8, 9": for messages.
std::string contextsText(const std::vector<uint64_t>& contextIds) {
  std::string out = contextIds.size() == 1 ? "context " : "contexts ";
  for (size_t i = 0; i < contextIds.size(); ++i) out += (i == 0 ? "" : ", ") + std::to_string(contextIds[i]);
  return out;
}

// One step of a built optimizer on the gradients of this worker summed over `contextIds` (one context: its
// gradients as they are): reads them all first (an unknown context fails the step before anything is
// updated), waits for the parameters' locks (Note [Optimizer step locks]: without holding a thread),
// updates, releases, and completes `promise` with the number of parameters that had a gradient.
void runStep(const std::shared_ptr<LocalOptimizer::State>& state, rpc::Agent& agent,
             const std::vector<uint64_t>& contextIds, const std::shared_ptr<rpc::Promise<int64_t>>& promise) {
  trace::WorkerScope traceWorker(agent.traceWorker());  // a local step runs on the caller's thread
  const std::string what = "optimizer step on " + state->worker + " for " + contextsText(contextIds);
  const std::vector<Tensor>& params = state->optimizer->parameters();
  std::vector<Tensor> grads(params.size());
  int64_t withGradient = 0;
  try {
    std::vector<autograd::distributed::Gradients> perContext;
    perContext.reserve(contextIds.size());
    for (uint64_t id : contextIds) perContext.push_back(autograd::distributed::gradientsOf(agent, id));
    // The sum is a new tensor: the contexts' own gradients stay as they were (others may still read them).
    autograd::NoGradGuard noGrad;
    for (size_t i = 0; i < params.size(); ++i) {
      for (const auto& gradients : perContext) {
        Tensor g = gradients.get(params[i]);
        if (!g.defined()) continue;
        grads[i] = grads[i].defined() ? add(grads[i], g) : g;
      }
      if (grads[i].defined()) ++withGradient;
    }
  } catch (...) {
    return promise->setError(partError(std::current_exception(), state->worker, what));
  }
  detail::acquireAll(state->locks, 0, &agent.executor(),
                     [state, grads = std::move(grads), withGradient, promise, what] {
                       std::optional<rpc::Error> failure;
                       try {
                         trace::Scope span("optim.step", trace::Category::kOptimizer, withGradient);  // docs/tracing.md
                         state->optimizer->step(grads);
                       } catch (...) {
                         failure = partError(std::current_exception(), state->worker, what);
                       }
                       detail::releaseAll(*state->locks);
                       if (failure) return promise->setError(std::move(*failure));
                       promise->setValue(withGradient);
                     });
}

// Checks a list of context ids (ValueError naming the problem): not empty, no id twice.
void checkContextIds(const std::vector<uint64_t>& contextIds, const std::string& where) {
  DG_CHECK(!contextIds.empty(), where, ": got no context ids (expected at least one)");
  for (size_t i = 0; i < contextIds.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      DG_CHECK(contextIds[i] != contextIds[j], where, ": context ", contextIds[i],
               " is listed twice (its gradients would count twice)");
    }
  }
}

// LocalOptimizer::stepContextsHere: the step once the optimizer is built.
rpc::Future<int64_t> stepWhenBuilt(const std::shared_ptr<LocalOptimizer::State>& state, rpc::Agent& agent,
                                   std::vector<uint64_t> contextIds) {
  auto promise = std::make_shared<rpc::Promise<int64_t>>(agent.executor());
  rpc::Future<int64_t> future = promise->getFuture();
  try {
    // The ids may come from the wire: checked here too.
    checkContextIds(contextIds, "optimizer step on " + state->worker);
  } catch (...) {
    promise->setError(partError(std::current_exception(), state->worker, "optimizer step on " + state->worker));
    return future;
  }
  // `agent` outlives a deferred run: the build finishes on its executor.
  state->whenFinished([state, promise, &agent, contextIds = std::move(contextIds)] {
    if (auto error = state->buildError()) return promise->setError(*error);
    runStep(state, agent, contextIds, promise);
  });
  return future;
}

}  // namespace

LocalOptimizer::LocalOptimizer(rpc::Agent& agent, OptimizerSpec spec, std::vector<rref::RRef<Tensor>> params,
                               std::vector<Tensor> tensors)
    : state_(std::make_shared<State>()) {
  // The spec came from the wire when a peer created this optimizer: validate before anything else.
  spec.validate();
  state_->worker = agent.name();
  state_->spec = std::move(spec);
  for (size_t i = 0; i < params.size(); ++i) {
    DG_CHECK(params[i].valid(), "LocalOptimizer on ", agent.name(), ": parameter RRef ", i, " is empty");
    DG_CHECK(params[i].isOwner(), "LocalOptimizer on ", agent.name(), ": parameter RRef ", i, " is owned by ",
             params[i].owner(), ", not by this worker");
  }
  state_->stepLocks = detail::StepLocks::of(agent);
  state_->stepLocks->liveOptimizers.fetch_add(1);
  if (params.empty()) {
    state_->build(std::move(tensors));
    return;
  }
  // The RRefs' values may still be in the making (e.g. the results of remote() calls queued behind this
  // one): build once all resolved. On the owner, toHere gives a handle to the value itself (a Tensor copy
  // shares its storage and autograd slot), so the optimizer updates the parameters in place.
  std::vector<rpc::Future<Tensor>> values;
  values.reserve(params.size());
  for (const auto& p : params) values.push_back(p.toHereAsync());
  rpc::whenAll(std::move(values), &agent.executor())
      .then(rpc::kInlineSafe, [state = state_, tensors = std::move(tensors)](
                                  std::vector<rpc::Result<Tensor>> resolved) mutable {
        std::vector<Tensor> all;
        all.reserve(resolved.size() + tensors.size());
        for (size_t i = 0; i < resolved.size(); ++i) {
          if (!resolved[i].ok()) {
            rpc::Error error = resolved[i].error();
            error.message = "LocalOptimizer on " + state->worker + ": parameter RRef " + std::to_string(i) +
                            " has no value: " + error.message;
            if (error.worker.empty()) error.worker = state->worker;
            std::vector<std::function<void()>> run;
            {
              std::lock_guard<std::mutex> lock(state->mutex);
              state->finished = true;
              state->error = std::move(error);
              run.swap(state->waiters);
            }
            for (auto& w : run) w();
            return;
          }
          all.push_back(std::move(resolved[i]).value());
        }
        for (auto& t : tensors) all.push_back(std::move(t));
        state->build(std::move(all));
      });
}

LocalOptimizer::~LocalOptimizer() = default;

rpc::Future<int64_t> LocalOptimizer::readyHere(rpc::Agent& agent) const {
  auto promise = std::make_shared<rpc::Promise<int64_t>>(agent.executor());
  rpc::Future<int64_t> future = promise->getFuture();
  state_->whenFinished([state = state_, promise] {
    if (auto error = state->buildError()) return promise->setError(*error);
    promise->setValue(static_cast<int64_t>(state->optimizer->parameters().size()));
  });
  return future;
}

rpc::Future<int64_t> LocalOptimizer::ready(const rpc::CallContext& ctx) const { return readyHere(*ctx.agent); }

rpc::Future<int64_t> LocalOptimizer::stepHere(rpc::Agent& agent, uint64_t contextId) {
  return stepContextsHere(agent, {contextId});
}

rpc::Future<int64_t> LocalOptimizer::stepContextsHere(rpc::Agent& agent, std::vector<uint64_t> contextIds) {
  return stepWhenBuilt(state_, agent, std::move(contextIds));
}

rpc::Future<int64_t> LocalOptimizer::stepContextsAfterBackwardHere(rpc::Agent& agent, std::vector<uint64_t> contextIds,
                                                                   const rpc::CancellationToken& cancel) {
  std::string what = "optimizer step on " + state_->worker;
  std::vector<rpc::Future<void>> parts;
  try {
    checkContextIds(contextIds, what);  // the ids may come from the wire
    what += " for " + contextsText(contextIds);
    parts.reserve(contextIds.size());
    for (uint64_t id : contextIds) parts.push_back(autograd::distributed::whenLocalPartDone(agent, id, cancel));
  } catch (...) {
    return rpc::makeErrorFuture<int64_t>(partError(std::current_exception(), state_->worker, what), agent.executor());
  }
  // Not inline: the step runs on the executor, never on the thread that finished the last backward part
  // under the autograd engine's completion.
  return rpc::whenAll(std::move(parts), &agent.executor())
      .then([state = state_, &agent, contextIds = std::move(contextIds),
             what = std::move(what)](std::vector<rpc::Result<void>> done) mutable {
        for (auto& r : done) {
          if (!r.ok()) {
            rpc::Error error = r.error();
            error.message = what + ": waiting for the backward here failed: " + error.message;
            if (error.worker.empty()) error.worker = state->worker;
            throw rpc::RpcError(std::move(error));
          }
        }
        return stepWhenBuilt(state, agent, std::move(contextIds));
      });
}

rpc::Future<int64_t> LocalOptimizer::stepContextsAfterBackward(const rpc::CallContext& ctx,
                                                               std::vector<uint64_t> contextIds) {
  return stepContextsAfterBackwardHere(*ctx.agent, std::move(contextIds), ctx.token);
}

rpc::Future<int64_t> LocalOptimizer::step(const rpc::CallContext& ctx, uint64_t contextId) {
  return stepHere(*ctx.agent, contextId);
}

rpc::Future<int64_t> LocalOptimizer::stepContexts(const rpc::CallContext& ctx, std::vector<uint64_t> contextIds) {
  return stepContextsHere(*ctx.agent, std::move(contextIds));
}

size_t LocalOptimizer::liveCount(rpc::Agent& agent) { return detail::StepLocks::of(agent)->liveOptimizers.load(); }

const rpc::Class<LocalOptimizer>& localOptimizerClass() {
  static const rpc::Class<LocalOptimizer> cls =
      rpc::Class<LocalOptimizer>("dg.optim.LocalOptimizer")
          .method("ready", &LocalOptimizer::ready)
          .method("step", &LocalOptimizer::step)
          .method("stepContexts", &LocalOptimizer::stepContexts)
          .method("stepContextsAfterBackward", &LocalOptimizer::stepContextsAfterBackward);
  return cls;
}

// ---- DistributedOptimizer ----

namespace {

// One RpcError for the failures of several parts (owner, error): the first one's kind and worker, every
// owner's message.
[[noreturn]] void throwFailures(const std::string& what, std::vector<std::pair<std::string, rpc::Error>> failures) {
  DG_ASSERT(!failures.empty(), "throwFailures without failures");
  rpc::Error error = failures.front().second;
  if (error.worker.empty()) error.worker = failures.front().first;
  if (failures.size() == 1) {
    error.message = what + ": " + error.message;
  } else {
    std::string message = what + ": " + std::to_string(failures.size()) + " owners failed";
    for (const auto& [owner, e] : failures) message += "; [" + owner + "] " + e.describe();
    error.message = std::move(message);
  }
  throw rpc::RpcError(std::move(error));
}

}  // namespace

DistributedOptimizer::DistributedOptimizer(rpc::Agent& agent, OptimizerSpec spec,
                                           std::vector<rref::RRef<Tensor>> params, std::vector<Tensor> localParams)
    : agent_(&agent), spec_(std::move(spec)) {
  spec_.validate();
  DG_CHECK(!params.empty() || !localParams.empty(), "DistributedOptimizer: got no parameters");
  // Group by owner, in first-appearance order; RRefs this worker owns join the local part.
  std::vector<std::string> order;
  std::map<std::string, std::vector<rref::RRef<Tensor>>> byOwner;
  std::vector<rref::RRef<Tensor>> ownedHere;
  for (size_t i = 0; i < params.size(); ++i) {
    DG_CHECK(params[i].valid(), "DistributedOptimizer: parameter RRef ", i, " is empty");
    if (params[i].isOwner()) {
      ownedHere.push_back(std::move(params[i]));
      continue;
    }
    const std::string& owner = params[i].owner();
    auto [it, added] = byOwner.try_emplace(owner);
    if (added) order.push_back(owner);
    it->second.push_back(std::move(params[i]));
  }
  numParameters_ = params.size() + localParams.size();
  for (size_t i = 0; i < localParams.size(); ++i) {
    DG_CHECK(localParams[i].defined(), "DistributedOptimizer: local parameter ", i, " is undefined");
  }

  auto rrefs = rref::RRefContext::of(agent);
  std::vector<rpc::Future<int64_t>> ready;
  std::vector<std::string> readyOwners;
  {
    // The creating calls must not carry a distributed autograd context active on this thread.
    rpc::AutogradContextScope noContext(0);
    for (const auto& owner : order) {
      RemotePart part{owner, rrefs->remote<LocalOptimizer>(owner, spec_, byOwner[owner])};
      ready.push_back(part.optimizer.rpcAsync(&LocalOptimizer::ready));
      readyOwners.push_back(owner);
      remote_.push_back(std::move(part));
    }
  }
  if (!ownedHere.empty() || !localParams.empty()) {
    local_ = std::make_shared<LocalOptimizer>(agent, spec_, std::move(ownedHere), std::move(localParams));
    ready.push_back(local_->readyHere(agent));
    readyOwners.push_back(agent.name());
  }
  std::vector<std::pair<std::string, rpc::Error>> failures;
  auto results = rpc::whenAll(std::move(ready), &agent.executor()).get();
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i].ok()) failures.emplace_back(readyOwners[i], results[i].error());
  }
  if (!failures.empty()) throwFailures("DistributedOptimizer: building the optimizer failed", std::move(failures));
}

DistributedOptimizer::~DistributedOptimizer() = default;

void DistributedOptimizer::install(rpc::Registry& registry) {
  registry.bindClass(localOptimizerClass())
      .factory<OptimizerSpec, std::vector<rref::RRef<Tensor>>>(
          [](const rpc::CallContext& ctx, OptimizerSpec spec, std::vector<rref::RRef<Tensor>> params) {
            return std::make_shared<LocalOptimizer>(*ctx.agent, std::move(spec), std::move(params));
          });
}

rpc::Future<void> DistributedOptimizer::stepAsync(uint64_t contextId) {
  return stepAsync(std::vector<uint64_t>{contextId});
}

rpc::Future<void> DistributedOptimizer::stepAsync(const std::vector<uint64_t>& contextIds) {
  return stepParts(contextIds, /*afterBackward=*/false);
}

rpc::Future<void> DistributedOptimizer::stepAfterBackwardAsync(const std::vector<uint64_t>& contextIds) {
  return stepParts(contextIds, /*afterBackward=*/true);
}

rpc::Future<void> DistributedOptimizer::stepParts(const std::vector<uint64_t>& contextIds, bool afterBackward) {
  checkContextIds(contextIds, afterBackward ? "DistributedOptimizer::stepAfterBackward" : "DistributedOptimizer::step");
  const bool single = contextIds.size() == 1 && !afterBackward;
  std::vector<rpc::Future<int64_t>> parts;
  std::vector<std::string> owners;
  parts.reserve(remote_.size() + 1);
  {
    // Note: the step calls must not carry the context: an owner that never joined it would join through the
    // step itself and find no gradients, instead of reporting the unknown context.
    rpc::AutogradContextScope noContext(0);
    for (const auto& part : remote_) {
      // One context keeps the original call (owners of an older build serve it).
      parts.push_back(single          ? part.optimizer.rpcAsync(&LocalOptimizer::step, contextIds.front())
                      : afterBackward ? part.optimizer.rpcAsync(&LocalOptimizer::stepContextsAfterBackward, contextIds)
                                      : part.optimizer.rpcAsync(&LocalOptimizer::stepContexts, contextIds));
      owners.push_back(part.owner);
    }
  }
  // This worker's part, meanwhile, on the calling thread.
  if (local_) {
    // The step calls are written by the transport's loop thread, which the posts above just woke. The
    // scheduler tends to queue a woken thread on the waker's CPU (wake-affine), behind this thread's update
    // (milliseconds of memory-bound work), so the owners would start only once it finished: measured in
    // bench_dist_autograd, the two halves' steps took the sum of their times instead of the larger one.
    // Yielding once lets the loop thread send first. (A pragmatic measure: any thread that posts a call and
    // then computes has the same problem; see the report on the agent.)
    if (!remote_.empty() && !afterBackward) std::this_thread::yield();
    parts.push_back(afterBackward ? local_->stepContextsAfterBackwardHere(*agent_, contextIds)
                                  : local_->stepContextsHere(*agent_, contextIds));
    owners.push_back(agent_->name());
  }
  return rpc::whenAll(std::move(parts), &agent_->executor())
      .then(rpc::kInlineSafe,
            [owners = std::move(owners), what = contextsText(contextIds)](std::vector<rpc::Result<int64_t>> results) {
              std::vector<std::pair<std::string, rpc::Error>> failures;
              for (size_t i = 0; i < results.size(); ++i) {
                if (!results[i].ok()) failures.emplace_back(owners[i], results[i].error());
              }
              if (!failures.empty()) throwFailures("DistributedOptimizer::step(" + what + ")", std::move(failures));
            });
}

void DistributedOptimizer::step(uint64_t contextId) { stepAsync(contextId).get(); }

void DistributedOptimizer::step(const std::vector<uint64_t>& contextIds) { stepAsync(contextIds).get(); }

std::vector<std::string> DistributedOptimizer::owners() const {
  std::vector<std::string> out;
  for (const auto& part : remote_) out.push_back(part.owner);
  if (local_) out.push_back(agent_->name());
  return out;
}

}  // namespace distgrad::models::optim
