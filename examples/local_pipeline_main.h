// The program local_model_parallel and local_pipeline share: the model cut into --stages balanced stages in
// this process, trained on Fashion-MNIST through a LocalPipeline, sequential (one stage after another, one
// micro-batch) or threaded (one thread per stage, --micro-batches in the --schedule's order), with each
// epoch's compute / bubble / overhead shares and a final JSON line. Header-only, like example_util.h.
#pragma once

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>

#include "examples/example_util.h"
#include "examples/pipeline_flags.h"
#include "models/data/data_loader.h"
#include "models/pipeline/local_pipeline.h"
#include "models/pipeline/model_spec.h"
#include "models/pipeline/partition.h"
#include "tensor/cpu/dnnl_context.h"

namespace distgrad::examples {

// `name`: the program; `mode`: its JSON mode; threaded: local_pipeline (else local_model_parallel).
inline int runLocalPipeline(const std::string& name, const std::string& mode, const std::string& summary, bool threaded,
                            int argc, char** argv) {
  namespace pipeline = distgrad::models::pipeline;
  PipelineFlags opt;
  Flags flags(name, summary);
  parsePipelineFlags(flags, opt, argc, argv, "--stages",
                     threaded ? "pipeline stages (one thread each)" : "model stages (run one after another)",
                     /*pipelined=*/threaded);
  if (!threaded) opt.microBatches = 1;  // the whole batch goes through each stage at once
  try {
    tensor::setNumThreads(opt.threads);
    LocalTrace trace(name, opt.traceDir);  // --trace: from here to the end of training
    const Data data = loadFashionMnist(opt.dataDir, opt.limit);
    const pipeline::ModelSpec spec = opt.modelSpec();
    auto model = pipeline::buildModel(spec);
    // Every stage on the one --device (the stages' optimizers are built by the pipeline, after this).
    const Device device = opt.device();
    model->to(device);
    const auto units = pipeline::modelUnits(spec, model);

    // Balance on a micro-batch of real images: a stage's cost is its forward + backward on what it will
    // actually receive.
    const int64_t microSize = std::max<int64_t>(1, opt.batchSize / opt.microBatches);
    const Tensor sample =
        narrow(data.train.inputs(), 0, 0, std::min(microSize, data.train.size())).cloneData().to(device);
    const pipeline::Partition partition =
        pipeline::balance(units, opt.stages, pipeline::parseBalanceBy(opt.balance), sample);

    pipeline::PipelineOptions options;
    options.microBatches = opt.microBatches;
    options.schedule = pipeline::parseSchedule(opt.schedule);
    options.optimizer = opt.optimizerSpec();
    pipeline::LocalPipeline pipe(pipeline::stageModules(units, partition), options, threaded);
    std::printf("%s: %s (%.2fM parameters), %s, %s, batch %lld, %lld train / %lld test images, %s\n", name.c_str(),
                spec.describe().c_str(), static_cast<double>(model->numParameters()) / 1e6, pipe.describe().c_str(),
                options.optimizer.describe().c_str(), static_cast<long long>(opt.batchSize),
                static_cast<long long>(data.train.size()), static_cast<long long>(data.test.size()),
                device.str().c_str());
    std::printf("partition by %s: %s\n", opt.balance.c_str(), partition.describe().c_str());

    models::data::DataLoader loader(data.train,
                                    {.batchSize = opt.batchSize, .shuffle = true, .seed = opt.seed, .device = device});
    pipeline::StepStats total;
    int64_t trainImages = 0;
    double accuracy = 0;
    for (int64_t epoch = 1; epoch <= opt.epochs; ++epoch) {
      const std::string label = "epoch " + std::to_string(epoch) + "/" + std::to_string(opt.epochs);
      Progress progress(label, loader.numBatches());
      RunningLoss runningLoss;
      pipeline::StepStats epochStats;
      int64_t done = 0;
      int64_t images = 0;
      for (const auto& batch : loader) {
        const pipeline::StepResult r = pipe.step(batch.inputs, batch.labels);
        epochStats.accumulate(r.stats);
        images += r.samples;
        const double smoothed = runningLoss.add(r.loss, label + " batch " + std::to_string(done + 1));
        progress.update(++done, images, smoothed);
      }
      total.accumulate(epochStats);
      trainImages += images;
      accuracy = testAccuracy([&](const Tensor& x) { return pipe.predict(x); }, data.test, 1000, device);
      std::printf("epoch %lld: test accuracy %.2f%%, %.0f images/s, compute %.0f%%, bubble %.0f%%, overhead %.0f%%\n",
                  static_cast<long long>(epoch), 100.0 * accuracy, static_cast<double>(images) / epochStats.wallSeconds,
                  100.0 * epochStats.computeShare(), 100.0 * epochStats.bubbleShare(),
                  100.0 * epochStats.overheadShare());
      std::fflush(stdout);
    }

    trace.finish();
    JsonLine json(name);
    addRunFields(json, mode, 1, opt, spec.name, data.train.size())
        .add("stages", opt.stages)
        .add("micro_batches", opt.microBatches)
        .add("schedule", threaded ? opt.schedule : std::string("sequential"))
        .add("balance", opt.balance)
        .add("compute_share", total.computeShare())
        .add("bubble_share", total.bubbleShare())
        .add("overhead_share", total.overheadShare())
        .add("images_per_s", static_cast<double>(trainImages) / total.wallSeconds)
        .add("test_accuracy", accuracy)
        .add("peak_rss_mib", peakRssMiB())
        .print();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << name << ": error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace distgrad::examples
