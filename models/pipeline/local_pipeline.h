// LocalPipeline: pipeline-parallel training with every stage in this process.
//
// Threaded (the default): one thread per stage runs that stage's stageOrder (models/pipeline/schedule.h)
// for each step. Activations and gradients are handed over at stage boundaries through mailboxes: a
// stage's input is the previous stage's output detached and marked requires-grad, so each stage runs
// autograd on its own part of the graph only (the local engine allows concurrent backward passes over
// disjoint graphs, autograd/engine.h); the gradient of that input is handed back to the previous stage as
// the root gradient of its own backward. The last stage computes the loss. After its last backward each
// stage steps its own optimizer (PipelineOptions::optimizer over its parameters), on its own thread.
//
// Sequential (threaded = false): the same per-stage orders and the same arithmetic, run one op at a time on
// the calling thread: local model parallelism without pipelining (a baseline, and bit-for-bit the threaded
// pipeline's result, since every stage computes in the same order either way).
//
// Each step is measured (StepStats): per stage and micro-batch, the seconds of each forward and backward
// (waiting for a neighbour excluded), the ideal makespan of the schedule with those times (for sequential
// execution, the sum of all of them: that is its schedule), and the micro-batches in flight per stage.
// peakActivationBytes is -1: the tensors an autograd graph saves are not observable from here.
//
// Tracing (docs/tracing.md, "Pipeline events"): when rpc/trace.h records, step() records pipeline.step on
// the calling thread and each stage its pipeline.forward / pipeline.backward per micro-batch and its
// pipeline.optimizer, on the thread that computes them (detail "local"). Steps are numbered from 0 per
// LocalPipeline. With no agent in the process, trace::registerWorker(name, 0, dir) gives them a file.
//
// Errors: an exception in any stage (bad shapes, a loss that cannot be computed) stops the step in every
// stage (none waits forever for a neighbour that failed) and step() throws it, its message prefixed with
// "local pipeline stage S: "; a ValueError stays a ValueError. Gradients of the failed step are discarded
// at the next step, which runs normally. No stage steps its optimizer before every forward of the step has
// run (the last stage's last backward needs them all), so a failing forward leaves the weights untouched;
// a failing backward may come after later stages have stepped.
//
// Thread-safety: drive a LocalPipeline from one thread (step/predict are not reentrant). The stage modules
// must not be used elsewhere while it lives. The destructor stops and joins the stage threads.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "models/nn/module.h"
#include "models/optim/optimizer.h"
#include "models/pipeline/pipeline.h"

namespace distgrad::models::pipeline {

class LocalPipeline : public Pipeline {
 public:
  // `stages` in order (e.g. stageModules(units, partition)); they must not share parameters. ValueError for
  // no stages, a null stage, shared parameters or bad options.
  LocalPipeline(std::vector<std::shared_ptr<Module>> stages, PipelineOptions options, bool threaded = true);
  ~LocalPipeline() override;
  LocalPipeline(const LocalPipeline&) = delete;
  LocalPipeline& operator=(const LocalPipeline&) = delete;

  StepResult step(const Tensor& inputs, const Tensor& labels) override;
  Tensor predict(const Tensor& inputs) override;
  int64_t numStages() const override { return static_cast<int64_t>(stages_.size()); }
  // "local pipeline, 2 stages, 1f1b, 4 micro-batches" or "local model parallel (sequential), 2 stages, ...".
  std::string describe() const override;

  const PipelineOptions& options() const { return options_; }
  bool threaded() const { return threaded_; }
  const std::vector<std::shared_ptr<Module>>& stages() const { return stages_; }

 private:
  // One step's work, shared by the stage threads (read-only while they run it).
  struct StepJob {
    int64_t microBatches = 0;
    int64_t batchSize = 0;
    int64_t step = 0;            // this pipeline's step number (for traces)
    std::vector<Tensor> inputs;  // per micro-batch, for stage 0
    std::vector<Tensor> labels;  // per micro-batch, for the last stage
  };
  // Per-stage state of the step in progress. Written only by the stage's own thread (or the caller's, in
  // sequential mode), read by the driver after the step finished.
  struct StageState {
    std::vector<Op> order;
    size_t next = 0;  // index into order of the next op to run
    // Forwarded, not yet backwarded micro-batches: the stage's input (requires grad, for its gradient)
    // and what to backward from (the output, or the scaled loss on the last stage).
    std::map<int64_t, std::pair<Tensor, Tensor>> inFlight;
    std::vector<double> forwardSeconds, backwardSeconds;
    int64_t maxInFlight = 0;
    double loss = 0;
    int64_t correct = 0;
    bool stepped = false;  // the stage's optimizer has stepped (its part of the step is over)
  };
  // A boundary hand-over: (to stage, forward?, micro-batch) -> tensor.
  using MailKey = std::tuple<int64_t, bool, int64_t>;

  void stageLoop(int64_t stage);
  // Prepares every stage's state for `job` (orders, counters, cleared gradients).
  void beginStep(const StepJob& job);
  // Runs stage `stage`'s ops of the current step; in sequential mode only those whose input is ready,
  // returning whether any ran. Threaded, it blocks for inputs and runs them all.
  bool runStage(int64_t stage, bool blocking);
  void runOp(int64_t stage, const Op& op, Tensor received);
  void post(const MailKey& key, Tensor value);
  // Takes the tensor for `key` (an undefined tensor is a valid value: no gradient). Blocking, waits for it;
  // otherwise returns nullopt when it is not there yet. Throws Aborted when the step was aborted.
  std::optional<Tensor> take(const MailKey& key, bool blocking);
  void fail(int64_t stage, std::exception_ptr error);
  [[noreturn]] void rethrowStageError();

  std::vector<std::shared_ptr<Module>> stages_;
  PipelineOptions options_;
  bool threaded_;
  std::vector<std::unique_ptr<optim::Optimizer>> optimizers_;  // null for a stage without parameters
  std::vector<StageState> state_;
  int64_t steps_ = 0;  // step() calls so far: the next step's number in traces

  // Guards everything below. One lock for the whole pipeline: hand-overs are a few per micro-batch, far
  // too rare to contend.
  std::mutex mutex_;
  std::condition_variable changed_;
  const StepJob* job_ = nullptr;  // the step in progress (owned by step()'s frame)
  uint64_t generation_ = 0;       // bumped per step; stage threads run each generation once
  int64_t running_ = 0;           // stage threads still working on the current step
  bool aborted_ = false;          // a stage failed: the others stop at their next hand-over
  bool stopping_ = false;         // destructor: threads exit
  int64_t failedStage_ = -1;
  std::exception_ptr error_;
  std::map<MailKey, Tensor> mail_;
  std::vector<std::thread> threads_;
};

}  // namespace distgrad::models::pipeline
