// RpcPipeline: a model split into stages that live on other workers, trained with micro-batches under a
// GPipe or 1F1B schedule (ARCHITECTURE §8, issue 6). The driver (any worker: it holds the data) never
// touches an activation: for each micro-batch it sends the input to stage 0 and chains `remote()` calls
// stage to stage, each passing on the RRef of the previous stage's output, so every stage fetches its input
// straight from the stage before it (promise pipelining at the owner: the calls are all issued at once,
// without waiting). The last stage's call carries the micro-batch's labels: that stage computes the loss
// right after its forward and starts the micro-batch's backward itself (Note [Loss on the last stage] in
// the .cpp); only the loss and the count of correct predictions come back to the driver, once the
// micro-batch's backward has finished on every stage.
//
//   rpc::Registry reg;
//   rref::RRefContext::install(reg);
//   autograd::distributed::install(reg);
//   optim::DistributedOptimizer::install(reg);
//   pipeline::installPipeline(reg);                 // every worker, before Agent::start
//   auto agent = rpc::Agent::start(options, reg);
//   ... on the driver:
//   std::vector<RemoteStage> stages;
//   for (int s = 0; s < 2; ++s) stages.push_back({"worker" + std::to_string(s + 1), specs[s]});
//   RpcPipeline pipe(*agent, stages, {.microBatches = 4, .schedule = Schedule::k1F1B, .optimizer = spec});
//   StepResult r = pipe.step(images, labels);       // r.stats: compute / bubble / overhead of the step
//
// One step: one distributed autograd context PER MICRO-BATCH (created by the driver; each micro-batch's
// backward runs in its own context, independently of the others), the loss of micro-batch m scaled by its
// share of the batch, the backwards ordered by the schedule (GPipe: once the last stage has run every
// forward of the step, it starts them one at a time in micro-batch order, each when the previous one's
// gradients have left it, as the local pipeline drains; 1F1B: right after each forward, and stage s holds
// at most S - s micro-batches in flight, a bound the stage enforces itself so its next forward starts right
// after a backward, without a round trip to the driver: Note [Stage in-flight limit] in the .cpp), and ONE
// DistributedOptimizer step over all the micro-batch contexts (each owner sums its parameters' gradients
// over them: the step of the whole batch), which each stage takes as soon as its own part of every
// backward has run (Note [Stage steps after its backward]), then the contexts end. A stage never holds
// more than one copy of its parameters' gradients: each micro-batch's context folds its gradients there
// into the first one's (Note [Stage gradient folding]), which leaves the sum the optimizer takes unchanged.
//
// PipelineStage is the object each stage worker holds (a RemoteModule<PipelineStage>): the stage's module
// (buildStage), its forwards serialised (BatchNorm statistics; a forward waiting for its turn holds no
// thread) and its measurements: forward and backward compute seconds per micro-batch (the backward timed by
// identity ops recorded at the stage's input and output), micro-batches in flight, peak activation bytes.
//
// Tracing (docs/tracing.md, "Pipeline events"): step() records pipeline.step on the driver (in the driver
// agent's file); each stage records pipeline.forward and pipeline.backward per micro-batch (detail "rpc") in
// its worker's file, the backward bracketed like its timing. Steps are numbered from 0 per RpcPipeline.
//
// Errors of any stage (a bad shape, a dead worker, a timeout) make step() throw an RpcError naming the
// worker, after every call of the step has settled (nothing is left running, every context is released).
// Every call has the agent's default deadline (rpc::Options::defaultTimeout, 60 s unless configured),
// counted from when the driver issues it: the driver issues every call of a step at once, and the last
// stage's call is answered when its micro-batch's backward has finished, so a step longer than the deadline
// fails with a timeout; raise the deadline for very long steps.
//
// Thread-safety: an RpcPipeline is driven by one thread at a time (step/predict block: never call them on
// an agent's executor thread). PipelineStage's methods are called by the agent on executor threads and are
// safe concurrently (forwards queue, stats are locked).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "models/nn/module.h"
#include "models/optim/distributed_optimizer.h"
#include "models/pipeline/partition.h"
#include "models/pipeline/pipeline.h"
#include "models/pipeline/schedule.h"
#include "rpc/agent.h"
#include "rpc/class.h"
#include "rpc/future.h"
#include "rpc/registry.h"
#include "rref/remote_module.h"
#include "rref/rref.h"
#include "tensor/tensor.h"

namespace distgrad::models::pipeline {

// What one stage measured since its last reset (one training step, when the driver takes them per step).
// Micro-batch indices are the step's: forwardSeconds[m] is micro-batch m's forward (0 when it did not run
// here). A value (travels to the driver).
struct StageStats {
  std::string worker;                   // where the stage runs
  std::vector<double> forwardSeconds;   // [microBatch]: the module's forward (training mode only)
  std::vector<double> backwardSeconds;  // [microBatch]: from the gradient's arrival at the stage's output
                                        // to its departure from the stage's input
  std::vector<std::string> inputFrom;   // [microBatch]: the worker the stage's input came from (the driver
                                        // for stage 0, the previous stage's owner otherwise)
  int64_t forwards = 0;
  int64_t backwards = 0;
  int64_t maxInFlight = 0;  // most micro-batches forwarded and not yet backwarded at once
  // Peak of this process's tensor bytes (tensor::cpuBytesInUse) above the level before the step's first
  // forward, sampled at every forward's end and every backward's start: the activations the stage keeps.
  // Process-wide, so stages sharing a process share it. -1 when nothing was sampled.
  int64_t peakActivationBytes = -1;
  double peakRssMiB = 0;  // of the stage's process (ru_maxrss)
  // CPU seconds (user + system) the stage's whole process used since the last reset: its compute plus all
  // else it ran (messages, serialisation, the optimizer step, other stages of the process).
  double cpuSeconds = 0;
  // CPU seconds of the threads while they ran this stage's forwards and backwards (what forwardSeconds and
  // backwardSeconds time in wall-clock, which on a loaded machine includes waiting for a core).
  // cpuSeconds - computeCpuSeconds is what everything but the compute cost in CPU (the RPC machinery, the
  // optimizer step): a figure the machine's load hardly moves.
  double computeCpuSeconds = 0;

  template <class V>
  void visitFields(V& v) {
    v("worker", worker);
    v("forwardSeconds", forwardSeconds);
    v("backwardSeconds", backwardSeconds);
    v("inputFrom", inputFrom);
    v("forwards", forwards);
    v("backwards", backwards);
    v("maxInFlight", maxInFlight);
    v("peakActivationBytes", peakActivationBytes);
    v("peakRssMiB", peakRssMiB);
    v("cpuSeconds", cpuSeconds);
    v("computeCpuSeconds", computeCpuSeconds);
  }
};

// What the last stage needs to compute a micro-batch's loss and start its backward (Note [Loss on the last
// stage] in the .cpp). A value: the driver sends it with the last stage's forward call.
struct LossCall {
  Tensor labels;                // int64 [micro-batch size]: the targets of the cross-entropy
  double share = 1;             // the micro-batch's share of the batch, in (0, 1]: its loss is scaled by it
  int64_t microBatch = 0;       // in [0, microBatches)
  int64_t microBatches = 1;     // of the step
  int64_t step = 0;             // the driver's step number
  uint64_t gradientContext = 0;  // Note [Stage gradient folding]
  // GPipe (fill-drain): the backwards start once every forward of the step has run here; else (1F1B) each
  // starts right after its forward.
  bool fillDrain = false;
  uint8_t backwardMode = 0;  // autograd::distributed::BackwardMode

  // ValueError naming the field (the call came from the wire).
  void validate() const;
  template <class V>
  void visitFields(V& v) {
    v("labels", labels);
    v("share", share);
    v("microBatch", microBatch);
    v("microBatches", microBatches);
    v("step", step);
    v("gradientContext", gradientContext);
    v("fillDrain", fillDrain);
    v("backwardMode", backwardMode);
  }
};

// What the last stage reports of one micro-batch once its backward has finished everywhere.
struct LossResult {
  double loss = 0;      // the micro-batch's mean cross-entropy times its share of the batch
  int64_t correct = 0;  // its samples whose logits' argmax was the label
  template <class V>
  void visitFields(V& v) {
    v("loss", loss);
    v("correct", correct);
  }
};

// One pipeline stage on its worker. Created by the driver through RemoteModule<PipelineStage>::create with a
// StageSpec (installPipeline binds the constructor); the methods below are what the driver calls.
class PipelineStage : public std::enable_shared_from_this<PipelineStage> {
 public:
  PipelineStage(std::string worker, StageSpec spec);
  ~PipelineStage();
  PipelineStage(const PipelineStage&) = delete;
  PipelineStage& operator=(const PipelineStage&) = delete;

  // Stage 0: the module on `input` (sent by the driver). Queued behind this stage's running forward.
  // `step` is the driver's step number (trace events; -1 outside training). `gradientContext`: the
  // distributed autograd context this stage's gradients of the call's context fold into (the step's first
  // micro-batch's, Note [Stage gradient folding] in the .cpp; 0: none, as in predict).
  rpc::Future<Tensor> forwardFirst(const rpc::CallContext& ctx, Tensor input, int64_t microBatch, int64_t step,
                                   uint64_t gradientContext);
  // Later stages: the module on the value of `previous` (the previous stage's output): its local value when
  // this worker owns it, else fetched from its owner by this call, inside the call's distributed autograd
  // context, so the gradient flows back there directly. Completes with this stage's output, which the
  // caller keeps here as an RRef (remote()) for the next stage or the driver to fetch. `step` and
  // `gradientContext` as for forwardFirst.
  rpc::Future<Tensor> forward(const rpc::CallContext& ctx, rref::RRef<Tensor> previous, int64_t microBatch,
                              int64_t step, uint64_t gradientContext);
  // The last stage's training forward (Note [Loss on the last stage]): forward() on `previous`, then the
  // cross-entropy against call.labels, scaled by call.share, and the micro-batch's distributed backward
  // started HERE from that loss, in the call's context (right away, or under GPipe once every forward of the
  // step has run here and the previous micro-batch's backward has left this stage). Completes when that
  // backward has finished on every stage, with the loss and the count of correct predictions; fails with
  // the forward's, the loss's or the backward's error.
  rpc::Future<LossResult> forwardLoss(const rpc::CallContext& ctx, rref::RRef<Tensor> previous, LossCall call);
  // The same for a pipeline of one stage: the input comes from the driver.
  rpc::Future<LossResult> forwardFirstLoss(const rpc::CallContext& ctx, Tensor input, LossCall call);
  // The driver gave up step `step` (one of its micro-batches failed): the micro-batches of that step whose
  // backward has not started here (GPipe's held ones) fail now, and those still to come fail on arrival,
  // so no call of the failed step waits for a micro-batch that will never come.
  void abandonStep(int64_t step);
  // The stage's index in its pipeline (a0 of its trace events); set by the driver before the first step.
  void setIndex(int64_t index);
  // At most `limit` micro-batches in flight here (forwarded, backward not done; 0: no limit): a training
  // forward waits (holding no thread) until a backward frees a slot (Note [Stage in-flight limit]).
  void setMaxInFlight(int64_t limit);
  // Training (autograd, measurements) or evaluation (no autograd, BatchNorm running statistics). Throws
  // ValueError while a forward runs or waits (switch between steps).
  void train(bool enabled);
  StageStats stats() const;
  void resetStats();
  // stats() then resetStats(), atomically.
  StageStats takeStats();
  // takeStats() once this stage's part of a backward pass of every context in `contextIds` has run here
  // (autograd::distributed::whenLocalPartDone): what the driver sends with each step's forwards. Fails
  // when a context is released first (a failed step) or the call is cancelled.
  rpc::Future<StageStats> takeStatsAfterBackward(const rpc::CallContext& ctx, std::vector<uint64_t> contextIds);
  // The module's parameters (RemoteModule::remoteParameters hands out RRefs to them).
  std::vector<Tensor> parameters() const;
  // Copies of the parameters on the host (what RpcPipeline::fetchParameters collects, whatever the device).
  std::vector<Tensor> parametersOnHost() const;
  // Moves the module to `device`: RemoteModule's placement "workerN/cuda:i" calls it once the stage exists,
  // before any forward (a ValueError while a forward runs or waits). Note [Stage devices] in the .cpp.
  void to(Device device);
  const StageSpec& spec() const { return spec_; }
  const std::shared_ptr<Module>& module() const { return module_; }

 private:
  struct Meter;  // the measurements and the stage's compute state, shared with the backward closures
  class Flight;  // one micro-batch's graph here, from its forward to the end of its backward
  struct LossJob;  // a forwardLoss call: its labels, the loss root and correct count, its result's promise
  struct Job {
    Tensor input;
    int64_t microBatch = 0;
    int64_t step = 0;
    std::shared_ptr<rpc::Promise<Tensor>> promise;  // forwardFirst / forward (null for a loss job)
    std::shared_ptr<LossJob> loss;                  // forwardLoss / forwardFirstLoss
  };
  // Queues a forward; runs it (and any queued behind it) on this thread when none runs.
  rpc::Future<Tensor> enqueue(rpc::Executor& executor, Tensor input, int64_t microBatch, int64_t step);
  void enqueueJob(rpc::Executor& executor, Job job);
  void runQueued();
  // The module on `input`; with `loss`, also the scaled cross-entropy, which it returns (the backward's
  // root) after setting loss->correct.
  Tensor runForward(const Tensor& input, int64_t microBatch, int64_t step, LossJob* loss);
  std::shared_ptr<LossJob> makeLossJob(const rpc::CallContext& ctx, LossCall call);
  // A loss job's forward ended (`root` the scaled loss, or the error): start its backward, keep it for the
  // step's drain (GPipe), or fail it (Note [Loss on the last stage]).
  void lossForwarded(const std::shared_ptr<LossJob>& job, rpc::Result<Tensor> root);
  // Starts `job`'s distributed backward from its loss. Under GPipe the step's next held micro-batch starts
  // when this one's part here is done (backwardLeft), and the step's held ones fail if it fails
  // (backwardFailed).
  void startBackward(const std::shared_ptr<LossJob>& job);
  // GPipe: `job`'s backward has left this stage (its gradients are on their way upstream): the step's next
  // held micro-batch, in micro-batch order, starts its backward now.
  void backwardLeft(const LossJob& job);
  // GPipe: `job`'s backward failed or could not start: the step is given up here, its held losses fail.
  void backwardFailed(const LossJob& job);
  // Fails loss jobs whose backward never started (kCancelled): "... not run backward: <why>".
  void failHeld(const std::deque<std::shared_ptr<LossJob>>& jobs, const std::string& why);
  // Ends `flight` when the backward has run the first ops of the graph of `y` (Note [Stage backward bracket]).
  static void endAtFirstOps(const Tensor& y, const std::shared_ptr<Flight>& flight);
  void recordSource(int64_t microBatch, const std::string& from);
  void foldGradients(const rpc::CallContext& ctx, uint64_t gradientContext);

  const std::string worker_;
  const StageSpec spec_;
  const std::string what_;  // "pipeline stage on worker1 (resnet18 ... units 0-4)": for messages
  std::shared_ptr<Module> module_;
  std::shared_ptr<Meter> meter_;

  std::mutex queueMutex_;
  rpc::Executor* executor_ = nullptr;  // GUARDED_BY(queueMutex_): the agent's, where a runner resumes
  bool running_ = false;               // GUARDED_BY(queueMutex_): a forward runs (on the thread that runs the queue)
  std::deque<Job> queue_;              // GUARDED_BY(queueMutex_)
  std::atomic<bool> training_{true};

  // Note [Loss on the last stage]: the step whose micro-batches arrive here now, how many of them have been
  // forwarded, the ones whose backward has not started yet (GPipe: held for the drain), whether the drain
  // has begun, and the latest step the driver abandoned (or one of whose micro-batches failed here).
  std::mutex lossMutex_;
  int64_t lossStep_ = -1;                          // GUARDED_BY(lossMutex_)
  int64_t forwarded_ = 0;                          // GUARDED_BY(lossMutex_): of lossStep_
  std::deque<std::shared_ptr<LossJob>> waiting_;  // GUARDED_BY(lossMutex_): of lossStep_; once draining,
                                                   // in micro-batch order, the next to start first
  bool draining_ = false;                          // GUARDED_BY(lossMutex_): every forward of lossStep_ ran
  int64_t abandonedStep_ = -1;                     // GUARDED_BY(lossMutex_)
  std::atomic<int64_t> index_{-1};  // setIndex
  std::atomic<Device> device_{Device::cpu()};  // to()
};

// The rpc::Class of PipelineStage ("forward" is the RemoteModule method).
const rpc::Class<PipelineStage>& pipelineStageClass();

// Binds PipelineStage (class, constructor from StageSpec, remoteParameters) on a worker that may hold
// stages. Call before Agent::start, beside rref::RRefContext::install, autograd::distributed::install and
// optim::DistributedOptimizer::install (which every stage worker needs too).
void installPipeline(rpc::Registry& registry);

}  // namespace distgrad::models::pipeline

DG_REMOTE_MODULE(distgrad::models::pipeline::PipelineStage, distgrad::models::pipeline::pipelineStageClass());

namespace distgrad::models::pipeline {

// Where one stage runs ("workerN" or "workerN/cpu") and what it is.
struct RemoteStage {
  std::string placement;
  StageSpec spec;
};

class RpcPipeline : public Pipeline {
 public:
  // Creates every stage on its worker (returns once all are built and the DistributedOptimizer over their
  // parameters exists). Throws ValueError (no stages, a bad spec or placement, stages that do not chain:
  // stage s + 1 must start where stage s ends) or RpcError naming the worker that failed to build its stage.
  RpcPipeline(rpc::Agent& agent, std::vector<RemoteStage> stages, PipelineOptions options,
              autograd::distributed::BackwardMode mode = autograd::distributed::BackwardMode::kExact);
  ~RpcPipeline() override;
  RpcPipeline(const RpcPipeline&) = delete;
  RpcPipeline& operator=(const RpcPipeline&) = delete;

  StepResult step(const Tensor& inputs, const Tensor& labels) override;
  Tensor predict(const Tensor& inputs) override;
  int64_t numStages() const override { return static_cast<int64_t>(stages_.size()); }
  std::string describe() const override;

  // The stages' own measurements of the last step (what StepResult::stats was built from).
  const std::vector<StageStats>& lastStageStats() const { return lastStageStats_; }
  // The stages' stats now (e.g. their processes' peak RSS); resets nothing.
  std::vector<StageStats> stageStats();
  // The worker of each stage.
  std::vector<std::string> workers() const;
  // Copies of every stage's parameters, in model order (stage 0's first, each in Module::parameters()
  // order), on the host: for checkpoints at the driver and for tests. Blocks (one call per stage, concurrently).
  std::vector<Tensor> fetchParameters() const;
  // Whether step() fetches the stages' measurements (one small call per stage per step, sent with the
  // forwards and answered when the stage's part of the step is done). Off: StepResult::stats has only
  // wallSeconds (and steps).
  void setCollectStats(bool enabled) { collectStats_ = enabled; }
  const PipelineOptions& options() const { return options_; }

 private:
  struct MicroBatch;
  rpc::Agent* agent_;
  PipelineOptions options_;
  autograd::distributed::BackwardMode mode_;
  std::vector<RemoteStage> specs_;
  std::vector<rref::RemoteModule<PipelineStage>> stages_;
  std::vector<rref::RRef<Tensor>> parameters_;  // every stage's, in model order
  std::unique_ptr<optim::DistributedOptimizer> optimizer_;
  std::vector<StageStats> lastStageStats_;
  bool collectStats_ = true;
  int64_t steps_ = 0;  // step() calls so far: the next step's number in traces
};

}  // namespace distgrad::models::pipeline
