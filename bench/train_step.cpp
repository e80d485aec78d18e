// bench/train_step: training steps (forward + backward + SGD momentum step) of a torchvision-layout ResNet
// on synthetic images. Two workloads:
//   --device cpu (default): ResNet-18, 10 classes, 3x32x32 inputs, batch 32, one thread (images/s and
//     images per CPU-second, peak RSS);
//   --device cuda[:N]: ResNet-50, 1000 classes, 3x224x224 inputs, batch 64, on one GPU (images/s; each
//     timed step ends with a sync of the device's current stream, so the time covers the GPU work). Issue
//     9's target: >= 0.9x PyTorch on the same machine.
// bench/train_step_torch.py is the PyTorch counterpart with the same workloads and flags (scripts/bench.sh
// runs both and prints the ratio). Without a usable GPU, --device cuda prints one JSON line with "skipped"
// and exits 0.
//
//   bench_train_step [--device cpu|cuda[:N]] [--model resnet18|resnet50] [--image N] [--classes N]
//                    [--batch N] [--warmup N] [--steps N] [--threads N]
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "bench/bench_util.h"
#include "models/optim/sgd.h"
#include "models/zoo/resnet.h"
#include "tensor/cpu/dnnl_context.h"
#include "tensor/cuda/runtime.h"
#include "tensor/random.h"

using namespace distgrad;

namespace {

struct Options {
  std::string device = "cpu";
  std::string model;    // default by device: resnet18 on the CPU, resnet50 on a GPU
  int64_t image = 0;    // 32 on the CPU, 224 on a GPU
  int64_t classes = 0;  // 10 on the CPU, 1000 on a GPU
  int64_t batch = 0;    // 32 on the CPU, 64 on a GPU
  int warmup = 5;
  int steps = 30;
  int threads = 1;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "bench_train_step: %s\nusage: bench_train_step [--device cpu|cuda[:N]] [--model resnet18|resnet50] "
               "[--image N] [--classes N] [--batch N] [--warmup N] [--steps N] [--threads N]\n",
               why.c_str());
  std::exit(2);
}

// "cpu", "cuda" or "cuda:N" (the same names as the examples' --device).
Device parseDevice(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  if (text.rfind("cuda:", 0) == 0 && text.size() > 5 && text.size() <= 9 &&
      text.find_first_not_of("0123456789", 5) == std::string::npos) {
    return Device::cuda(std::stoi(text.substr(5)));
  }
  usage("bad --device '" + text + "' (expected cpu, cuda or cuda:N)");
}

Options parseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) usage("missing value for " + arg);
    const std::string value = argv[++i];
    if (arg == "--device") {
      o.device = value;
      continue;
    }
    if (arg == "--model") {
      if (value != "resnet18" && value != "resnet50") usage("--model must be resnet18 or resnet50");
      o.model = value;
      continue;
    }
    char* end = nullptr;
    const long number = std::strtol(value.c_str(), &end, 10);
    if (end == value.c_str() || *end != '\0' || number < 1) usage(arg + " needs a positive integer, got " + value);
    if (arg == "--batch")
      o.batch = number;
    else if (arg == "--image")
      o.image = number;
    else if (arg == "--classes")
      o.classes = number;
    else if (arg == "--warmup")
      o.warmup = static_cast<int>(number);
    else if (arg == "--steps")
      o.steps = static_cast<int>(number);
    else if (arg == "--threads")
      o.threads = static_cast<int>(number);
    else
      usage("unknown argument " + arg);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt = parseArgs(argc, argv);
  const Device device = parseDevice(opt.device);
  const bool gpu = device.isCuda();
  if (opt.model.empty()) opt.model = gpu ? "resnet50" : "resnet18";
  if (opt.image == 0) opt.image = gpu ? 224 : 32;
  if (opt.classes == 0) opt.classes = gpu ? 1000 : 10;
  if (opt.batch == 0) opt.batch = gpu ? 64 : 32;
  const std::string input = "3x" + std::to_string(opt.image) + "x" + std::to_string(opt.image);
  if (gpu && device.index >= tensor::cuda::deviceCount()) {
    std::printf(
        "{\"bench\":\"train_step\",\"impl\":\"distgrad\",\"device\":\"%s\",\"model\":\"%s\","
        "\"skipped\":\"%s requested but %d CUDA devices are available%s\"}\n",
        device.str().c_str(), opt.model.c_str(), device.str().c_str(), tensor::cuda::deviceCount(),
#ifdef DG_WITH_CUDA
        ""
#else
        " (built without CUDA)"
#endif
    );
    return 0;
  }

  try {
    tensor::setNumThreads(opt.threads);
    tensor::Generator gen(0);
    const models::ResNetConfig config{.numClasses = opt.classes, .inChannels = 3};
    auto model = opt.model == "resnet50" ? models::resnet50(gen, config) : models::resnet18(gen, config);
    model->train();
    model->to(device);  // before the optimizer (models/optim/optimizer.h, "Devices")
    models::optim::SGD optimizer(model->parameters(), {.learningRate = 0.01, .momentum = 0.9});
    Tensor images = tensor::normal({opt.batch, 3, opt.image, opt.image}, 0.0, 1.0, gen).to(device);
    Tensor labels = Tensor::empty({opt.batch}, DType::kInt64);
    for (int64_t i = 0; i < opt.batch; ++i) {
      labels.data<int64_t>()[i] = static_cast<int64_t>(gen.below(static_cast<uint64_t>(opt.classes)));
    }
    labels = labels.to(device);

    auto step = [&] {
      optimizer.zeroGrad();
      Tensor loss = crossEntropy(model->forward(images), labels);
      distgrad::backward(loss);
      optimizer.step();
      // The GPU runs asynchronously: a step is done when the stream that carried it is idle (the optimizer's
      // kernels run on this thread's current stream, after the backward's work).
      if (gpu) tensor::cuda::Stream::current(device.index).synchronize();
    };
    bench::Timings timings = bench::timeWallAndCpu(step, opt.steps, opt.warmup);

    std::map<std::string, std::string> common = {
        {"impl", bench::quoted("distgrad")},      {"model", bench::quoted(opt.model)},
        {"batch", std::to_string(opt.batch)},     {"input", bench::quoted(input)},
        {"classes", std::to_string(opt.classes)}, {"device", bench::quoted(device.str())},
        {"threads", std::to_string(opt.threads)}};
    bench::emit("train_step", "images_per_s", "images/s",
                bench::statsOf(bench::ratesOf(timings.wall, static_cast<double>(opt.batch))), common);
    if (!gpu) {
      // Per CPU-second of the (single) compute thread: robust to other load on a shared machine.
      bench::emit("train_step", "images_per_cpu_s", "images/cpu-s",
                  bench::statsOf(bench::ratesOf(timings.cpu, static_cast<double>(opt.batch))), common);
    }
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    double peakMiB = static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
    bench::emit("train_step", "peak_rss", "MiB", {peakMiB, peakMiB, peakMiB, 1}, common);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_train_step: error: %s\n", e.what());
    return 1;
  }
}
