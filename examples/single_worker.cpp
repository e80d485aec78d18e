// single_worker: trains a model of the zoo on Fashion-MNIST in one process with a plain loop, the whole
// model on the calling thread. It is the baseline the pipeline examples are measured against:
// local_model_parallel (the model cut into stages run one after another), local_pipeline (the stages on
// threads, micro-batches flowing through them) and rpc_pipeline (the stages on workers).
//
// The model is described by value (models/pipeline/model_spec.h), so every example builds the very same
// network from the same --seed. Defaults: a ResNet-18 of base width 16 with a CIFAR stem (3x3, no pool),
// which suits 28x28 images; one epoch reaches about 88% test accuracy.
//
// Ends with one JSON line: {"example":"single_worker","mode":"single","images_per_s":...,
// "test_accuracy":...,"compute_share":...,...}. compute_share is the share of each step's wall time spent
// in forward + backward (the rest, overhead_share, is the optimizer step and the loop itself); there is no
// pipeline, so bubble_share is 0.
//
//   single_worker [--model resnet18|resnet50|mlp|lenet5] [--width N] [--epochs N] [--batch-size N]
//                 [--optimizer sgd|adam] [--lr X] [--seed N] [--limit N] [--threads N] [--data-dir DIR]
#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "examples/example_util.h"
#include "examples/pipeline_flags.h"
#include "models/data/data_loader.h"
#include "models/optim/distributed_optimizer.h"
#include "models/pipeline/model_spec.h"
#include "models/pipeline/schedule.h"
#include "rpc/trace.h"
#include "tensor/cpu/dnnl_context.h"

using namespace distgrad;
namespace data = distgrad::models::data;
namespace pipeline = distgrad::models::pipeline;

int main(int argc, char** argv) {
  examples::PipelineFlags opt;
  examples::Flags flags("single_worker", "trains a zoo model on Fashion-MNIST in one process (the baseline)");
  examples::parsePipelineFlags(flags, opt, argc, argv, /*stagesFlag=*/"", "", /*pipelined=*/false);
  try {
    tensor::setNumThreads(opt.threads);
    examples::LocalTrace trace("single_worker", opt.traceDir);  // --trace
    const examples::Data data = examples::loadFashionMnist(opt.dataDir, opt.limit);
    const pipeline::ModelSpec spec = opt.modelSpec();
    auto model = pipeline::buildModel(spec);
    const Device device = opt.device();
    model->to(device);  // before the optimizer (models/optim/optimizer.h, "Devices")
    const models::optim::OptimizerSpec optSpec = opt.optimizerSpec();
    auto optimizer = optSpec.make(model->parameters());
    std::printf(
        "single_worker: %s (%.2fM parameters), %s, batch %lld, %lld train / %lld test images, %d thread(s), %s\n",
        spec.describe().c_str(), static_cast<double>(model->numParameters()) / 1e6, optSpec.describe().c_str(),
        static_cast<long long>(opt.batchSize), static_cast<long long>(data.train.size()),
        static_cast<long long>(data.test.size()), opt.threads, device.str().c_str());

    data::DataLoader loader(data.train,
                            {.batchSize = opt.batchSize, .shuffle = true, .seed = opt.seed, .device = device});
    pipeline::StepStats total;
    int64_t trainImages = 0;
    int64_t stepsDone = 0;
    double accuracy = 0;
    for (int64_t epoch = 1; epoch <= opt.epochs; ++epoch) {
      const std::string label = "epoch " + std::to_string(epoch) + "/" + std::to_string(opt.epochs);
      examples::Progress progress(label, loader.numBatches());
      examples::RunningLoss runningLoss;
      pipeline::StepStats epochStats;
      int64_t done = 0;
      int64_t images = 0;
      for (const auto& batch : loader) {
        const auto start = std::chrono::steady_clock::now();
        // Traced as a one-stage pipeline of one micro-batch (docs/tracing.md, "Pipeline events"), so that
        // distgrad-trace compares it with the pipelines.
        const int64_t stepIndex = stepsDone++;
        trace::Scope stepSpan("pipeline.step", trace::Category::kPipeline, stepIndex, 1, 1);
        stepSpan.setDetail("gpipe");
        trace::Scope forwardSpan("pipeline.forward", trace::Category::kPipeline, 0, 0, stepIndex);
        forwardSpan.setDetail("local");
        Tensor loss = crossEntropy(model->forward(batch.inputs), batch.labels);
        forwardSpan.end();
        trace::Scope backwardSpan("pipeline.backward", trace::Category::kPipeline, 0, 0, stepIndex);
        backwardSpan.setDetail("local");
        distgrad::backward(loss);
        backwardSpan.end();
        const double compute = examples::secondsSince(start);
        {
          trace::Scope optimizerSpan("pipeline.optimizer", trace::Category::kPipeline, 0);
          optimizerSpan.setArg(2, stepIndex);
          optimizer->step();
          optimizer->zeroGrad();
        }
        stepSpan.end();
        // The same accounting as the pipelines, for one stage that is never idle.
        pipeline::StepStats step;
        step.wallSeconds = examples::secondsSince(start);
        step.idealSeconds = compute;
        step.busySeconds = {compute};
        step.maxInFlight = {1};
        step.peakActivationBytes = {-1};
        step.steps = 1;
        epochStats.accumulate(step);
        images += batch.size();
        const double smoothed = runningLoss.add(examples::itemOf(loss), label + " batch " + std::to_string(done + 1));
        progress.update(++done, images, smoothed);
      }
      total.accumulate(epochStats);
      trainImages += images;
      model->eval();
      accuracy = examples::testAccuracy([&](const Tensor& x) { return model->forward(x); }, data.test, 1000, device);
      model->train();
      std::printf("epoch %lld: test accuracy %.2f%%, %.0f images/s, compute %.0f%%\n", static_cast<long long>(epoch),
                  100.0 * accuracy, static_cast<double>(images) / epochStats.wallSeconds,
                  100.0 * epochStats.computeShare());
      std::fflush(stdout);
    }

    trace.finish();
    examples::JsonLine json("single_worker");
    examples::addRunFields(json, "single", 1, opt, spec.name, data.train.size())
        .add("stages", 1)
        .add("micro_batches", 1)
        .add("schedule", "none")
        .add("compute_share", total.computeShare())
        .add("bubble_share", total.bubbleShare())
        .add("overhead_share", total.overheadShare())
        .add("images_per_s", static_cast<double>(trainImages) / total.wallSeconds)
        .add("test_accuracy", accuracy)
        .add("peak_rss_mib", examples::peakRssMiB())
        .print();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "single_worker: error: " << e.what() << "\n";
    return 1;
  }
}
