// local_pipeline: pipeline-parallel training in one process. The model is cut into --stages contiguous
// stages of balanced cost; each stage runs on its own thread, and every batch is split into
// --micro-batches micro-batches that flow through the stages in the --schedule's order (GPipe: all
// forwards then all backwards; 1F1B: one forward, one backward, at most stages - s micro-batches held by
// stage s), so the stages work on different micro-batches at the same time. Each stage steps its own
// optimizer after its last backward. The result is the same training as single_worker's (same model from
// the same --seed, the gradient of the whole batch), computed in a pipeline.
//
// Each epoch reports where the stages' time went (models/pipeline/schedule.h, StepStats): compute (forward
// and backward), bubble (idle time the schedule itself forces while the pipeline fills and drains: it
// shrinks as micro-batches grow in number) and overhead (hand-overs between threads, the optimizer step,
// and the threads contending for this machine's cores).
//
// Defaults (the same in single_worker, local_model_parallel and rpc_pipeline): ResNet-18 of base width 16
// with a CIFAR stem, 1 epoch, batch 64, Adam lr 0.001 (sgd: lr 0.05, momentum 0.9), seed 0, 1 oneDNN
// thread; 2 stages balanced by measured time, 4 micro-batches, GPipe.
//
// Ends with one JSON line: {"example":"local_pipeline","mode":"local_pipeline","stages":2,
// "micro_batches":4,"schedule":"gpipe","images_per_s":...,"test_accuracy":...,"bubble_share":...,...}.
//
//   local_pipeline [--stages N] [--micro-batches N] [--schedule gpipe|1f1b] [--balance time|params]
//                  [--model resnet18|resnet50|mlp|lenet5] [--width N] [--epochs N] [--batch-size N]
//                  [--optimizer sgd|adam] [--lr X] [--seed N] [--limit N] [--threads N] [--data-dir DIR]
//                  [--trace DIR]   (writes DIR/local_pipeline.trace.jsonl: docs/tracing.md)
#include "examples/local_pipeline_main.h"

int main(int argc, char** argv) {
  return distgrad::examples::runLocalPipeline("local_pipeline", "local_pipeline",
                                              "pipeline-parallel training on threads of one process",
                                              /*threaded=*/true, argc, argv);
}
