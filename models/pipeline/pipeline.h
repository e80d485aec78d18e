// Pipeline: the interface of pipeline-parallel training, where a model cut into stages (models/pipeline/
// partition.h) trains on a batch split into micro-batches whose forwards and backwards flow through the
// stages in a schedule (models/pipeline/schedule.h), then every stage steps its own optimizer once.
//
//   LocalPipeline pipe(stageModules(units, partition), {.microBatches = 4, .schedule = Schedule::k1F1B,
//                                                     .optimizer = OptimizerSpec::sgd({.learningRate = 0.05})});
//   StepResult r = pipe.step(images, labels);   // r.loss, r.correct, r.stats.computeShare() ...
//   Tensor logits = pipe.predict(testImages);
//
// Implementations: LocalPipeline (models/pipeline/local_pipeline.h: stages on threads of this process, or
// one after another on the caller's thread) and RpcPipeline (models/pipeline/rpc_pipeline.h: stages on
// workers). Both compute the same thing: the gradient of the mean cross-entropy over the whole batch (each
// micro-batch's mean loss scaled by its share of the batch), so a step equals a full-batch step up to
// floating-point rounding (for models without BatchNorm, whose batch statistics are per micro-batch).
// Thread-safety: a Pipeline is driven from one thread at a time (step/predict are not reentrant).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "models/optim/distributed_optimizer.h"
#include "models/pipeline/schedule.h"
#include "tensor/tensor.h"

namespace distgrad::models::pipeline {

struct PipelineOptions {
  int64_t microBatches = 4;
  Schedule schedule = Schedule::kGPipe;
  optim::OptimizerSpec optimizer;  // each stage builds one over its own parameters
  // ValueError: microBatches < 1 or a bad optimizer spec.
  void validate() const;
};

struct StepResult {
  double loss = 0;      // mean cross-entropy over the batch (before the optimizer step)
  int64_t correct = 0;  // samples whose logits' argmax was the label
  int64_t samples = 0;
  int64_t microBatches = 0;  // how many the batch was split into
  StepStats stats;
};

// How a batch of `batchSize` samples is split: min(microBatches, batchSize) micro-batches whose sizes
// differ by at most one, larger ones first (10 in 4: 3 3 2 2). ValueError for sizes < 1.
std::vector<int64_t> microBatchSizes(int64_t batchSize, int64_t microBatches);

class Pipeline {
 public:
  virtual ~Pipeline() = default;
  // One training step on a batch (inputs [N, ...], int64 labels [N]): split into micro-batches
  // (microBatchSizes), forward + cross-entropy loss (mean over the whole batch: each micro-batch loss
  // scaled by its share) + backward per the schedule, one optimizer step per stage. An error in any stage
  // (bad shapes, ...) is thrown here, naming the stage; the pipeline stays usable for later steps.
  virtual StepResult step(const Tensor& inputs, const Tensor& labels) = 0;
  // Logits for inputs, without autograd, stages in eval mode (restored to training after).
  virtual Tensor predict(const Tensor& inputs) = 0;
  virtual int64_t numStages() const = 0;
  // "local pipeline, 2 stages, 1f1b, 4 micro-batches".
  virtual std::string describe() const = 0;
};

}  // namespace distgrad::models::pipeline
