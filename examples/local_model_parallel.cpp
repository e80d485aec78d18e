// local_model_parallel: model parallelism in one process, without pipelining. The model is cut into
// --stages contiguous stages of balanced cost (as a model too big for one device would be spread over
// several), and each batch goes through them one after another: stage 0's forward, stage 1's forward, ...,
// the loss, then the backwards in reverse, then every stage steps its own optimizer. At any moment only one
// stage works; the others wait. That idle time is what local_pipeline recovers with micro-batches.
//
// It runs LocalPipeline in sequential mode with one micro-batch: the same stages, hand-overs (each stage's
// input is the previous stage's output, detached) and accounting as the pipelines, on the calling thread.
// The training is the same as single_worker's (same model from the same --seed, same gradients).
//
// Each epoch reports compute, bubble (the stages' idle time the sequential schedule forces: (S-1)/S of
// every stage's time, in principle) and overhead shares (models/pipeline/schedule.h, StepStats).
//
// Ends with one JSON line: {"example":"local_model_parallel","mode":"local_mp","stages":2,
// "micro_batches":1,"schedule":"sequential","images_per_s":...,"test_accuracy":...,...}.
//
//   local_model_parallel [--stages N] [--balance time|params] [--model resnet18|resnet50|mlp|lenet5]
//                        [--width N] [--epochs N] [--batch-size N] [--optimizer sgd|adam] [--lr X]
//                        [--seed N] [--limit N] [--threads N] [--data-dir DIR]
#include "examples/local_pipeline_main.h"

int main(int argc, char** argv) {
  return distgrad::examples::runLocalPipeline("local_model_parallel", "local_mp",
                                              "model-parallel training in one process, stages in turn",
                                              /*threaded=*/false, argc, argv);
}
