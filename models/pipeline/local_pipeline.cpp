#include "models/pipeline/local_pipeline.h"

#include <chrono>
#include <numeric>
#include <stdexcept>
#include <unordered_set>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "rpc/trace.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/error.h"

namespace distgrad::models::pipeline {
namespace {
// A one-element tensor's value wherever it lives (a stage on a GPU computes its loss there).
double hostItem(const Tensor& t) { return (t.device().isCpu() ? t : t.to(Device::cpu())).item(); }
}  // namespace
namespace {

// Thrown inside a stage whose step was aborted because another stage failed: that stage's error is the
// one reported, this one is not an error of its own.
struct Aborted {};

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Puts modules back in training mode when predict() leaves, also by an exception.
class EvalModeGuard {
 public:
  explicit EvalModeGuard(const std::vector<std::shared_ptr<Module>>& modules) : modules_(modules) {
    for (const auto& m : modules_) m->eval();
  }
  ~EvalModeGuard() {
    for (const auto& m : modules_) m->train();
  }
  EvalModeGuard(const EvalModeGuard&) = delete;
  EvalModeGuard& operator=(const EvalModeGuard&) = delete;

 private:
  const std::vector<std::shared_ptr<Module>>& modules_;
};

}  // namespace

LocalPipeline::LocalPipeline(std::vector<std::shared_ptr<Module>> stages, PipelineOptions options, bool threaded)
    : stages_(std::move(stages)), options_(std::move(options)), threaded_(threaded) {
  DG_CHECK(!stages_.empty(), "LocalPipeline: no stages");
  options_.validate();
  std::unordered_set<const void*> seen;
  for (size_t s = 0; s < stages_.size(); ++s) {
    DG_CHECK(stages_[s] != nullptr, "LocalPipeline: stage ", s, " is null");
    for (const auto& [name, p] : stages_[s]->namedParameters()) {
      // Two stages updating one tensor from two threads would race; a model cut into units never shares.
      DG_CHECK(seen.insert(p.implPtr().get()).second, "LocalPipeline: parameter ", name, " of stage ", s,
               " also belongs to an earlier stage (stages must not share parameters)");
    }
    std::vector<Tensor> params = stages_[s]->parameters();
    optimizers_.push_back(params.empty() ? nullptr : options_.optimizer.make(std::move(params)));
    stages_[s]->train();
  }
  state_.resize(stages_.size());
  if (threaded_) {
    for (int64_t s = 0; s < numStages(); ++s) threads_.emplace_back([this, s] { stageLoop(s); });
  }
}

LocalPipeline::~LocalPipeline() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  for (auto& t : threads_) t.join();
}

std::string LocalPipeline::describe() const {
  std::string out = threaded_ ? "local pipeline, " : "local model parallel (sequential), ";
  out += std::to_string(numStages()) + (numStages() == 1 ? " stage, " : " stages, ");
  out += std::string(scheduleName(options_.schedule)) + (threaded_ ? ", " : " order, ");
  out += std::to_string(options_.microBatches) + (options_.microBatches == 1 ? " micro-batch" : " micro-batches");
  return out;
}

void LocalPipeline::stageLoop(int64_t stage) {
  // OpenMP's thread count is per thread: give this thread the process's setting (tensor::setNumThreads).
  tensor::setNumThreads(tensor::numThreads());
  trace::setThreadName("dg-stage-" + std::to_string(stage));  // its row in a trace
  uint64_t seen = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    try {
      runStage(stage, /*blocking=*/true);
    } catch (const Aborted&) {
      // Another stage failed; its error is reported.
    } catch (...) {
      fail(stage, std::current_exception());
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (--running_ == 0) changed_.notify_all();
  }
}

void LocalPipeline::beginStep(const StepJob& job) {
  for (int64_t s = 0; s < numStages(); ++s) {
    StageState& st = state_[static_cast<size_t>(s)];
    st = StageState{};
    st.order = stageOrder(options_.schedule, s, numStages(), job.microBatches);
    st.forwardSeconds.assign(static_cast<size_t>(job.microBatches), 0.0);
    st.backwardSeconds.assign(static_cast<size_t>(job.microBatches), 0.0);
    // A failed step may have left gradients behind.
    stages_[static_cast<size_t>(s)]->zeroGrad();
  }
}

void LocalPipeline::post(const MailKey& key, Tensor value) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    mail_[key] = std::move(value);
  }
  changed_.notify_all();
}

std::optional<Tensor> LocalPipeline::take(const MailKey& key, bool blocking) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (blocking) changed_.wait(lock, [&] { return aborted_ || stopping_ || mail_.count(key) != 0; });
  if (aborted_ || stopping_) throw Aborted{};
  auto it = mail_.find(key);
  if (it == mail_.end()) return std::nullopt;
  Tensor value = std::move(it->second);
  mail_.erase(it);
  return value;
}

void LocalPipeline::fail(int64_t stage, std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) {
      error_ = std::move(error);
      failedStage_ = stage;
    }
    aborted_ = true;
  }
  changed_.notify_all();
}

bool LocalPipeline::runStage(int64_t stage, bool blocking) {
  StageState& st = state_[static_cast<size_t>(stage)];
  const bool last = stage + 1 == numStages();
  bool ran = false;
  while (st.next < st.order.size()) {
    const Op op = st.order[st.next];
    std::optional<Tensor> received;
    if (op.forward ? stage > 0 : !last) {
      received = take(MailKey{stage, op.forward, op.microBatch}, blocking);
      if (!received) return ran;  // not there yet (sequential mode): another stage must run first
    }
    runOp(stage, op, received ? std::move(*received) : Tensor());
    ++st.next;
    ran = true;
  }
  if (!st.stepped) {
    // The stage's last backward is done: its gradients are complete, step now (the other stages may
    // still be busy with theirs).
    auto& optimizer = optimizers_[static_cast<size_t>(stage)];
    if (optimizer) {
      trace::Scope span("pipeline.optimizer", trace::Category::kPipeline, stage);  // docs/tracing.md
      span.setArg(2, job_->step);
      optimizer->step();
      optimizer->zeroGrad();
    }
    st.stepped = true;
    ran = true;
  }
  return ran;
}

void LocalPipeline::runOp(int64_t stage, const Op& op, Tensor received) {
  StageState& st = state_[static_cast<size_t>(stage)];
  const bool last = stage + 1 == numStages();
  const auto m = static_cast<size_t>(op.microBatch);
  Module& module = *stages_[static_cast<size_t>(stage)];
  const auto start = std::chrono::steady_clock::now();
  // The compute only (docs/tracing.md): ended before the hand-over to the neighbour.
  trace::Scope span(op.forward ? "pipeline.forward" : "pipeline.backward", trace::Category::kPipeline, stage,
                    op.microBatch, job_->step);
  span.setDetail("local");
  if (op.forward) {
    // The stage's own graph starts at a fresh leaf: backward stops here and leaves the input's gradient
    // in x.grad() for the previous stage.
    Tensor x = stage == 0 ? job_->inputs[m] : received.detach();
    if (stage > 0) x.setRequiresGrad();
    Tensor y = module.forward(x);
    if (last) {
      const Tensor& labels = job_->labels[m];
      const double share = static_cast<double>(labels.size(0)) / static_cast<double>(job_->batchSize);
      Tensor loss = crossEntropy(y, labels);
      {
        autograd::NoGradGuard noGrad;
        st.loss += hostItem(loss) * share;
        st.correct += static_cast<int64_t>(hostItem(sum(eq(argmax(y, 1), labels))));
      }
      // Each micro-batch's mean loss weighted by its share of the batch: the gradients summed over the
      // micro-batches are those of the batch's mean loss.
      st.inFlight[op.microBatch] = {x, mul(loss, share)};
    } else {
      st.inFlight[op.microBatch] = {x, y};
    }
    st.maxInFlight = std::max(st.maxInFlight, static_cast<int64_t>(st.inFlight.size()));
    st.forwardSeconds[m] = secondsSince(start);
    span.end();
    if (!last) post(MailKey{stage + 1, true, op.microBatch}, y.detach());
    return;
  }
  auto it = st.inFlight.find(op.microBatch);
  DG_ASSERT(it != st.inFlight.end(), "stage ", stage, " backward of micro-batch ", op.microBatch,
            " before its forward");
  auto [x, root] = std::move(it->second);
  st.inFlight.erase(it);
  // An undefined gradient from the next stage means its input did not influence the loss: nothing to do.
  if (root.requiresGrad() && (last || received.defined())) distgrad::backward(root, last ? Tensor() : received);
  root = Tensor();
  Tensor inputGrad = stage > 0 ? x.grad() : Tensor();
  x = Tensor();
  st.backwardSeconds[m] = secondsSince(start);
  span.end();
  if (stage > 0) post(MailKey{stage - 1, false, op.microBatch}, std::move(inputGrad));
}

void LocalPipeline::rethrowStageError() {
  const std::string prefix = "local pipeline stage " + std::to_string(failedStage_) + ": ";
  std::exception_ptr error = error_;
  try {
    std::rethrow_exception(error);
  } catch (const ValueError& e) {
    throw ValueError(prefix + e.what());
  } catch (const InternalError& e) {
    throw InternalError(prefix + e.what());
  } catch (const std::exception& e) {
    throw std::runtime_error(prefix + e.what());
  } catch (...) {
    throw std::runtime_error(prefix + "unknown exception");
  }
}

StepResult LocalPipeline::step(const Tensor& inputs, const Tensor& labels) {
  DG_CHECK(inputs.defined() && inputs.dim() >= 1, "LocalPipeline::step: inputs must be a tensor [N, ...]");
  DG_CHECK(labels.defined() && labels.dim() == 1 && labels.dtype() == DType::kInt64,
           "LocalPipeline::step: labels must be an int64 tensor [N], got ",
           labels.defined() ? tensor::shapeStr(labels.shape()) : std::string("undefined"));
  DG_CHECK(inputs.size(0) == labels.size(0), "LocalPipeline::step: ", inputs.size(0), " inputs but ", labels.size(0),
           " labels");
  StepJob job;
  job.step = steps_++;
  job.batchSize = inputs.size(0);
  const std::vector<int64_t> sizes = microBatchSizes(job.batchSize, options_.microBatches);
  job.microBatches = static_cast<int64_t>(sizes.size());
  {
    const Tensor data = inputs.detach();
    int64_t offset = 0;
    for (int64_t n : sizes) {
      job.inputs.push_back(narrow(data, 0, offset, n));
      job.labels.push_back(narrow(labels, 0, offset, n));
      offset += n;
    }
  }
  beginStep(job);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &job;
    mail_.clear();
    aborted_ = false;
    error_ = nullptr;
    failedStage_ = -1;
  }
  const auto start = std::chrono::steady_clock::now();
  // docs/tracing.md: the whole step, on the caller's thread (the stages' spans are on their threads).
  trace::Scope stepSpan("pipeline.step", trace::Category::kPipeline, job.step, job.microBatches, numStages());
  stepSpan.setDetail(scheduleName(options_.schedule));
  if (threaded_) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      running_ = numStages();
      ++generation_;
    }
    changed_.notify_all();
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return running_ == 0; });
  } else {
    // Round-robin over the stages, each running whatever its inputs allow: the same per-stage order of
    // work as the threads, one op at a time.
    bool done = false;
    while (!done && !aborted_) {
      done = true;
      bool progress = false;
      for (int64_t s = 0; s < numStages() && !aborted_; ++s) {
        try {
          progress = runStage(s, /*blocking=*/false) || progress;
        } catch (...) {
          fail(s, std::current_exception());
        }
        done = done && state_[static_cast<size_t>(s)].stepped;
      }
      DG_ASSERT(done || progress || aborted_, "LocalPipeline: the stage orders deadlock");
    }
  }
  const double wall = secondsSince(start);
  stepSpan.end();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = nullptr;
    mail_.clear();
  }
  if (error_) {
    for (auto& st : state_) st.inFlight.clear();  // release the failed step's graphs
    rethrowStageError();
  }

  StepResult result;
  result.samples = job.batchSize;
  result.microBatches = job.microBatches;
  StageTimes times;
  StepStats& stats = result.stats;
  stats.wallSeconds = wall;
  stats.steps = 1;
  for (const StageState& st : state_) {
    result.loss += st.loss;
    result.correct += st.correct;
    times.forward.push_back(st.forwardSeconds);
    times.backward.push_back(st.backwardSeconds);
    stats.busySeconds.push_back(std::accumulate(st.forwardSeconds.begin(), st.forwardSeconds.end(), 0.0) +
                                std::accumulate(st.backwardSeconds.begin(), st.backwardSeconds.end(), 0.0));
    stats.maxInFlight.push_back(st.maxInFlight);
    stats.peakActivationBytes.push_back(-1);
  }
  // Sequential execution's schedule is one op at a time: its ideal is the sum of all compute, and the
  // stages' idle time is bubble, not overhead.
  stats.idealSeconds = threaded_ ? idealMakespan(options_.schedule, times)
                                 : std::accumulate(stats.busySeconds.begin(), stats.busySeconds.end(), 0.0);
  return result;
}

Tensor LocalPipeline::predict(const Tensor& inputs) {
  DG_CHECK(inputs.defined() && inputs.dim() >= 1, "LocalPipeline::predict: inputs must be a tensor [N, ...]");
  autograd::NoGradGuard noGrad;
  EvalModeGuard evalMode(stages_);
  Tensor x = inputs.detach();
  for (int64_t s = 0; s < numStages(); ++s) {
    try {
      x = stages_[static_cast<size_t>(s)]->forward(x);
    } catch (const ValueError& e) {
      throw ValueError("local pipeline stage " + std::to_string(s) + ": " + e.what());
    }
  }
  return x;
}

}  // namespace distgrad::models::pipeline
