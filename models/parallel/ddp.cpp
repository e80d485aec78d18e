// DistributedDataParallel: gradient buckets filled by parameter hooks, all-reduced (mean) in bucket order
// as they fill, and written back after backward.
#include "models/parallel/ddp.h"

#include <mutex>
#include <optional>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "rpc/autograd_hook.h"

namespace distgrad::models {

namespace detail {

struct DdpState {
  struct Bucket {
    std::vector<size_t> params;
    Tensor buffer;  // flat, the bucket's gradients back to back
    size_t pending = 0;
    rpc::Future<void> future;
  };

  rpc::collectives::ProcessGroup* group = nullptr;
  DdpOptions options;
  std::vector<Tensor> params;
  std::vector<Bucket> buckets;
  std::vector<size_t> bucketOf;
  std::vector<int64_t> offsetOf;  // element offset of a parameter in its bucket

  std::mutex mutex;
  bool armed = false;              // GUARDED_BY(mutex): a backward's gradients are being collected
  std::vector<bool> ready;         // GUARDED_BY(mutex)
  std::vector<Tensor> previous;    // GUARDED_BY(mutex): the gradients before this backward
  size_t nextLaunch = 0;           // GUARDED_BY(mutex)
  size_t launchedDuringBackward = 0;

  // noSync() (Note [No-sync accumulation]).
  int noSyncDepth = 0;             // GUARDED_BY(mutex): open NoSyncGuards
  bool windowOpen = false;         // GUARDED_BY(mutex): gradients accumulated locally since windowBase
  uint64_t windowContext = 0;      // GUARDED_BY(mutex): the distributed autograd context they live in (0: .grad)
  std::vector<Tensor> windowBase;  // GUARDED_BY(mutex): the gradients when the window opened
  std::vector<Tensor> carry;       // GUARDED_BY(mutex): this rank's accumulated gradients, added to the bucket

  Tensor slice(size_t i) const {
    const Bucket& b = buckets[bucketOf[i]];
    const Tensor& p = params[i];
    return Tensor::fromStorage(b.buffer.storage(), p.shape(), tensor::contiguousStrides(p.shape()), offsetOf[i],
                               b.buffer.dtype());
  }

  // The gradients the parameters hold now: in the active distributed autograd context if there is one,
  // else in .grad. (Accumulation is out of place in both, so the tensors stay as they are now.)
  std::vector<Tensor> currentGradients(uint64_t context) const {
    std::optional<autograd::distributed::Gradients> inContext;
    if (context != 0) inContext = autograd::distributed::gradientsOf(group->agent(), context);
    std::vector<Tensor> out(params.size());
    for (size_t i = 0; i < params.size(); ++i) out[i] = inContext ? inContext->get(params[i]) : params[i].grad();
    return out;
  }

  // Note [No-sync accumulation]: inside noSync() the hooks do nothing, so backward accumulates the local
  // gradients as usual (into .grad, or into the context). The first such pass opens a window and keeps the
  // gradients from before it (windowBase). The next synchronised pass all-reduces, per parameter, this
  // pass's gradient plus what accumulated since the window opened (carry = current - windowBase), and
  // writes windowBase + mean: exactly PyTorch's no_sync, whose reducer all-reduces the accumulated .grad.
  // The window must stay in one place: a distributed autograd context keeps its gradients (several passes
  // accumulate in it), but a new context starts empty, so a window opened in one context (or in .grad)
  // cannot be synchronised in another.
  void openWindowLocked() {
    if (windowOpen) return;
    windowOpen = true;
    windowContext = rpc::activeAutogradContext();
    windowBase = currentGradients(windowContext);
  }

  // Notes the gradients the parameters hold now as the base synchronize() adds the mean to (or, after a
  // noSync() window, the window's base and what accumulated since).
  void armLocked() {
    armed = true;
    nextLaunch = 0;
    std::fill(ready.begin(), ready.end(), false);
    for (auto& b : buckets) b.pending = b.params.size();
    const uint64_t context = rpc::activeAutogradContext();
    std::vector<Tensor> now = currentGradients(context);
    if (!windowOpen) {
      previous = std::move(now);
      std::fill(carry.begin(), carry.end(), Tensor());
      return;
    }
    if (context != windowContext) {
      windowOpen = false;  // the accumulated gradients are out of reach: drop the window, report it
      armed = false;
      throw ValueError(::distgrad::detail::concatMessage("DistributedDataParallel: gradients accumulated under noSync() ",
               windowContext == 0 ? std::string("in .grad") : "in distributed autograd context " + std::to_string(windowContext),
               " cannot be synchronised ",
               context == 0 ? std::string("outside a distributed autograd context")
                            : "in distributed autograd context " + std::to_string(context),
               ": run the noSync() passes and the synchronised pass in the same context"));
    }
    autograd::NoGradGuard noGrad;
    for (size_t i = 0; i < params.size(); ++i) {
      previous[i] = windowBase[i];
      if (!now[i].defined()) {
        carry[i] = Tensor();
      } else {
        carry[i] = windowBase[i].defined() ? distgrad::sub(now[i], windowBase[i]).detach() : now[i];
      }
    }
  }

  void launchReadyLocked() {
    while (nextLaunch < buckets.size() && buckets[nextLaunch].pending == 0) {
      Bucket& b = buckets[nextLaunch++];
      rpc::collectives::AllReduceOptions options;
      options.op = rpc::collectives::ReduceOp::kMean;
      options.compression = this->options.compression;
      b.future = group->allReduce(b.buffer, options);
    }
  }

  void onGradient(size_t i, const Tensor& grad) {
    std::lock_guard<std::mutex> lock(mutex);
    if (noSyncDepth > 0) {
      openWindowLocked();  // before this pass accumulates anything (hooks run before accumulation)
      return;
    }
    // A backward without forward() through the wrapper: .grad holds the base (hooks run before
    // accumulation, and this is the first hook of the pass).
    if (!armed) armLocked();
    DG_CHECK(!ready[i], "DistributedDataParallel: parameter #", i, " received a second gradient before ",
             "synchronize() (call backward() once per forward, or synchronize() in between)");
    DG_CHECK(grad.shape() == params[i].shape() && grad.dtype() == params[i].dtype(),
             "DistributedDataParallel: gradient of parameter #", i, " has shape ", tensor::shapeStr(grad.shape()));
    Tensor target = slice(i);
    if (carry[i].defined()) {
      autograd::NoGradGuard noGrad;
      target.copyFrom(distgrad::add(grad, carry[i]).detach());
    } else {
      target.copyFrom(grad);
    }
    ready[i] = true;
    --buckets[bucketOf[i]].pending;
    launchReadyLocked();
  }
};

}  // namespace detail

DistributedDataParallel::DistributedDataParallel(Module& module, rpc::collectives::ProcessGroup& group,
                                                 DdpOptions options)
    : module_(&module), state_(std::make_shared<detail::DdpState>()) {
  DG_CHECK(options.bucketBytes > 0, "DistributedDataParallel: bucketBytes must be > 0");
  auto& s = *state_;
  s.group = &group;
  s.options = options;
  s.params = module.parameters();
  DG_CHECK(!s.params.empty(), "DistributedDataParallel: module ", module.typeName(), " has no parameters");
  const DType dtype = s.params[0].dtype();
  for (const Tensor& p : s.params) {
    DG_CHECK(p.dtype() == dtype && (dtype == DType::kFloat32 || dtype == DType::kFloat64),
             "DistributedDataParallel: parameters must all be float32 or all float64, got ",
             tensor::dtypeName(p.dtype()), " beside ", tensor::dtypeName(dtype));
    DG_CHECK(p.isContiguous() && p.device().isCpu(), "DistributedDataParallel: parameters must be contiguous CPU tensors");
  }
  DG_CHECK(options.compression == rpc::collectives::WireCompression::kNone || dtype == DType::kFloat32,
           "DistributedDataParallel: compression needs float32 parameters");
  if (options.broadcastParameters) {
    std::vector<rpc::Future<void>> futures;
    for (const Tensor& p : s.params) futures.push_back(group.broadcast(p.detach(), 0));
    for (const Tensor& b : module.buffers()) {
      if (b.defined() && b.numel() > 0) futures.push_back(group.broadcast(b.detach(), 0));
    }
    for (auto& f : futures) f.get();
  }
  // Buckets in reverse parameter order: the last layers' gradients come first in backward.
  s.bucketOf.resize(s.params.size());
  s.offsetOf.resize(s.params.size());
  const size_t item = tensor::itemSize(dtype);
  std::vector<int64_t> elements;
  for (size_t k = s.params.size(); k-- > 0;) {
    const size_t bytes = static_cast<size_t>(s.params[k].numel()) * item;
    if (s.buckets.empty() || (elements.back() > 0 && static_cast<size_t>(elements.back()) * item + bytes > options.bucketBytes)) {
      s.buckets.emplace_back();
      elements.push_back(0);
    }
    s.bucketOf[k] = s.buckets.size() - 1;
    s.offsetOf[k] = elements.back();
    s.buckets.back().params.push_back(k);
    elements.back() += s.params[k].numel();
  }
  for (size_t b = 0; b < s.buckets.size(); ++b) s.buckets[b].buffer = Tensor::zeros({elements[b]}, dtype);
  s.ready.assign(s.params.size(), false);
  s.previous.resize(s.params.size());
  s.carry.resize(s.params.size());
  for (size_t i = 0; i < s.params.size(); ++i) {
    s.params[i].registerHook([weak = std::weak_ptr<detail::DdpState>(state_), i](const Tensor& grad) {
      if (auto state = weak.lock()) state->onGradient(i, grad);
      return Tensor();  // the local gradient accumulates as usual; synchronize() replaces it with the mean
    });
  }
}

DistributedDataParallel::~DistributedDataParallel() = default;

Tensor DistributedDataParallel::forward(const Tensor& input) {
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    DG_CHECK(!state_->armed || state_->nextLaunch == 0,
             "DistributedDataParallel::forward: the previous backward's gradients were not synchronized yet");
    if (state_->noSyncDepth > 0) {
      state_->armed = false;
      state_->openWindowLocked();
    } else {
      state_->armLocked();
    }
  }
  if (state_->options.broadcastBuffers) {
    std::vector<rpc::Future<void>> futures;
    for (const Tensor& b : module_->buffers()) {
      if (b.defined() && b.numel() > 0) futures.push_back(state_->group->broadcast(b.detach(), 0));
    }
    for (auto& f : futures) f.get();
  }
  return module_->forward(input);
}

void DistributedDataParallel::backward(const Tensor& loss) {
  autograd::backward(std::vector<Tensor>{loss});
  if (!syncDisabled()) synchronize();
}

void DistributedDataParallel::backward(autograd::distributed::DistContext& ctx, const Tensor& loss) {
  ctx.backward(loss);
  if (!syncDisabled()) synchronize(ctx);
}

bool DistributedDataParallel::syncDisabled() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->noSyncDepth > 0;
}

DistributedDataParallel::NoSyncGuard DistributedDataParallel::noSync() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  DG_CHECK(!state_->armed || state_->nextLaunch == 0,
           "DistributedDataParallel::noSync: a backward's gradients are being synchronized; call synchronize() first");
  ++state_->noSyncDepth;
  return NoSyncGuard(state_);
}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(std::shared_ptr<detail::DdpState> state) : state_(std::move(state)) {}

DistributedDataParallel::NoSyncGuard::NoSyncGuard(NoSyncGuard&& other) noexcept = default;

DistributedDataParallel::NoSyncGuard::~NoSyncGuard() {
  if (!state_) return;
  std::lock_guard<std::mutex> lock(state_->mutex);
  --state_->noSyncDepth;
}

void DistributedDataParallel::finish(const std::function<void(size_t, const Tensor&)>& write) {
  auto& s = *state_;
  std::vector<rpc::Future<void>> futures;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    DG_CHECK(s.noSyncDepth == 0, "DistributedDataParallel::synchronize: called inside noSync() (the gradients are ",
             "synchronised by the first backward after the NoSyncGuard is gone)");
    // No gradient at all here this pass: this rank still takes part, with zeros (or what noSync() accumulated).
    if (!s.armed) s.armLocked();
    s.launchedDuringBackward = s.nextLaunch;
    for (size_t i = 0; i < s.params.size(); ++i) {
      if (!s.ready[i]) {
        if (s.carry[i].defined()) {
          s.slice(i).copyFrom(s.carry[i]);
        } else {
          s.slice(i).fill(0.0);
        }
        s.ready[i] = true;
        --s.buckets[s.bucketOf[i]].pending;
      }
    }
    s.launchReadyLocked();
    for (auto& b : s.buckets) futures.push_back(std::move(b.future));
    s.armed = false;
    s.windowOpen = false;
    s.windowBase.clear();
    std::fill(s.carry.begin(), s.carry.end(), Tensor());
  }
  for (auto& f : futures) f.get();
  autograd::NoGradGuard noGrad;
  for (size_t i = 0; i < s.params.size(); ++i) {
    Tensor mean = s.slice(i);
    Tensor value = s.previous[i].defined() ? distgrad::add(s.previous[i], mean).detach() : mean.cloneData();
    write(i, value);
    s.previous[i] = Tensor();
  }
}

void DistributedDataParallel::synchronize() {
  finish([this](size_t i, const Tensor& value) { state_->params[i].setGrad(value); });
}

void DistributedDataParallel::synchronize(autograd::distributed::DistContext& ctx) {
  const autograd::distributed::Gradients gradients = ctx.gradients();
  finish([&](size_t i, const Tensor& value) {
    Tensor slot = gradients.get(state_->params[i]);
    DG_CHECK(slot.defined(), "DistributedDataParallel: parameter #", i, " of ", module_->typeName(),
             " received no gradient in distributed autograd context ", ctx.id(),
             " on this rank; inside distributed autograd every parameter must take part in the loss");
    slot.copyFrom(value);
  });
}

std::vector<std::vector<size_t>> DistributedDataParallel::buckets() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : state_->buckets) out.push_back(b.params);
  return out;
}

size_t DistributedDataParallel::bucketsLaunchedDuringBackward() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->launchedDuringBackward;
}

}  // namespace distgrad::models
