#include "models/pipeline/rpc_pipeline.h"

#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <functional>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_set>
#include <utility>

#include "autograd/distributed/state.h"
#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "models/pipeline/compute_token.h"
#include "rpc/autograd_hook.h"
#include "rpc/detail/handler.h"
#include "rpc/trace.h"
#include "rref/context.h"
#include "tensor/storage.h"

namespace distgrad::models::pipeline {

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
// its activations), except under 1F1B right after a backward (Note [1F1B alternation]). The token a
// backward took is released at the end of the stage's backward (Note [Stage backward bracket]), or, when
// that never comes (a failed pass), when the pass's graph is destroyed (the context ends).
//
// Note [1F1B alternation]
// In 1F1B's steady state a stage alternates: one forward, one backward (stageOrder in
// models/pipeline/schedule.h; the local pipeline's stage threads run exactly that order). Here the next
// backward's gradient often arrives while the stage still runs the previous backward, so with blocked
// backwards first stage 0 of two ran F0 F1 B0 B1 F2 F3 B2 B3 instead of F0 F1 B0 F2 B1 F3 B2 B3: the last
// stage, waiting for F2, idled about 15 ms of a 95 ms step (a traced run with each stage pinned to its own
// core). So when a backward ends under 1F1B and a forward is queued that its end admits (the in-flight
// limit), the token is reserved for the forward runner: blocked backwards wait until the runner took it.
// The reservation is the runner's alone (one runner per stage, and only it takes queued forwards, holding
// the token: so the forward the reservation was made for is still queued when the runner comes), and it
// is dropped whenever the runner cannot use it (not admitted, as when setMaxInFlight lowered the limit
// meanwhile; its post refused; the stage gone), so a blocked backward never waits for a forward that will
// not come.
//
// Note [Stage in-flight limit]
// Under 1F1B a stage holds at most S - s micro-batches in flight (forwarded, backward not done), the
// schedule's own bound (models/pipeline/schedule.h): the driver sets it per stage (setMaxInFlight) and the
// stage enforces it itself, so the forward of micro-batch m + S - s starts right when the backward of m
// ends HERE, as stageOrder says, instead of after that backward's completion has travelled to the driver
// and a new call has come back (a round trip of idle time at every steady-state forward). The driver issues
// every call of a step at once, so each stage finds the next forward waiting when its limit lets it start.
// A forward over the limit waits in the queue without a thread; the end of a micro-batch's graph here (its
// backward, or its release after a failed step) frees the slot and wakes it. GPipe sets no limit.
//
// Note [Loss on the last stage]
// The last stage computes each micro-batch's loss itself (the driver sends the labels with the stage's
// forward call: a few bytes in a message it sends anyway, where making them travel with the activations
// would add them to every hop and every stage's interface) and starts that micro-batch's distributed
// backward there, as the pass's root (autograd::distributed::backwardAsync on a context the driver
// created): the gradient of the logits never leaves the stage, and under 1F1B the backward starts right
// after the forward, as stageOrder says, instead of after the logits' trip to the driver and the loss
// gradient's trip back (about 1 ms each way under load, four times per step, each one idling the whole
// pipeline in the steady state). Under GPipe the stage keeps the losses until every forward of the step has
// run here (fill), then drains: it starts the backwards ONE AT A TIME in micro-batch order, micro-batch
// m + 1's when m's has left this stage (its local part done, its gradients handed to the agent for the
// previous stage: BackwardOptions::localDone, Note [Local part done] in autograd/distributed/state.cpp),
// not when m's has finished on every stage, which would serialise the pipeline. That is the local
// pipeline's drain (each stage's thread runs B0, B1, ... in order): the previous stage receives the
// gradients in micro-batch order, and the last stage goes on with m + 1 while the stages before it work
// on m. Started all at once, the M backwards contended for the stage's compute token (Note [Stage compute
// token]) in thread-wake order, each waiting one holding an executor thread blocked, and the drain was not
// micro-batch ordered. Only the scaled loss and the count of correct predictions go back, in the reply to
// the forward call, sent once the backward has finished on every stage (the root's pass completes last),
// so the driver's one event per micro-batch means "this micro-batch is done". A micro-batch that fails
// here (its input's error, its forward's, its loss's, or under GPipe its backward) makes the stage give up
// its step: the losses kept for it fail at once (kCancelled, so the driver reports the real error), as do
// the step's micro-batches still to come (abandonStep, which the driver also sends on the first error it
// sees, covers failures that never reach this stage). Nothing of a failed step waits for a micro-batch
// that will not come: a held loss waits for the backward before it to leave this stage, and that backward
// either leaves or fails.

// Note [Stage output hand-off]
// A forward's output goes on through continuations: the call's reply, the owner RRef's resolution and
// the answers to the next stage's fetch of it. Posted to the executor, they waited for a worker while the
// stage's next compute (a backward blocked on the token, woken by its release) held the core: the next
// stage got its input 3 ms after the forward ended, per micro-batch (traced, each stage on its own core).
// So the runner publishes a forward's result in a ContinuationsHere scope (Note [Continuations here] in
// rpc/future.h), which runs those continuations on this thread, and releases the token only then. None of
// them takes the token or waits for the stage. A last stage's result is not published this way: its loss
// starts the micro-batch's backward, which needs the token.

// Note [Stage devices]
// A stage on a GPU (placement "workerN/cuda:i": PipelineStage::to moves its module) computes there, but
// what crosses its boundary stays on the host: the input is moved onto the device by a differentiable copy
// (autograd::toDevice, so the input's gradient goes back to the host) and the output back to the host the
// same way. Activations, gradients and predictions therefore travel between processes as CPU tensors, and
// no worker needs a device map (a reply carrying a CUDA tensor needs one: docs/cuda.md "Device maps"; the
// driver and a fetch of a stage's output send none). The last stage's loss is computed on the device (the
// labels are moved there); only its value and the correct count come back. TODO(perf): with device maps
// between the stage workers, the hand-off could stage through pinned memory instead of these pageable
// copies; measure on a GPU first (no GPU has run this code yet).

struct PipelineStage::Meter {
  std::shared_ptr<ComputeToken> token = std::make_shared<ComputeToken>();
  mutable std::mutex mutex;
  StageStats stats;                                // GUARDED_BY(mutex), peakRssMiB filled when taken
  std::vector<Clock::time_point> backwardStarted;  // GUARDED_BY(mutex): [microBatch]
  int64_t inFlight = 0;                            // GUARDED_BY(mutex): forwarded, graph not yet done
  int64_t maxInFlight = 0;                         // GUARDED_BY(mutex): forwards wait above it (0: no limit)
  int64_t queuedForwards = 0;                      // GUARDED_BY(mutex): in the stage's queue, not yet taken
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
  // Note [1F1B alternation]: under 1F1B, a queued forward may start now (called when a backward ends,
  // after its slot was freed).
  void forwardQueued(int64_t delta) {
    std::lock_guard<std::mutex> lock(mutex);
    queuedForwards += delta;
  }
  bool forwardDue() const {
    std::lock_guard<std::mutex> lock(mutex);
    return maxInFlight > 0 && queuedForwards > 0 && inFlight < maxInFlight;
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
    // A forward that threw never took a slot.
    if (counted) meter_->flightEnded(microBatch_, backwardRan, cpu);
    if (release) meter_->token->release(/*forwardNext=*/backwardRan && meter_->forwardDue());
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
// nodes. The output end is an identity op recorded after the module. The other end, when the input requires
// grad anyway (every stage but the first: the gradient goes on to the previous stage), is the post-hook of
// the input's RecvBackward, which the distributed engine runs once the gradient was handed to the agent:
// ending at an identity op before it let the stage's next compute take the token first, and on a busy core
// the thread still to send the gradient got the CPU back only after that compute's time slice (3-4 ms per
// hand-off, traced: the previous stage idled meanwhile). An input requiring grad that did not come from
// another worker (a stage called locally) ends at an identity op on it. Stage 0's input is data: making it
// require grad would only time the backward at the price of an input gradient nobody uses (its first
// conv's backward-data, measured 5-10% of stage 0's backward for ResNet-18 with a 1-channel stem), so
// there the end is the last of the stage's FIRST ops (the nodes whose only graph inputs are parameters) to
// finish: every other node of the stage leads to one of them, so they run last. Their post-hooks count down
// the Flight.
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

void LossCall::validate() const {
  DG_CHECK(labels.defined() && labels.dim() == 1 && labels.dtype() == tensor::DType::kInt64,
           "LossCall: labels must be a 1-D int64 tensor, got ",
           labels.defined() ? tensor::shapeStr(labels.shape()) + " " + dtypeName(labels.dtype()) : std::string("none"));
  DG_CHECK(std::isfinite(share) && share > 0 && share <= 1, "LossCall: share must be in (0, 1], got ", share);
  DG_CHECK(microBatches >= 1 && microBatches <= kMaxMicroBatches, "LossCall: microBatches must be in [1, ",
           kMaxMicroBatches, "], got ", microBatches);
  DG_CHECK(microBatch >= 0 && microBatch < microBatches, "LossCall: microBatch must be in [0, ", microBatches,
           "), got ", microBatch);
  DG_CHECK(step >= 0, "LossCall: step must be >= 0, got ", step);
  DG_CHECK(backwardMode <= static_cast<uint8_t>(autograd::distributed::BackwardMode::kFast),
           "LossCall: unknown backward mode ", static_cast<int>(backwardMode));
}

// One forwardLoss call, from its arrival to its reply (Note [Loss on the last stage]).
struct PipelineStage::LossJob {
  LossJob(rpc::Agent& agent, rpc::Executor& executor, LossCall call, uint64_t context)
      : agent(&agent), call(std::move(call)), context(context), promise(executor) {}
  rpc::Agent* agent;
  const LossCall call;
  const uint64_t context;  // the micro-batch's distributed autograd context (the call's)
  rpc::Promise<LossResult> promise;
  LossResult result;  // set by the forward
  Tensor root;        // the scaled loss, from the forward to the backward's start
};

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

std::shared_ptr<PipelineStage::LossJob> PipelineStage::makeLossJob(const rpc::CallContext& ctx, LossCall call) {
  call.validate();
  DG_CHECK(training_.load(), what_, ": forwardLoss in evaluation mode (train(true) first)");
  DG_CHECK(ctx.autogradContext != 0, what_,
           ": forwardLoss must be called inside a distributed autograd context (the backward runs in it)");
  return std::make_shared<LossJob>(*ctx.agent, ctx.agent->executor(), std::move(call), ctx.autogradContext);
}

rpc::Future<LossResult> PipelineStage::forwardLoss(const rpc::CallContext& ctx, rref::RRef<Tensor> previous,
                                                   LossCall call) {
  DG_CHECK(previous.valid(), what_, ": forwardLoss got an empty RRef");
  std::shared_ptr<LossJob> job = makeLossJob(ctx, std::move(call));
  recordSource(job->call.microBatch, previous.isOwner() ? worker_ : previous.owner());
  foldGradients(ctx, job->call.gradientContext);
  rpc::Future<LossResult> result = job->promise.getFuture();
  // As in forward(): the fetch joins the micro-batch's context.
  rpc::Executor* executor = &ctx.agent->executor();
  (void)previous.toHereAsync().then(
      [self = shared_from_this(), executor, job](rpc::Result<Tensor>&& fetched) {
        if (!fetched.ok()) return self->lossForwarded(job, fetched.error());
        self->enqueueJob(*executor,
                         Job{std::move(fetched).value(), job->call.microBatch, job->call.step, nullptr, job});
      });
  return result;
}

rpc::Future<LossResult> PipelineStage::forwardFirstLoss(const rpc::CallContext& ctx, Tensor input, LossCall call) {
  std::shared_ptr<LossJob> job = makeLossJob(ctx, std::move(call));
  recordSource(job->call.microBatch, ctx.caller);
  foldGradients(ctx, job->call.gradientContext);
  rpc::Future<LossResult> result = job->promise.getFuture();
  enqueueJob(ctx.agent->executor(), Job{std::move(input), job->call.microBatch, job->call.step, nullptr, job});
  return result;
}

void PipelineStage::abandonStep(int64_t step) {
  std::deque<std::shared_ptr<LossJob>> failed;
  {
    std::lock_guard<std::mutex> lock(lossMutex_);
    abandonedStep_ = std::max(abandonedStep_, step);
    if (lossStep_ == step) failed.swap(waiting_);
  }
  failHeld(failed, "the step was abandoned");
}

void PipelineStage::failHeld(const std::deque<std::shared_ptr<LossJob>>& jobs, const std::string& why) {
  for (const auto& job : jobs) {
    job->root = Tensor();  // its graph here goes: the in-flight slot is free again
    job->promise.setError(rpc::Error::cancelled(what_ + ": micro-batch " + std::to_string(job->call.microBatch) +
                                                " of step " + std::to_string(job->call.step) +
                                                " not run backward: " + why)
                              .onWorker(worker_));
  }
}

void PipelineStage::lossForwarded(const std::shared_ptr<LossJob>& job, rpc::Result<Tensor> root) {
  const int64_t step = job->call.step;
  std::shared_ptr<LossJob> start;
  std::deque<std::shared_ptr<LossJob>> failed;
  std::deque<std::shared_ptr<LossJob>> stale;
  std::optional<rpc::Error> error;
  {
    std::lock_guard<std::mutex> lock(lossMutex_);
    if (step > lossStep_) {  // the step's first micro-batch here
      lossStep_ = step;
      forwarded_ = 0;
      draining_ = false;
      stale.swap(waiting_);  // none: the driver starts a step once every call of the last one has settled
    }
    if (!root.ok()) {
      // Nothing more of this step starts here (Note [Loss on the last stage]).
      error = root.error();
      abandonedStep_ = std::max(abandonedStep_, step);
      if (step == lossStep_) failed.swap(waiting_);
    } else if (step <= abandonedStep_ || step < lossStep_) {
      error = rpc::Error::cancelled(what_ + ": micro-batch " + std::to_string(job->call.microBatch) + " of step " +
                                    std::to_string(step) + " not run backward: the step was abandoned")
                  .onWorker(worker_);
    } else {
      job->root = std::move(root).value();
      if (!job->call.fillDrain) {
        start = job;
      } else {
        waiting_.push_back(job);
        if (++forwarded_ == job->call.microBatches) {
          // The drain: one backward at a time, in micro-batch order (backwardLeft starts the next).
          std::sort(waiting_.begin(), waiting_.end(),
                    [](const auto& a, const auto& b) { return a->call.microBatch < b->call.microBatch; });
          draining_ = true;
          start = std::move(waiting_.front());
          waiting_.pop_front();
        }
      }
    }
  }
  if (error) job->promise.setError(*error);
  if (!failed.empty()) failHeld(failed, "micro-batch " + std::to_string(job->call.microBatch) + " of the step failed");
  if (!stale.empty()) failHeld(stale, "step " + std::to_string(step) + " began");
  if (start) startBackward(start);
}

void PipelineStage::startBackward(const std::shared_ptr<LossJob>& job) {
  autograd::distributed::BackwardOptions options;
  options.mode = static_cast<autograd::distributed::BackwardMode>(job->call.backwardMode);
  std::weak_ptr<PipelineStage> weak = weak_from_this();
  const bool drain = job->call.fillDrain;
  if (drain) {
    // Note [Loss on the last stage]: the next held micro-batch starts when this one's gradients have left
    // this stage. Called on the thread that ran this stage's part of the pass, outside the engine's locks.
    options.localDone = [weak, job] {
      if (auto self = weak.lock()) self->backwardLeft(*job);
    };
  }
  rpc::Future<void> done;
  try {
    done = autograd::distributed::backwardAsync(*job->agent, job->context, {job->root}, options);
  } catch (...) {
    // The context is gone here (the driver released it: its step failed elsewhere).
    job->root = Tensor();
    job->promise.setError(rpc::detail::handlerError(std::current_exception(), worker_));
    if (drain) backwardFailed(*job);
    return;
  }
  rpc::Executor* executor = &job->agent->executor();
  (void)std::move(done).then(rpc::kInlineSafe, [weak, job, drain, executor](rpc::Result<void>&& finished) {
    job->root = Tensor();
    if (finished.ok()) {
      job->promise.setValue(job->result);
      return;
    }
    job->promise.setError(finished.error());
    // This may run inside the engine's completion: the held losses (other contexts' graphs) go on the
    // executor, away from its locks. A refused post (the agent closing) leaves them to the stage's end.
    if (drain) {
      (void)executor->post([weak, job] {
        if (auto self = weak.lock()) self->backwardFailed(*job);
      });
    }
  });
}

void PipelineStage::backwardLeft(const LossJob& job) {
  std::shared_ptr<LossJob> next;
  {
    std::lock_guard<std::mutex> lock(lossMutex_);
    // Nothing held: the drain is over, or the step was given up (its held losses failed already).
    if (job.call.step != lossStep_ || !draining_ || waiting_.empty()) return;
    next = std::move(waiting_.front());
    waiting_.pop_front();
  }
  startBackward(next);
}

void PipelineStage::backwardFailed(const LossJob& job) {
  std::deque<std::shared_ptr<LossJob>> held;
  {
    std::lock_guard<std::mutex> lock(lossMutex_);
    abandonedStep_ = std::max(abandonedStep_, job.call.step);
    if (job.call.step == lossStep_) held.swap(waiting_);
  }
  failHeld(held, "the backward of micro-batch " + std::to_string(job.call.microBatch) + " of the step failed");
}

rpc::Future<Tensor> PipelineStage::enqueue(rpc::Executor& executor, Tensor input, int64_t microBatch, int64_t step) {
  auto promise = std::make_shared<rpc::Promise<Tensor>>(executor);
  rpc::Future<Tensor> future = promise->getFuture();
  enqueueJob(executor, Job{std::move(input), microBatch, step, std::move(promise), nullptr});
  return future;
}

void PipelineStage::enqueueJob(rpc::Executor& executor, Job job) {
  {
    std::lock_guard<std::mutex> lock(queueMutex_);
    executor_ = &executor;
    queue_.push_back(std::move(job));
    meter_->forwardQueued(+1);
    if (running_) return;  // the running thread takes it
    running_ = true;
  }
  runQueued();
}

void PipelineStage::runQueued() {
  while (true) {
    Job job;
    {
      std::lock_guard<std::mutex> lock(queueMutex_);
      const std::shared_ptr<ComputeToken>& token = meter_->token;
      if (queue_.empty()) {
        running_ = false;
        return;
      }
      // Waiting, this runner returns its thread (running_ stays true) and a wake-up posts it again. If the
      // agent is closing the post is refused: the queued promises break when the stage is destroyed.
      std::weak_ptr<PipelineStage> weak = weak_from_this();
      rpc::Executor* executor = executor_;
      auto resume = [weak, executor, token] {
        const bool posted = executor->post([weak, token] {
          if (auto self = weak.lock()) {
            self->runQueued();
          } else {
            token->dropReservation();
          }
        });
        if (!posted) token->dropReservation();
      };
      // Note [Stage in-flight limit], then Note [Stage compute token].
      if (training_.load() && !meter_->admitOrNotify(resume)) {
        token->dropReservation();
        return;
      }
      if (!token->tryAcquireOrNotify(resume)) return;
      job = std::move(queue_.front());
      queue_.pop_front();
      meter_->forwardQueued(-1);
    }
    rpc::Result<Tensor> result = [&]() -> rpc::Result<Tensor> {
      try {
        return runForward(job.input, job.microBatch, job.step, job.loss.get());
      } catch (...) {
        rpc::Error error = rpc::detail::handlerError(std::current_exception(), worker_);
        error.message = what_ + ", forward of micro-batch " + std::to_string(job.microBatch) + ": " + error.message;
        return error;
      }
    }();
    job.input = Tensor();
    // The runner stops before the result is published: the caller may switch modes (train(), to()) as
    // soon as its last forward answered, and must not find this runner still marked running. A job queued
    // meanwhile starts its own runner.
    bool more;
    {
      std::lock_guard<std::mutex> lock(queueMutex_);
      more = !queue_.empty();
      if (!more) running_ = false;
    }
    if (job.loss) {
      meter_->token->release();  // the loss's backward takes it (Note [Loss on the last stage])
      lossForwarded(job.loss, std::move(result));
    } else {
      // Note [Stage output hand-off]: the output leaves before the stage computes anything else.
      {
        rpc::ContinuationsHere here;
        job.promise->setResult(std::move(result));
      }
      meter_->token->release();
    }
    if (!more) return;
  }
}

Tensor PipelineStage::runForward(const Tensor& input, int64_t microBatch, int64_t step, LossJob* loss) {
  DG_ASSERT(loss == nullptr || training_.load(), "a loss job in evaluation mode");
  const Device device = device_.load();  // Note [Stage devices]
  if (!training_.load()) {
    autograd::NoGradGuard noGrad;
    return toDevice(module_->forward(toDevice(input, device)), Device::cpu());
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
    const std::shared_ptr<autograd::Node> producer = autograd::gradientEdge(input).fn;
    if (dynamic_cast<autograd::distributed::RecvBackward*>(producer.get()) != nullptr) {
      producer->addPostHook(
          [flight](const std::vector<Tensor>&, const std::vector<Tensor>&) { flight->end(/*backwardRan=*/true); });
    } else {
      x = autograd::recordOp("PipelineStageInput", {input}, input.detach(),
                             [flight](const std::vector<Tensor>& grads, const autograd::Node&) {
                               flight->end(/*backwardRan=*/true);
                               return std::vector<Tensor>{grads[0]};
                             });
    }
  }
  Tensor y = module_->forward(toDevice(x, device));
  if (!inputNeedsGrad) endAtFirstOps(y, flight);
  if (loss != nullptr) {
    // Note [Loss on the last stage]: the ops the driver used to run on the logits, the same ones
    // LocalPipeline runs, so the gradients are the same bit for bit. The backward bracket below starts at
    // the loss, so the stage's backward time covers the loss's too.
    try {
      // Labels arrive on the host; a stage on a GPU computes its loss there (item() copies back).
      const Tensor labels = loss->call.labels.to(y.device());
      Tensor scaled = mul(crossEntropy(y, labels), loss->call.share);
      autograd::NoGradGuard noGrad;
      loss->result.loss = scaled.item();
      loss->result.correct = static_cast<int64_t>(sum(eq(argmax(y, 1), labels)).item());
      y = scaled;
    } catch (const std::exception& e) {
      // Logits that do not fit the labels: the last stage's output is not a classifier's.
      throw ValueError(std::string("its loss failed: ") + e.what());
    }
  } else {
    y = toDevice(y, Device::cpu());  // for the next stage or the driver (Note [Stage devices])
  }
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

rpc::Future<StageStats> PipelineStage::takeStatsAfterBackward(const rpc::CallContext& ctx,
                                                              std::vector<uint64_t> contextIds) {
  DG_CHECK(!contextIds.empty() && static_cast<int64_t>(contextIds.size()) <= kMaxMicroBatches, what_,
           ": takeStatsAfterBackward needs 1 to ", kMaxMicroBatches, " context ids, got ", contextIds.size());
  std::vector<rpc::Future<void>> parts;
  parts.reserve(contextIds.size());
  for (uint64_t id : contextIds) parts.push_back(autograd::distributed::whenLocalPartDone(*ctx.agent, id, ctx.token));
  // Inline: a snapshot under the meter's lock, on the thread that finished the stage's last backward part.
  return rpc::whenAll(std::move(parts), &ctx.agent->executor())
      .then(rpc::kInlineSafe, [self = shared_from_this()](std::vector<rpc::Result<void>> done) {
        for (auto& r : done) {
          if (!r.ok()) throw rpc::RpcError(r.error());
        }
        return self->takeStats();
      });
}

std::vector<Tensor> PipelineStage::parameters() const { return module_->parameters(); }

std::vector<Tensor> PipelineStage::parametersOnHost() const {
  std::vector<Tensor> out;
  for (const Tensor& p : module_->parameters()) out.push_back(p.device().isCpu() ? p.cloneData() : p.to(Device::cpu()));
  return out;
}

void PipelineStage::to(Device device) {
  std::lock_guard<std::mutex> lock(queueMutex_);  // no forward starts while the module moves
  DG_CHECK(!running_ && queue_.empty(), what_, ": cannot move the stage to ", device.str(),
           " while forwards run or wait; move it before the first step");
  module_->to(device);
  device_.store(device);
}

const rpc::Class<PipelineStage>& pipelineStageClass() {
  static const rpc::Class<PipelineStage> cls =
      rref::moduleClass<PipelineStage>("dg.pipeline.PipelineStage")
          .method("forwardFirst", &PipelineStage::forwardFirst)
          .method("forwardLoss", &PipelineStage::forwardLoss)
          .method("forwardFirstLoss", &PipelineStage::forwardFirstLoss)
          .method("abandonStep", &PipelineStage::abandonStep)
          .method("train", &PipelineStage::train)
          .method("setMaxInFlight", &PipelineStage::setMaxInFlight)
          .method("setIndex", &PipelineStage::setIndex)
          .method("stats", &PipelineStage::stats)
          .method("resetStats", &PipelineStage::resetStats)
          .method("takeStats", &PipelineStage::takeStats)
          .method("takeStatsAfterBackward", &PipelineStage::takeStatsAfterBackward)
          .method("parametersOnHost", &PipelineStage::parametersOnHost);
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
  // One call per stage, answered with host copies (a GPU stage's parameters cannot come back as they are:
  // Note [Stage devices]).
  std::vector<rpc::Future<std::vector<Tensor>>> fetches;
  for (const auto& stage : stages_) fetches.push_back(stage.moduleRRef().rpcAsync(&PipelineStage::parametersOnHost));
  std::vector<Tensor> out;
  for (auto& r : rpc::whenAll(std::move(fetches), &agent_->executor()).get()) {
    for (Tensor& p : std::move(r).value()) out.push_back(std::move(p));
  }
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

// What the step loop waits for: a micro-batch is done (its loss and correct count, or its error), or the
// last stage answered abandonStep.
struct StepEvent {
  bool control = false;  // abandonStep's answer
  bool stepped = false;  // the optimizer step's answer (its error in result)
  int64_t microBatch = 0;
  rpc::Result<LossResult> result = rpc::Error::failed("no result");
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
// fetch of that micro-batch) unless they come from another worker. A cancellation (the last stage giving
// up the rest of a failed step, Note [Loss on the last stage]) gives way to the error that caused it.
void noteError(std::optional<rpc::Error>& first, const rpc::Error& error) {
  if (!first || (first->kind == rpc::ErrorKind::kCancelled && error.kind != rpc::ErrorKind::kCancelled)) {
    first = error;
  }
}

}  // namespace

struct RpcPipeline::MicroBatch {
  int64_t index = 0;
  Tensor inputs, labels;
  double share = 0;  // of the batch: the loss scale
  std::unique_ptr<autograd::distributed::DistContext> context;
};

// Note [Stage steps after its backward]
// A local pipeline's stage steps its optimizer as soon as its own last backward is done, while the stages
// upstream still run theirs. This pipeline used to step after the whole step instead: the last backward
// finished on stage 0, the answers travelled stage 0 -> last stage -> driver, the driver sent the step to
// every stage and waited for each: a round trip and every stage's update on the critical path (traced on two
// stages under GPipe: 0.86-0.93 ms a step, 0.35 ms of it stage 1's Adam, whose gradients had been final for
// 8.7 ms). Now the driver issues the step with the forwards (DistributedOptimizer::stepAfterBackwardAsync):
// each stage's part waits there, holding no thread, until the stage's part of every micro-batch's backward
// has run (autograd::distributed::whenLocalPartDone), and steps then: the last stage while stage 0 still
// runs its backwards, stage 0 right after its last one. A failed micro-batch releases its context (abandon
// below), which fails the parts still waiting: those stages update nothing, while a stage that had already
// stepped keeps its update (as in the local pipeline); step() throws either way. The stages' measurements
// come the same way (takeStatsAfterBackward, issued with the forwards, answered once the stage's part of
// every backward has run), so a stage's cpuSeconds may count some of its update in the next step's.
StepResult RpcPipeline::step(const Tensor& inputs, const Tensor& labels) {
  DG_CHECK(inputs.defined() && inputs.dim() >= 1, "RpcPipeline::step: inputs must have a batch dimension");
  DG_CHECK(labels.defined() && labels.dim() == 1 && labels.shape()[0] == inputs.shape()[0],
           "RpcPipeline::step: labels must be one per input (", inputs.shape()[0], "), got shape ",
           tensor::shapeStr(labels.shape()));
  DG_CHECK(labels.dtype() == tensor::DType::kInt64, "RpcPipeline::step: labels must be int64 class indices, got ",
           dtypeName(labels.dtype()));
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
  const bool fillDrain = options_.schedule == Schedule::kGPipe;

  // One micro-batch's calls, issued at once: each stage's call carries the previous stage's result RRef,
  // which its owner resolves when that forward finishes (promise pipelining); activations never come here.
  // The last stage's call carries the labels: it computes the loss and starts the backward there (Note
  // [Loss on the last stage]), and its reply, once the backward has finished everywhere, is the micro-batch's
  // one event here.
  auto issue = [&](MicroBatch& mb) {
    auto active = mb.context->activate();
    LossCall call;
    call.labels = mb.labels;
    call.share = mb.share;
    call.microBatch = mb.index;
    call.microBatches = count;
    call.step = stepIndex;
    call.gradientContext = gradientContext;
    call.fillDrain = fillDrain;
    call.backwardMode = static_cast<uint8_t>(mode_);
    rpc::Future<LossResult> done = [&] {
      if (numStages == 1) {
        return stages_[0].moduleRRef().rpcAsync(&PipelineStage::forwardFirstLoss, mb.inputs, std::move(call));
      }
      rref::RRef<Tensor> out = stages_[0].moduleRRef().remote(&PipelineStage::forwardFirst, mb.inputs, mb.index,
                                                               stepIndex, gradientContext);
      for (int64_t s = 1; s + 1 < numStages; ++s) {
        out = stages_[static_cast<size_t>(s)].moduleRRef().remote(&PipelineStage::forward, out, mb.index, stepIndex,
                                                                   gradientContext);
      }
      return stages_.back().moduleRRef().rpcAsync(&PipelineStage::forwardLoss, out, std::move(call));
    }();
    ++outstanding;
    (void)std::move(done).then(rpc::kInlineSafe, [events, m = mb.index](rpc::Result<LossResult>&& r) {
      StepEvent event;
      event.microBatch = m;
      event.result = std::move(r);
      events->push(std::move(event));
    });
  };

  // docs/tracing.md: from the first forward submitted to the optimizer step's end.
  trace::Scope stepSpan("pipeline.step", trace::Category::kPipeline, stepIndex, count, numStages);
  stepSpan.setDetail(scheduleName(options_.schedule));
  // Both schedules issue every call at once: the stages keep the schedule themselves (Note [Stage in-flight
  // limit], Note [Loss on the last stage]).
  for (auto& mb : batches) issue(mb);
  // One optimizer step over every micro-batch's context, issued now: each stage steps its part as soon as
  // its own part of every micro-batch's backward has run (as the local pipeline's stages do), while the
  // stages upstream still run theirs (Note [Stage steps after its backward]).
  std::vector<uint64_t> contextIds;
  for (const auto& mb : batches) contextIds.push_back(mb.context->id());
  std::vector<rpc::Future<StageStats>> statsCalls;
  ++outstanding;
  {
    rpc::AutogradContextScope noContext(0);
    (void)optimizer_->stepAfterBackwardAsync(contextIds).then(rpc::kInlineSafe, [events](rpc::Result<void>&& r) {
      StepEvent event;
      event.stepped = true;
      event.result = r.ok() ? rpc::Result<LossResult>(LossResult{}) : rpc::Result<LossResult>(r.error());
      events->push(std::move(event));
    });
    // The stages hand over their measurements the same way, as soon as their part of the step is done.
    if (collectStats_) {
      for (const auto& stage : stages_) {
        statsCalls.push_back(stage.moduleRRef().rpcAsync(&PipelineStage::takeStatsAfterBackward, contextIds));
      }
    }
  }
  // Once a step has failed, the last stage is told to start nothing more of it, and every micro-batch whose
  // own calls have all settled releases its context at once: that frees its graphs on the stages, and with
  // them the compute token and in-flight slots they may hold, which later micro-batches' forwards may be
  // waiting for (Note [Stage in-flight limit]); waiting for the others first could stall the step until the
  // calls' deadlines.
  // Releasing a context also fails the optimizer step waiting for it (its owners update nothing).
  auto abandon = [](MicroBatch& mb) { mb.context.reset(); };
  bool abandoning = false;
  while (outstanding > 0) {
    StepEvent event = events->pop();
    --outstanding;
    if (event.control) continue;  // abandonStep's answer: its outcome changes nothing here
    if (event.stepped) {
      if (!event.result.ok()) noteError(failure, event.result.error());
      continue;
    }
    MicroBatch& mb = batches[static_cast<size_t>(event.microBatch)];
    if (!event.result.ok()) {
      noteError(failure, event.result.error());
      abandon(mb);
      if (!abandoning) {
        abandoning = true;
        rpc::AutogradContextScope noContext(0);
        ++outstanding;
        (void)stages_.back()
            .moduleRRef()
            .rpcAsync(&PipelineStage::abandonStep, stepIndex)
            .then(rpc::kInlineSafe, [events](rpc::Result<void>&&) {
              StepEvent done;
              done.control = true;
              events->push(std::move(done));
            });
      }
      continue;
    }
    const LossResult& r = event.result.value();
    result.loss += r.loss;
    result.correct += r.correct;
    if (failure) abandon(mb);
  }
  stepSpan.end();
  // Ends every context (on every worker); after a failure first, which fails the stats calls still waiting.
  if (failure) batches.clear();
  std::vector<rpc::Result<StageStats>> stageResults;
  if (!statsCalls.empty()) stageResults = rpc::whenAll(std::move(statsCalls), &agent_->executor()).get();
  batches.clear();
  if (failure) throw rpc::RpcError(*failure);

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
