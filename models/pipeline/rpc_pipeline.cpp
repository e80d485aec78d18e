#include "models/pipeline/rpc_pipeline.h"

#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_set>
#include <utility>

#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "rpc/autograd_hook.h"
#include "rpc/detail/handler.h"
#include "rpc/trace.h"
#include "rref/context.h"
#include "tensor/storage.h"

namespace distgrad::models::pipeline {
namespace {
// A one-element tensor's value wherever it lives (a stage on a GPU computes its loss there).
double hostItem(const Tensor& t) { return (t.device().isCpu() ? t : t.to(Device::cpu())).item(); }
}  // namespace

namespace {

using Clock = std::chrono::steady_clock;

double secondsBetween(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double processCpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * static_cast<double>(t.tv_usec); };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// CPU time of the calling thread.
double threadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

double processPeakRssMiB() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
}

// Micro-batch indices come from the wire: bounded, so a bad one cannot make a stage allocate without limit.
constexpr int64_t kMaxMicroBatches = 1 << 16;

template <typename T>
T& slot(std::vector<T>& values, int64_t index) {
  if (static_cast<size_t>(index) >= values.size()) values.resize(static_cast<size_t>(index) + 1);
  return values[static_cast<size_t>(index)];
}

}  // namespace

// ---------------------------------------------------------------- the stage

// Note [Stage compute token]
// A stage computes one thing at a time, like a device: its forwards AND its backwards are serialised on one
// token. Without it, the distributed engine runs the backwards of several micro-batch contexts at once on
// the stage's executor threads (each context's pass drains on the thread its gradient arrived on): on a
// machine with a core per stage they would share the stage's core and all finish late, so the previous
// stage would start its backwards late too (a wider bubble), and per-micro-batch times would be
// meaningless. Forwards take the token from the forward queue's runner without blocking: when a backward
// holds it, the runner registers a wake-up and returns its thread (the wake-up posts it again). A backward
// takes it inside the engine (the identity op at the stage's output) and can only block there: the holder
// never waits for anything but the CPU (a forward job runs to its end; a backward's drain from the stage's
// output to its input is local compute, its sends are asynchronous), so the wait is bounded by one op.
// Blocked backwards go first when the token is released (they hold threads; and finishing a backward frees
// its activations). The token a backward took is released at the end of the stage's backward (Note [Stage
// backward bracket]), or, when that never comes (a failed pass), when the pass's graph is destroyed (the
// context ends).
//
// Note [Stage in-flight limit]
// Under 1F1B a stage holds at most S - s micro-batches in flight (forwarded, backward not done), the
// schedule's own bound (models/pipeline/schedule.h): the driver sets it per stage (setMaxInFlight) and the
// stage enforces it itself, so the forward of micro-batch m + S - s starts right when the backward of m
// ends HERE, as stageOrder says, instead of after that backward's completion has travelled to the driver
// and a new call has come back (a round trip of idle time at every steady-state forward). The driver only
// keeps the calls coming early enough: it issues the forward of m + S when the logits of m arrive. A forward
// over the limit waits in the queue without a thread; the end of a micro-batch's graph here (its backward,
// or its release after a failed step) frees the slot and wakes it. GPipe sets no limit.

class ComputeToken {
 public:
  // Blocks until the token is this caller's.
  void acquireBlocking() {
    std::unique_lock<std::mutex> lock(mutex_);
    ++blocked_;
    freed_.wait(lock, [&] { return !held_; });
    --blocked_;
    held_ = true;
  }
  // Takes the token if it is free and no blocked caller waits; else keeps `wake` (replacing an earlier
  // one) and calls it once the token is released with nobody blocked on it.
  bool tryAcquireOrNotify(std::function<void()> wake) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!held_ && blocked_ == 0) {
      held_ = true;
      return true;
    }
    wake_ = std::move(wake);
    return false;
  }
  void release() {
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      held_ = false;
      if (blocked_ > 0) {
        freed_.notify_one();
        return;
      }
      wake.swap(wake_);
    }
    if (wake) wake();
  }

 private:
  std::mutex mutex_;
  std::condition_variable freed_;
  bool held_ = false;           // GUARDED_BY(mutex_)
  int blocked_ = 0;             // GUARDED_BY(mutex_)
  std::function<void()> wake_;  // GUARDED_BY(mutex_)
};

struct PipelineStage::Meter {
  std::shared_ptr<ComputeToken> token = std::make_shared<ComputeToken>();
  mutable std::mutex mutex;
  StageStats stats;                                // GUARDED_BY(mutex), peakRssMiB filled when taken
  std::vector<Clock::time_point> backwardStarted;  // GUARDED_BY(mutex): [microBatch]
  int64_t inFlight = 0;                            // GUARDED_BY(mutex): forwarded, graph not yet done
  int64_t maxInFlight = 0;                         // GUARDED_BY(mutex): forwards wait above it (0: no limit)
  std::function<void()> admit;                     // GUARDED_BY(mutex): a forward waiting for a slot
  int64_t baselineBytes = -1;                      // GUARDED_BY(mutex): before the first forward since reset
  double cpuAtReset = processCpuSeconds();         // GUARDED_BY(mutex)

  // Memory is sampled where the activations kept for backward peak: after a forward, before a backward.
  void sampleLocked() {
    if (baselineBytes < 0) return;
    const auto bytes = static_cast<int64_t>(tensor::cpuBytesInUse());
    stats.peakActivationBytes = std::max(stats.peakActivationBytes, std::max<int64_t>(bytes - baselineBytes, 0));
  }
  // Note [Stage in-flight limit]: true when a training forward may start now; else keeps `wake` and calls it
  // once a micro-batch in flight is done.
  bool admitOrNotify(std::function<void()> wake) {
    std::lock_guard<std::mutex> lock(mutex);
    if (maxInFlight <= 0 || inFlight < maxInFlight) return true;
    admit = std::move(wake);
    return false;
  }
  void forwardStarting() {
    std::lock_guard<std::mutex> lock(mutex);
    if (baselineBytes < 0 && inFlight == 0) baselineBytes = static_cast<int64_t>(tensor::cpuBytesInUse());
  }
  void forwardDone(int64_t microBatch, double seconds, double cpuSeconds) {
    std::lock_guard<std::mutex> lock(mutex);
    slot(stats.forwardSeconds, microBatch) += seconds;
    stats.computeCpuSeconds += cpuSeconds;
    ++stats.forwards;
    ++inFlight;
    stats.maxInFlight = std::max(stats.maxInFlight, inFlight);
    sampleLocked();
  }
  void backwardStarting(int64_t microBatch) {
    std::lock_guard<std::mutex> lock(mutex);
    slot(backwardStarted, microBatch) = Clock::now();
    sampleLocked();
  }
  // A micro-batch's graph here is done: its backward ran (`backwardRan`), or the graph went away without one
  // (a failed step). Either frees its in-flight slot.
  void flightEnded(int64_t microBatch, bool backwardRan, double backwardCpuSeconds) {
    const auto now = Clock::now();
    std::function<void()> wake;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (backwardRan) {
        slot(stats.backwardSeconds, microBatch) += secondsBetween(slot(backwardStarted, microBatch), now);
        stats.computeCpuSeconds += backwardCpuSeconds;
        ++stats.backwards;
      }
      inFlight = std::max<int64_t>(inFlight - 1, 0);
      wake.swap(admit);
    }
    if (wake) wake();
  }
  void reset() {
    std::lock_guard<std::mutex> lock(mutex);
    resetLocked();
  }
  StageStats snapshot() const {
    std::lock_guard<std::mutex> lock(mutex);
    StageStats out = stats;
    out.cpuSeconds = processCpuSeconds() - cpuAtReset;
    return out;
  }
  StageStats take() {
    std::lock_guard<std::mutex> lock(mutex);
    StageStats out = stats;
    out.cpuSeconds = processCpuSeconds() - cpuAtReset;
    resetLocked();
    return out;
  }
  void resetLocked() {
    std::string worker = std::move(stats.worker);
    stats = StageStats{};
    stats.worker = std::move(worker);
    stats.maxInFlight = inFlight;  // the state itself stays: micro-batches may still be in flight
    backwardStarted.clear();
    baselineBytes = -1;
    cpuAtReset = processCpuSeconds();
  }
};

// One micro-batch's passage through the stage, shared by what brackets its backward (Note [Stage backward
// bracket]): the output op starts the backward (takes the compute token, Note [Stage compute token]), the
// end releases the token and frees the in-flight slot. When the graph goes away without its backward having
// ended (a failed step: the context released, the output dropped), the destructor does what the end would
// have: a failed step never leaves the token held or the slot taken.
class PipelineStage::Flight {
 public:
  Flight(std::shared_ptr<Meter> meter, int64_t stage, int64_t microBatch, int64_t step)
      : meter_(std::move(meter)), stage_(stage), microBatch_(microBatch), step_(step) {}
  ~Flight() { end(false); }
  Flight(const Flight&) = delete;
  Flight& operator=(const Flight&) = delete;

  // The forward finished: from now on the micro-batch occupies an in-flight slot here.
  void forwardDone(double seconds, double cpuSeconds) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      counted_ = true;
    }
    meter_->forwardDone(microBatch_, seconds, cpuSeconds);
  }
  void backwardStarts() {
    meter_->token->acquireBlocking();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      holdsToken_ = true;
      // The stage's backward drains on this thread from here to its end (no node of it waits for another
      // worker), so this thread's CPU clock times its compute.
      backwardThread_ = std::this_thread::get_id();
      backwardCpuStart_ = threadCpuSeconds();
      if (trace::enabled()) traceBeginNs_ = trace::nowNs();
    }
    meter_->backwardStarting(microBatch_);
  }
  // The backward ends when `count` more nodes have run (the stage's first ops, when its input needs no
  // gradient: Note [Stage backward bracket]).
  void endAfter(int64_t count) {
    std::lock_guard<std::mutex> lock(mutex_);
    pendingEnds_ = count;
  }
  void oneEnded() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pendingEnds_ > 0) return;
    }
    end(/*backwardRan=*/true);
  }
  void end(bool backwardRan) {
    bool release = false;
    bool counted = false;
    int64_t traceBeginNs = 0;
    std::thread::id traceThread;
    double cpu = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (ended_) return;
      ended_ = true;
      release = std::exchange(holdsToken_, false);
      counted = counted_;
      traceBeginNs = traceBeginNs_;
      traceThread = backwardThread_;
      if (backwardRan && backwardThread_ == std::this_thread::get_id()) cpu = threadCpuSeconds() - backwardCpuStart_;
    }
    if (backwardRan && traceBeginNs != 0 && trace::enabled()) traceBackward(traceBeginNs, traceThread);
    if (release) meter_->token->release();
    // A forward that threw never took a slot.
    if (counted) meter_->flightEnded(microBatch_, backwardRan, cpu);
  }

 private:
  // docs/tracing.md, "Pipeline events": the same bracket as the stage's backward timing. The stage's nodes
  // run in one drain of the pass, on one thread; should its two ends ever see different threads, the span
  // would not nest on either, so it is recorded as an async event instead.
  void traceBackward(int64_t beginNs, std::thread::id beganOn) const {
    const std::initializer_list<int64_t> args{stage_, microBatch_, step_};
    if (beganOn == std::this_thread::get_id()) {
      trace::recordSpan("pipeline.backward", trace::Category::kPipeline, beginNs, trace::nowNs(), args, 0,
                        trace::FlowPhase::kNone, "rpc");
    } else {
      trace::recordAsync("pipeline.backward", trace::Category::kPipeline, beginNs, trace::nowNs(), args, 0, "rpc");
    }
  }

  std::shared_ptr<Meter> meter_;
  const int64_t stage_;
  const int64_t microBatch_;
  const int64_t step_;
  std::mutex mutex_;
  bool counted_ = false;            // GUARDED_BY(mutex_): the forward finished (the slot is taken)
  int64_t pendingEnds_ = 0;         // GUARDED_BY(mutex_): see endAfter
  std::thread::id backwardThread_;  // GUARDED_BY(mutex_): where the backward started
  double backwardCpuStart_ = 0;     // GUARDED_BY(mutex_)
  int64_t traceBeginNs_ = 0;        // GUARDED_BY(mutex_): when the backward started, if traced
  bool holdsToken_ = false;         // GUARDED_BY(mutex_)
  bool ended_ = false;              // GUARDED_BY(mutex_)
};

// Note [Stage backward bracket]
// A stage's backward of one micro-batch runs from the gradient's arrival at its output to the last of its
// nodes. The output end is an identity op recorded after the module. The other end is an identity op on the
// input when the input requires grad anyway (every stage but the first: the gradient goes on to the
// previous stage). Stage 0's input is data: making it require grad would only time the backward at the
// price of an input gradient nobody uses (its first conv's backward-data, measured 5-10% of stage 0's
// backward for ResNet-18 with a 1-channel stem), so there the end is the last of the stage's FIRST ops
// (the nodes whose only graph inputs are parameters) to finish: every other node of the stage leads to
// one of them, so they run last. Their post-hooks count down the Flight.
void PipelineStage::endAtFirstOps(const Tensor& y, const std::shared_ptr<Flight>& flight) {
  std::vector<std::shared_ptr<autograd::Node>> first;
  std::vector<std::shared_ptr<autograd::Node>> stack{autograd::gradientEdge(y).fn};
  std::unordered_set<autograd::Node*> seen;
  auto isLeaf = [](const std::shared_ptr<autograd::Node>& node) {
    return dynamic_cast<autograd::AccumulateGrad*>(node.get()) != nullptr;
  };
  while (!stack.empty()) {
    std::shared_ptr<autograd::Node> node = std::move(stack.back());
    stack.pop_back();
    if (!node || isLeaf(node) || !seen.insert(node.get()).second) continue;
    bool onlyParameters = true;
    for (const autograd::Edge& edge : node->nextEdges()) {
      if (!edge.valid() || isLeaf(edge.fn)) continue;
      onlyParameters = false;
      stack.push_back(edge.fn);
    }
    if (onlyParameters) first.push_back(std::move(node));
  }
  flight->endAfter(static_cast<int64_t>(first.size()));
  // The hooks hold the Flight: the graph going away without a backward ends it (its destructor).
  for (const auto& node : first) {
    node->addPostHook([flight](const std::vector<Tensor>&, const std::vector<Tensor>&) { flight->oneEnded(); });
  }
}

namespace {

std::string stageWhat(const std::string& worker, const StageSpec& spec) {
  return "pipeline stage on " + worker + " (" + spec.describe() + ")";
}

}  // namespace

PipelineStage::PipelineStage(std::string worker, StageSpec spec)
    : worker_(std::move(worker)), spec_(std::move(spec)), what_(stageWhat(worker_, spec_)) {
  spec_.validate();  // it came from the wire
  module_ = buildStage(spec_);
  module_->train(true);
  meter_ = std::make_shared<Meter>();
  meter_->stats.worker = worker_;
}

PipelineStage::~PipelineStage() = default;

void PipelineStage::recordSource(int64_t microBatch, const std::string& from) {
  DG_CHECK(microBatch >= 0 && microBatch < kMaxMicroBatches, what_, ": micro-batch index must be in [0, ",
           kMaxMicroBatches, "), got ", microBatch);
  if (!training_.load()) return;
  std::lock_guard<std::mutex> lock(meter_->mutex);
  slot(meter_->stats.inputFrom, microBatch) = from;
}

// Note [Stage gradient folding]
// Each micro-batch has its own distributed autograd context, and the optimizer steps once on the sum of
// their gradients. Left alone, each context would keep its own gradients of this stage's parameters until
// that step: M copies of them. Instead every micro-batch's context folds its gradients here into the
// step's first context (autograd::distributed::foldGradients; the driver names it in every forward call), so
// the stage holds one copy whatever M, and the optimizer's sum over the contexts is unchanged. The fold is
// made before the micro-batch's forward, so its backward adds straight into the shared gradients.
void PipelineStage::foldGradients(const rpc::CallContext& ctx, uint64_t gradientContext) {
  if (gradientContext == 0 || ctx.autogradContext == 0 || ctx.autogradContext == gradientContext) return;
  if (!training_.load()) return;
  autograd::distributed::foldGradients(*ctx.agent, ctx.autogradContext, gradientContext);
}

rpc::Future<Tensor> PipelineStage::forwardFirst(const rpc::CallContext& ctx, Tensor input, int64_t microBatch,
                                                int64_t step, uint64_t gradientContext) {
  recordSource(microBatch, ctx.caller);
  foldGradients(ctx, gradientContext);
  return enqueue(ctx.agent->executor(), std::move(input), microBatch, step);
}

void PipelineStage::setIndex(int64_t index) {
  DG_CHECK(index >= 0, what_, ": the stage index must be >= 0, got ", index);
  index_.store(index, std::memory_order_relaxed);
}

rpc::Future<Tensor> PipelineStage::forward(const rpc::CallContext& ctx, rref::RRef<Tensor> previous,
                                           int64_t microBatch, int64_t step, uint64_t gradientContext) {
  DG_CHECK(previous.valid(), what_, ": forward got an empty RRef");
  recordSource(microBatch, previous.isOwner() ? worker_ : previous.owner());
  foldGradients(ctx, gradientContext);
  // The fetch joins the micro-batch's context, so the previous stage records where the gradient goes and
  // the received input hangs from a RecvBackward here. On the owner this is the local value itself, no
  // message.
  rpc::Future<Tensor> value = previous.toHereAsync();
  rpc::Executor* executor = &ctx.agent->executor();
  return std::move(value).then(
      [self = shared_from_this(), executor, microBatch, step](rpc::Result<Tensor>&& fetched) -> rpc::Future<Tensor> {
        // A failed input is the previous stage's error (it names that worker): passed on as it is.
        if (!fetched.ok()) return rpc::makeErrorFuture<Tensor>(fetched.error(), *executor);
        return self->enqueue(*executor, std::move(fetched).value(), microBatch, step);
      });
}

rpc::Future<Tensor> PipelineStage::enqueue(rpc::Executor& executor, Tensor input, int64_t microBatch, int64_t step) {
  auto promise = std::make_shared<rpc::Promise<Tensor>>(executor);
  rpc::Future<Tensor> future = promise->getFuture();
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    executor_ = &executor;
    queue_.push_back(Job{std::move(input), microBatch, step, std::move(promise)});
    if (running_) return future;  // the running thread takes it
    running_ = true;
  }
  runQueued();
  return future;
}

void PipelineStage::runQueued() {
  while (true) {
    Job job;
    {
      std::lock_guard<std::mutex> lock(queueMutex_);
      if (queue_.empty()) {
        running_ = false;
        return;
      }
      // Waiting, this runner returns its thread (running_ stays true) and a wake-up posts it again. If the
      // agent is closing the post is refused: the queued promises break when the stage is destroyed.
      std::weak_ptr<PipelineStage> weak = weak_from_this();
      rpc::Executor* executor = executor_;
      auto resume = [weak, executor] {
        (void)executor->post([weak] {
          if (auto self = weak.lock()) self->runQueued();
        });
      };
      // Note [Stage in-flight limit], then Note [Stage compute token].
      if (training_.load() && !meter_->admitOrNotify(resume)) return;
      if (!meter_->token->tryAcquireOrNotify(resume)) return;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    rpc::Result<Tensor> result = [&]() -> rpc::Result<Tensor> {
      try {
        return runForward(job.input, job.microBatch, job.step);
      } catch (...) {
        rpc::Error error = rpc::detail::handlerError(std::current_exception(), worker_);
        error.message = what_ + ", forward of micro-batch " + std::to_string(job.microBatch) + ": " + error.message;
        return error;
      }
    }();
    meter_->token->release();
    job.promise->setResult(std::move(result));
  }
}

Tensor PipelineStage::runForward(const Tensor& input, int64_t microBatch, int64_t step) {
  if (!training_.load()) {
    autograd::NoGradGuard noGrad;
    return module_->forward(input);
  }
  meter_->forwardStarting();
  const auto start = Clock::now();
  const int64_t index = index_.load(std::memory_order_relaxed);
  trace::Scope span("pipeline.forward", trace::Category::kPipeline, index, microBatch, step);  // docs/tracing.md
  span.setDetail("rpc");
  const double cpuStart = threadCpuSeconds();
  // The backward is bracketed (Note [Stage backward bracket]): an identity op at the output starts it (and
  // takes the compute token), the end of the stage's last backward node ends it. The Flight, shared by
  // them, also ends when the graph goes without a backward.
  auto flight = std::make_shared<Flight>(meter_, index, microBatch, step);
  const bool inputNeedsGrad = autograd::anyRequiresGrad({input});
  Tensor x = input;
  if (inputNeedsGrad) {
    x = autograd::recordOp("PipelineStageInput", {input}, input.detach(),
                           [flight](const std::vector<Tensor>& grads, const autograd::Node&) {
                             flight->end(/*backwardRan=*/true);
                             return std::vector<Tensor>{grads[0]};
                           });
  }
  Tensor y = module_->forward(x);
  if (!inputNeedsGrad) endAtFirstOps(y, flight);
  Tensor out = autograd::recordOp("PipelineStageOutput", {y}, y.detach(),
                                  [flight](const std::vector<Tensor>& grads, const autograd::Node&) {
                                    flight->backwardStarts();
                                    return std::vector<Tensor>{grads[0]};
                                  });
  flight->forwardDone(secondsBetween(start, Clock::now()), threadCpuSeconds() - cpuStart);
  span.end();
  return out;
}

void PipelineStage::setMaxInFlight(int64_t limit) {
  DG_CHECK(limit >= 0, what_, ": the in-flight limit must be >= 0 (0: none), got ", limit);
  std::function<void()> wake;
  {
    std::lock_guard<std::mutex> lock(meter_->mutex);
    meter_->maxInFlight = limit;
    wake.swap(meter_->admit);  // a waiting forward re-checks against the new limit
  }
  if (wake) wake();
}

void PipelineStage::train(bool enabled) {
  std::lock_guard<std::mutex> lock(queueMutex_);
  DG_CHECK(!running_ && queue_.empty(), what_, ": train(", enabled ? "true" : "false",
           ") while forwards run; switch modes between steps");
  training_.store(enabled);
  module_->train(enabled);
}

StageStats PipelineStage::stats() const {
  StageStats out = meter_->snapshot();
  out.peakRssMiB = processPeakRssMiB();
  return out;
}

void PipelineStage::resetStats() { meter_->reset(); }

StageStats PipelineStage::takeStats() {
  StageStats out = meter_->take();
  out.peakRssMiB = processPeakRssMiB();
  return out;
}

std::vector<Tensor> PipelineStage::parameters() const { return module_->parameters(); }

const rpc::Class<PipelineStage>& pipelineStageClass() {
  static const rpc::Class<PipelineStage> cls = rref::moduleClass<PipelineStage>("dg.pipeline.PipelineStage")
                                                   .method("forwardFirst", &PipelineStage::forwardFirst)
                                                   .method("train", &PipelineStage::train)
                                                   .method("setMaxInFlight", &PipelineStage::setMaxInFlight)
                                                   .method("setIndex", &PipelineStage::setIndex)
                                                   .method("stats", &PipelineStage::stats)
                                                   .method("resetStats", &PipelineStage::resetStats)
                                                   .method("takeStats", &PipelineStage::takeStats);
  return cls;
}

void installPipeline(rpc::Registry& registry) {
  rref::bindRemoteModule(registry, pipelineStageClass())
      .factory<StageSpec>([](const rpc::CallContext& ctx, StageSpec spec) {
        return std::make_shared<PipelineStage>(ctx.callee, std::move(spec));
      });
}

// ---------------------------------------------------------------- the driver

namespace {

// Where each micro-batch starts (microBatchSizes, the split both pipelines share), and n at the end.
std::vector<int64_t> microBatchBounds(int64_t n, int64_t microBatches) {
  std::vector<int64_t> bounds{0};
  for (int64_t size : microBatchSizes(n, microBatches)) bounds.push_back(bounds.back() + size);
  return bounds;
}

}  // namespace

RpcPipeline::RpcPipeline(rpc::Agent& agent, std::vector<RemoteStage> stages, PipelineOptions options,
                         autograd::distributed::BackwardMode mode)
    : agent_(&agent), options_(std::move(options)), mode_(mode), specs_(std::move(stages)) {
  DG_CHECK(!specs_.empty(), "RpcPipeline: got no stages");
  options_.validate();
  for (size_t s = 0; s < specs_.size(); ++s) {
    specs_[s].spec.validate();
    (void)rref::ModulePlacement::parse(specs_[s].placement);
    if (s == 0) continue;
    const StageSpec& a = specs_[s - 1].spec;
    const StageSpec& b = specs_[s].spec;
    DG_CHECK(b.model.describe() == a.model.describe() && b.model.seed == a.model.seed && b.firstUnit == a.endUnit,
             "RpcPipeline: stage ", s, " (", b.describe(), ") does not continue stage ", s - 1, " (", a.describe(),
             "): stages must be consecutive unit ranges of one model");
  }
  auto rrefs = rref::RRefContext::of(agent);
  // Nothing here belongs to a distributed autograd context the caller may have active.
  rpc::AutogradContextScope noContext(0);
  for (const RemoteStage& stage : specs_) {
    stages_.push_back(rref::RemoteModule<PipelineStage>::create(rrefs, stage.placement, stage.spec));
  }
  std::vector<rpc::Future<std::vector<rref::RRef<Tensor>>>> pending;
  for (const auto& stage : stages_) pending.push_back(stage.remoteParametersAsync());
  std::vector<rref::RRef<Tensor>> params;
  std::optional<rpc::Error> failure;
  for (auto& result : rpc::whenAll(std::move(pending), &agent.executor()).get()) {
    if (!result.ok()) {
      if (!failure) failure = result.error();
      continue;
    }
    for (auto& p : result.value()) params.push_back(std::move(p));
  }
  if (failure) {
    failure->message = "RpcPipeline: building a stage failed: " + failure->message;
    throw rpc::RpcError(*failure);
  }
  parameters_ = params;
  optimizer_ = std::make_unique<optim::DistributedOptimizer>(agent, options_.optimizer, std::move(params));
  // Note [Stage in-flight limit]: 1F1B's bound, enforced by each stage.
  std::vector<rpc::Future<void>> limits;
  const auto numStages = static_cast<int64_t>(stages_.size());
  for (int64_t s = 0; s < numStages; ++s) {
    const int64_t limit = options_.schedule == Schedule::k1F1B ? numStages - s : 0;
    limits.push_back(stages_[static_cast<size_t>(s)].moduleRRef().rpcAsync(&PipelineStage::setMaxInFlight, limit));
    limits.push_back(stages_[static_cast<size_t>(s)].moduleRRef().rpcAsync(&PipelineStage::setIndex, s));
  }
  for (auto& r : rpc::whenAll(std::move(limits), &agent.executor()).get()) r.value();
}

RpcPipeline::~RpcPipeline() = default;

std::vector<std::string> RpcPipeline::workers() const {
  std::vector<std::string> out;
  for (const auto& stage : stages_) out.push_back(stage.owner());
  return out;
}

std::vector<Tensor> RpcPipeline::fetchParameters() const {
  rpc::AutogradContextScope noContext(0);
  std::vector<rpc::Future<Tensor>> fetches;
  for (const auto& p : parameters_) fetches.push_back(p.toHereAsync());
  std::vector<Tensor> out;
  for (auto& r : rpc::whenAll(std::move(fetches), &agent_->executor()).get()) out.push_back(std::move(r).value());
  return out;
}

std::string RpcPipeline::describe() const {
  std::ostringstream out;
  out << "rpc pipeline, " << stages_.size() << " stage" << (stages_.size() == 1 ? "" : "s") << " on ";
  for (size_t s = 0; s < stages_.size(); ++s) out << (s ? ", " : "") << stages_[s].owner();
  out << ", " << scheduleName(options_.schedule) << ", " << options_.microBatches << " micro-batch"
      << (options_.microBatches == 1 ? "" : "es");
  return out.str();
}

namespace {

// What the step loop waits for: a micro-batch's logits arrived (or failed), or its backward finished.
struct StepEvent {
  bool logits = false;
  int64_t microBatch = 0;
  std::optional<rpc::Error> error;
  Tensor value;
};

class EventQueue {
 public:
  void push(StepEvent event) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      events_.push_back(std::move(event));
    }
    ready_.notify_one();
  }
  StepEvent pop() {
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait(lock, [&] { return !events_.empty(); });
    StepEvent event = std::move(events_.front());
    events_.pop_front();
    return event;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<StepEvent> events_;  // GUARDED_BY(mutex_)
};

// The first error of a step; later ones are consequences (a stage's failure fails every later stage's
// fetch of that micro-batch) unless they come from another worker.
void noteError(std::optional<rpc::Error>& first, const rpc::Error& error) {
  if (!first) first = error;
}

}  // namespace

struct RpcPipeline::MicroBatch {
  int64_t index = 0;
  Tensor inputs, labels;
  double share = 0;  // of the batch: the loss scale
  std::unique_ptr<autograd::distributed::DistContext> context;
  Tensor logits;
};

StepResult RpcPipeline::step(const Tensor& inputs, const Tensor& labels) {
  DG_CHECK(inputs.defined() && inputs.dim() >= 1, "RpcPipeline::step: inputs must have a batch dimension");
  DG_CHECK(labels.defined() && labels.dim() == 1 && labels.shape()[0] == inputs.shape()[0],
           "RpcPipeline::step: labels must be one per input (", inputs.shape()[0], "), got shape ",
           tensor::shapeStr(labels.shape()));
  DG_CHECK(!agent_->executor().isCurrentThread(),
           "RpcPipeline::step blocks: never call it on the agent's executor (inside a handler)");
  const auto start = Clock::now();
  const int64_t stepIndex = steps_++;
  // This thread records for the driver's worker while it steps (docs/tracing.md: pipeline.step is in the
  // driver's file even when several agents share the process).
  trace::WorkerScope traceWorker(agent_->traceWorker());
  const int64_t n = inputs.shape()[0];
  const std::vector<int64_t> bounds = microBatchBounds(n, options_.microBatches);
  const auto count = static_cast<int64_t>(bounds.size()) - 1;
  const auto numStages = static_cast<int64_t>(stages_.size());

  std::vector<MicroBatch> batches(static_cast<size_t>(count));
  {
    // Contexts that stay inactive on this thread except while their micro-batch's calls are made.
    rpc::AutogradContextScope restore(rpc::activeAutogradContext());
    for (int64_t m = 0; m < count; ++m) {
      MicroBatch& mb = batches[static_cast<size_t>(m)];
      mb.index = m;
      const int64_t size = bounds[m + 1] - bounds[m];
      mb.inputs = count == 1 ? inputs : narrow(inputs, 0, bounds[m], size);
      mb.labels = count == 1 ? labels : narrow(labels, 0, bounds[m], size);
      mb.share = static_cast<double>(size) / static_cast<double>(n);
      mb.context = std::make_unique<autograd::distributed::DistContext>(*agent_);
    }
  }

  // Every stage folds each micro-batch's gradients into the first micro-batch's context (Note [Stage
  // gradient folding]).
  const uint64_t gradientContext = batches.empty() ? 0 : batches.front().context->id();
  auto events = std::make_shared<EventQueue>();
  int64_t outstanding = 0;
  std::optional<rpc::Error> failure;
  StepResult result;
  result.samples = n;
  result.microBatches = count;

  auto issueForward = [&](MicroBatch& mb) {
    auto active = mb.context->activate();
    // The chain is issued at once: each stage's call carries the previous stage's result RRef, which its
    // owner resolves when that forward finishes (promise pipelining); activations never come here.
    rref::RRef<Tensor> out =
        stages_[0].moduleRRef().remote(&PipelineStage::forwardFirst, mb.inputs, mb.index, stepIndex, gradientContext);
    for (int64_t s = 1; s < numStages; ++s) {
      out = stages_[static_cast<size_t>(s)].moduleRRef().remote(&PipelineStage::forward, out, mb.index, stepIndex,
                                                                 gradientContext);
    }
    ++outstanding;
    (void)out.toHereAsync().then(rpc::kInlineSafe, [events, m = mb.index](rpc::Result<Tensor>&& logits) {
      StepEvent event;
      event.logits = true;
      event.microBatch = m;
      if (logits.ok()) {
        event.value = std::move(logits).value();
      } else {
        event.error = logits.error();
      }
      events->push(std::move(event));
    });
  };
  autograd::distributed::BackwardOptions backwardOptions;
  backwardOptions.mode = mode_;
  // Starts micro-batch mb's backward; false (the step's failure noted) when its loss cannot be computed.
  auto startBackward = [&](MicroBatch& mb) -> bool {
    Tensor loss;
    try {
      loss = mul(crossEntropy(mb.logits, mb.labels), mb.share);
      autograd::NoGradGuard noGrad;
      result.loss += hostItem(loss);
      result.correct += static_cast<int64_t>(hostItem(sum(eq(argmax(mb.logits, 1), mb.labels))));
    } catch (const std::exception& e) {
      // Logits that do not fit the labels: the last stage's output is not a classifier's.
      noteError(failure, rpc::Error::failed(std::string("RpcPipeline: the loss of micro-batch ") +
                                            std::to_string(mb.index) + " failed: " + e.what())
                             .onWorker(agent_->name()));
      return false;
    }
    ++outstanding;
    (void)mb.context->backwardAsync({loss}, backwardOptions)
        .then(rpc::kInlineSafe, [events, m = mb.index](rpc::Result<void>&& done) {
          StepEvent event;
          event.microBatch = m;
          if (!done.ok()) event.error = done.error();
          events->push(std::move(event));
        });
    return true;
  };

  // docs/tracing.md: from the first forward submitted to the optimizer step's end.
  trace::Scope stepSpan("pipeline.step", trace::Category::kPipeline, stepIndex, count, numStages);
  stepSpan.setDetail(scheduleName(options_.schedule));
  const bool oneFOneB = options_.schedule == Schedule::k1F1B;
  int64_t nextForward = 0;
  const int64_t firstWave = oneFOneB ? std::min(count, numStages) : count;
  for (; nextForward < firstWave; ++nextForward) issueForward(batches[static_cast<size_t>(nextForward)]);
  int64_t logitsIn = 0;
  // Once a step has failed, nothing new starts, and every micro-batch whose own calls have all settled
  // releases its context at once: that frees its graphs on the stages, and with them the compute token and
  // in-flight slots they may hold, which later micro-batches' forwards may be waiting for (Note [Stage
  // in-flight limit]); waiting for the others first could stall the step until the calls' deadlines.
  auto abandon = [](MicroBatch& mb) { mb.context.reset(); };
  while (outstanding > 0) {
    StepEvent event = events->pop();
    --outstanding;
    MicroBatch& mb = batches[static_cast<size_t>(event.microBatch)];
    if (event.error) {
      noteError(failure, *event.error);
      abandon(mb);
      continue;
    }
    if (!event.logits) continue;  // a backward finished: the optimizer step waits for all of them
    mb.logits = std::move(event.value);
    ++logitsIn;
    if (failure) {
      abandon(mb);
      continue;
    }
    if (oneFOneB) {
      // The next micro-batch's calls go out now, so each stage finds them there when its in-flight limit
      // lets it start (Note [Stage in-flight limit]); then this one's backward.
      if (nextForward < count) issueForward(batches[static_cast<size_t>(nextForward++)]);
      if (!startBackward(mb)) abandon(mb);
    } else if (logitsIn == count) {
      for (auto& b : batches) {
        if (failure || !startBackward(b)) abandon(b);
      }
    }
  }
  if (failure) {
    batches.clear();  // ends every context (on every worker)
    throw rpc::RpcError(*failure);
  }

  // One optimizer step over every micro-batch's context; meanwhile the stages hand over their measurements.
  std::vector<uint64_t> contextIds;
  for (const auto& mb : batches) contextIds.push_back(mb.context->id());
  std::vector<rpc::Future<StageStats>> statsCalls;
  rpc::Result<void> stepped;
  {
    rpc::AutogradContextScope noContext(0);
    rpc::Future<void> stepping = optimizer_->stepAsync(contextIds);
    if (collectStats_) {
      for (const auto& stage : stages_) statsCalls.push_back(stage.moduleRRef().rpcAsync(&PipelineStage::takeStats));
    }
    stepped = stepping.result();
  }
  stepSpan.end();
  std::vector<rpc::Result<StageStats>> stageResults;
  if (!statsCalls.empty()) stageResults = rpc::whenAll(std::move(statsCalls), &agent_->executor()).get();
  batches.clear();
  stepped.value();  // throws the optimizer's error (naming the owners)

  result.stats.wallSeconds = secondsBetween(start, Clock::now());
  result.stats.steps = 1;
  if (!collectStats_) return result;
  lastStageStats_.clear();
  StageTimes times;
  for (int64_t s = 0; s < numStages; ++s) {
    auto& r = stageResults[static_cast<size_t>(s)];
    if (!r.ok()) throw rpc::RpcError(r.error());
    StageStats st = std::move(r).value();
    st.forwardSeconds.resize(static_cast<size_t>(count), 0.0);
    st.backwardSeconds.resize(static_cast<size_t>(count), 0.0);
    double busy = 0;
    for (int64_t m = 0; m < count; ++m) busy += st.forwardSeconds[m] + st.backwardSeconds[m];
    result.stats.busySeconds.push_back(busy);
    result.stats.maxInFlight.push_back(st.maxInFlight);
    result.stats.peakActivationBytes.push_back(st.peakActivationBytes);
    times.forward.push_back(st.forwardSeconds);
    times.backward.push_back(st.backwardSeconds);
    lastStageStats_.push_back(std::move(st));
  }
  result.stats.idealSeconds = idealMakespan(options_.schedule, times);
  return result;
}

std::vector<StageStats> RpcPipeline::stageStats() {
  rpc::AutogradContextScope noContext(0);
  std::vector<rpc::Future<StageStats>> calls;
  for (const auto& stage : stages_) calls.push_back(stage.moduleRRef().rpcAsync(&PipelineStage::stats));
  std::vector<StageStats> out;
  std::optional<rpc::Error> failure;
  for (auto& r : rpc::whenAll(std::move(calls), &agent_->executor()).get()) {
    if (!r.ok()) {
      noteError(failure, r.error());
      continue;
    }
    out.push_back(std::move(r).value());
  }
  if (failure) throw rpc::RpcError(*failure);
  return out;
}

Tensor RpcPipeline::predict(const Tensor& inputs) {
  DG_CHECK(inputs.defined() && inputs.dim() >= 1, "RpcPipeline::predict: inputs must have a batch dimension");
  DG_CHECK(!agent_->executor().isCurrentThread(),
           "RpcPipeline::predict blocks: never call it on the agent's executor (inside a handler)");
  rpc::AutogradContextScope noContext(0);
  auto setTraining = [&](bool enabled) {
    std::vector<rpc::Future<void>> calls;
    for (const auto& stage : stages_) calls.push_back(stage.moduleRRef().rpcAsync(&PipelineStage::train, enabled));
    std::optional<rpc::Error> failure;
    for (auto& r : rpc::whenAll(std::move(calls), &agent_->executor()).get()) {
      if (!r.ok()) noteError(failure, r.error());
    }
    return failure;
  };
  if (auto error = setTraining(false)) {
    (void)setTraining(true);
    throw rpc::RpcError(*error);
  }
  // Big micro-batches, one per stage, so the stages still overlap.
  const std::vector<int64_t> bounds = microBatchBounds(inputs.shape()[0], numStages());
  std::vector<rpc::Future<Tensor>> chunks;
  for (size_t m = 0; m + 1 < bounds.size(); ++m) {
    Tensor x = bounds.size() == 2 ? inputs : narrow(inputs, 0, bounds[m], bounds[m + 1] - bounds[m]);
    rref::RRef<Tensor> out =
        stages_[0].moduleRRef().remote(&PipelineStage::forwardFirst, x, static_cast<int64_t>(m), int64_t{-1}, uint64_t{0});
    for (size_t s = 1; s < stages_.size(); ++s) {
      out = stages_[s].moduleRRef().remote(&PipelineStage::forward, out, static_cast<int64_t>(m), int64_t{-1},
                                           uint64_t{0});
    }
    chunks.push_back(out.toHereAsync());
  }
  std::vector<Tensor> logits;
  std::optional<rpc::Error> failure;
  for (auto& r : rpc::whenAll(std::move(chunks), &agent_->executor()).get()) {
    if (!r.ok()) {
      noteError(failure, r.error());
      continue;
    }
    logits.push_back(std::move(r).value());
  }
  if (auto error = setTraining(true)) noteError(failure, *error);
  // What the stages measured (their CPU time above all) belongs to training steps, not to this.
  std::vector<rpc::Future<void>> resets;
  for (const auto& stage : stages_) resets.push_back(stage.moduleRRef().rpcAsync(&PipelineStage::resetStats));
  for (auto& r : rpc::whenAll(std::move(resets), &agent_->executor()).get()) {
    if (!r.ok()) noteError(failure, r.error());
  }
  if (failure) throw rpc::RpcError(*failure);
  return logits.size() == 1 ? logits.front() : cat(logits, 0);
}

}  // namespace distgrad::models::pipeline
