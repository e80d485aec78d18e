#include "autograd/distributed/dist_autograd.h"

#include <cstdio>
#include <thread>

#include "autograd/distributed/state.h"

namespace distgrad::autograd::distributed {

void install(rpc::Registry& registry) {
  registry.bind(kPropagate, [](const rpc::CallContext& call, PropagateRequest request) {
    return DistAutogradState::of(*call.agent)->onPropagate(std::move(request), call);
  });
  registry.bind(kDiscover, [](const rpc::CallContext& call, DiscoverRequest request) {
    return DistAutogradState::of(*call.agent)->onDiscover(std::move(request), call);
  });
  registry.bind(kPlan, [](const rpc::CallContext& call, const DiscoverRequest& request) {
    DistAutogradState::of(*call.agent)->onPlan(request, call);
  });
  // Note [Control in order]: run where the message is read, in order with the calls behind it.
  registry.bind(
      kControl,
      [](const rpc::CallContext& call, const ControlRequest& request) {
        DistAutogradState::of(*call.agent)->onControl(request, call.caller);
      },
      rpc::Dispatch::kInline);
  registry.setAutogradHook([](rpc::Agent& agent) -> std::shared_ptr<rpc::AutogradHook> {
    auto extension = agent.extension("dg.dist_autograd", [](rpc::Agent& a) -> std::shared_ptr<rpc::AgentExtension> {
      return std::make_shared<DistAutogradState>(a);
    });
    return std::static_pointer_cast<DistAutogradState>(extension);
  });
}

const char* backwardModeName(BackwardMode mode) {
  switch (mode) {
    case BackwardMode::kExact: return "exact";
    case BackwardMode::kFast: return "fast";
  }
  return "unknown";
}

Tensor Gradients::get(const Tensor& leaf) const {
  if (!leaf.defined()) return Tensor();
  for (const auto& [t, g] : items_) {
    if (t.implPtr() == leaf.implPtr()) return g;
  }
  return Tensor();
}

DistContext::DistContext(rpc::Agent& agent)
    : state_(DistAutogradState::of(agent)),
      id_(state_->createContext()),
      previous_(rpc::activeAutogradContext()),
      thread_(std::this_thread::get_id()) {
  rpc::setActiveAutogradContext(id_);
}

DistContext::DistContext(DistContext&& other) noexcept
    : state_(std::move(other.state_)),
      id_(std::exchange(other.id_, 0)),
      previous_(other.previous_),
      thread_(other.thread_) {}

DistContext::~DistContext() {
  try {
    end();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[distgrad] releasing distributed autograd context %llu failed: %s\n",
                 static_cast<unsigned long long>(id_), e.what());
  }
}

void DistContext::end() {
  if (!state_) return;
  // Only the creating thread's active context is ours to restore; ended elsewhere, that thread keeps the
  // released id and its calls fail clearly.
  if (std::this_thread::get_id() == thread_ && rpc::activeAutogradContext() == id_) {
    rpc::setActiveAutogradContext(previous_);
  }
  auto state = std::move(state_);
  state->releaseContext(id_, state->name(), std::nullopt, true);
}

void DistContext::backward(const std::vector<Tensor>& roots, const BackwardOptions& options,
                           const std::vector<Tensor>& grads) {
  DG_CHECK(state_ != nullptr, "DistContext::backward: the context has ended");
  DG_CHECK(rpc::Executor::current() != &state_->executor(),
           "DistContext::backward blocks: on the agent's executor (inside a handler) use backwardAsync");
  state_->backward(id_, roots, grads, options, /*drainHere=*/true).get();
}

rpc::Future<void> DistContext::backwardAsync(const std::vector<Tensor>& roots, const BackwardOptions& options,
                                             const std::vector<Tensor>& grads) {
  DG_CHECK(state_ != nullptr, "DistContext::backwardAsync: the context has ended");
  return state_->backward(id_, roots, grads, options, /*drainHere=*/false);
}

Gradients DistContext::gradients() const {
  DG_CHECK(state_ != nullptr, "DistContext::gradients: the context has ended");
  return state_->gradients(id_);
}

rpc::Future<void> backwardAsync(rpc::Agent& agent, uint64_t contextId, const std::vector<Tensor>& roots,
                                const BackwardOptions& options, const std::vector<Tensor>& grads) {
  return DistAutogradState::of(agent)->backward(contextId, roots, grads, options, /*drainHere=*/false, /*join=*/true);
}

Gradients gradientsOf(rpc::Agent& agent, uint64_t contextId) {
  return DistAutogradState::of(agent)->gradients(contextId);
}

void foldGradients(rpc::Agent& agent, uint64_t from, uint64_t into) {
  DistAutogradState::of(agent)->foldGradients(from, into);
}

rpc::Future<void> whenLocalPartDone(rpc::Agent& agent, uint64_t contextId, const rpc::CancellationToken& cancel) {
  return DistAutogradState::of(agent)->whenLocalPartDone(contextId, cancel);
}

size_t liveContexts(rpc::Agent& agent) { return DistAutogradState::of(agent)->liveContexts(); }

}  // namespace distgrad::autograd::distributed
