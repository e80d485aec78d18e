// bench/train_step: one training step (forward + backward + SGD momentum step) of the standard ResNet-18
// (torchvision layout: 7x7 stride-2 stem, max pool, 4 stages of 2 basic blocks, 10 classes) on 3x32x32
// inputs, batch 32, one thread. Prints images/s and peak RSS as JSON lines; bench/train_step_torch.py is the
// PyTorch counterpart with the same workload (scripts/bench.sh runs both and prints the ratio).
//
//   bench_train_step [--batch N] [--warmup N] [--steps N] [--threads N]
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "bench/bench_util.h"
#include "models/optim/sgd.h"
#include "models/zoo/resnet.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/random.h"

using namespace distgrad;

int main(int argc, char** argv) {
  int64_t batch = 32;
  int warmup = 5;
  int steps = 30;
  int threads = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string arg = argv[i];
    long value = std::strtol(argv[i + 1], nullptr, 10);
    if (value < 1) {
      std::fprintf(stderr, "bench_train_step: %s needs a positive integer\n", arg.c_str());
      return 2;
    }
    if (arg == "--batch") batch = value;
    else if (arg == "--warmup") warmup = static_cast<int>(value);
    else if (arg == "--steps") steps = static_cast<int>(value);
    else if (arg == "--threads") threads = static_cast<int>(value);
    else {
      std::fprintf(stderr, "bench_train_step: unknown argument %s\n", arg.c_str());
      return 2;
    }
  }
  tensor::setNumThreads(threads);

  tensor::Generator gen(0);
  auto model = models::resnet18(gen, {.numClasses = 10, .inChannels = 3});
  model->train();
  models::optim::SGD optimizer(model->parameters(), {.learningRate = 0.01, .momentum = 0.9});
  Tensor images = tensor::normal({batch, 3, 32, 32}, 0.0, 1.0, gen);
  Tensor labels = Tensor::empty({batch}, DType::kInt64);
  for (int64_t i = 0; i < batch; ++i) labels.data<int64_t>()[i] = static_cast<int64_t>(gen.below(10));

  auto step = [&] {
    optimizer.zeroGrad();
    Tensor loss = crossEntropy(model->forward(images), labels);
    distgrad::backward(loss);
    optimizer.step();
  };
  bench::Timings timings = bench::timeWallAndCpu(step, steps, warmup);

  std::map<std::string, std::string> common = {{"impl", bench::quoted("distgrad")},
                                               {"model", bench::quoted("resnet18")},
                                               {"batch", std::to_string(batch)},
                                               {"input", bench::quoted("3x32x32")},
                                               {"threads", std::to_string(threads)}};
  bench::emit("train_step", "images_per_s", "images/s",
              bench::statsOf(bench::ratesOf(timings.wall, static_cast<double>(batch))), common);
  // Per CPU-second of the (single) compute thread: robust to other load on a shared machine.
  bench::emit("train_step", "images_per_cpu_s", "images/cpu-s",
              bench::statsOf(bench::ratesOf(timings.cpu, static_cast<double>(batch))), common);
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  double peakMiB = static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
  bench::emit("train_step", "peak_rss", "MiB", {peakMiB, peakMiB, peakMiB, 1}, common);
  return 0;
}
