// train_local: trains a LeNet-5 (ReLU + max-pool) on Fashion-MNIST in one process.
//
// This is the single-process baseline the distributed examples are measured against. It shows a progress
// bar with loss and images/s (plain periodic lines when stdout is not a terminal), evaluates on the test
// set after each epoch, saves a checkpoint atomically, and ends with one JSON line:
//   {"example":"train_local","test_accuracy":...,"images_per_s":...,"peak_rss_mib":...,...}
//
//   train_local [--epochs N] [--batch-size N] [--lr X] [--seed N] [--threads N] [--limit N]
//               [--data-dir DIR] [--checkpoint PATH]
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "models/checkpoint.h"
#include "models/data/data_loader.h"
#include "models/data/fashion_mnist.h"
#include "models/optim/adam.h"
#include "models/optim/lr_scheduler.h"
#include "models/zoo/lenet.h"
#include "tensor/cpu/dnnl_context.h"

using namespace distgrad;
namespace data = distgrad::models::data;

namespace {

struct Options {
  int64_t epochs = 3;
  int64_t batchSize = 64;
  double lr = 2e-3;
  uint64_t seed = 0;
  int threads = 1;
  int64_t limit = 0;  // use only the first N training images (0 = all); for quick runs
  std::string dataDir;
  std::string checkpoint = "checkpoints/train_local.ckpt";
};

[[noreturn]] void usage(const char* error) {
  std::cerr << "train_local: " << error << "\n"
            << "usage: train_local [--epochs N] [--batch-size N] [--lr X] [--seed N] [--threads N] [--limit N]\n"
            << "                   [--data-dir DIR] [--checkpoint PATH]\n";
  std::exit(2);
}

Options parseArgs(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value for " + arg).c_str());
      return argv[++i];
    };
    try {
      if (arg == "--epochs") o.epochs = std::stoll(value());
      else if (arg == "--batch-size") o.batchSize = std::stoll(value());
      else if (arg == "--lr") o.lr = std::stod(value());
      else if (arg == "--seed") o.seed = std::stoull(value());
      else if (arg == "--threads") o.threads = std::stoi(value());
      else if (arg == "--limit") o.limit = std::stoll(value());
      else if (arg == "--data-dir") o.dataDir = value();
      else if (arg == "--checkpoint") o.checkpoint = value();
      else if (arg == "-h" || arg == "--help") usage("help");
      else usage(("unknown argument " + arg).c_str());
    } catch (const std::logic_error&) {
      usage(("bad value for " + arg).c_str());
    }
  }
  if (o.epochs < 1 || o.batchSize < 1 || o.lr <= 0 || o.threads < 1 || o.limit < 0) {
    usage("--epochs, --batch-size, --threads must be >= 1, --lr > 0, --limit >= 0");
  }
  return o;
}

double peakRssMiB() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
}

// A progress bar on terminals; a line every ~2 s otherwise (logs stay readable).
class Progress {
 public:
  Progress(int64_t epoch, int64_t epochs, int64_t total)
      : epoch_(epoch), epochs_(epochs), total_(total), tty_(isatty(STDOUT_FILENO) != 0),
        start_(std::chrono::steady_clock::now()), lastPrint_(start_) {}

  void update(int64_t done, int64_t images, double loss) {
    auto now = std::chrono::steady_clock::now();
    double sinceLast = std::chrono::duration<double>(now - lastPrint_).count();
    bool last = done == total_;
    if (!last && sinceLast < (tty_ ? 0.1 : 2.0)) return;
    lastPrint_ = now;
    double elapsed = std::chrono::duration<double>(now - start_).count();
    double rate = elapsed > 0 ? static_cast<double>(images) / elapsed : 0.0;
    if (tty_) {
      constexpr int kWidth = 30;
      int filled = static_cast<int>(kWidth * done / std::max<int64_t>(total_, 1));
      std::printf("\repoch %lld/%lld [%s%s] %lld/%lld loss %.4f %.0f img/s", static_cast<long long>(epoch_),
                  static_cast<long long>(epochs_), std::string(filled, '#').c_str(),
                  std::string(kWidth - filled, '.').c_str(), static_cast<long long>(done),
                  static_cast<long long>(total_), loss, rate);
      if (last) std::printf("\n");
    } else {
      std::printf("epoch %lld/%lld batch %lld/%lld loss %.4f %.0f img/s\n", static_cast<long long>(epoch_),
                  static_cast<long long>(epochs_), static_cast<long long>(done), static_cast<long long>(total_),
                  loss, rate);
    }
    std::fflush(stdout);
  }

 private:
  int64_t epoch_, epochs_, total_;
  bool tty_;
  std::chrono::steady_clock::time_point start_, lastPrint_;
};

double evaluate(models::Module& model, const data::TensorDataset& testSet) {
  autograd::NoGradGuard noGrad;
  model.eval();
  data::DataLoader loader(testSet, {.batchSize = 1000});
  int64_t correct = 0;
  int64_t seen = 0;
  for (const auto& batch : loader) {
    Tensor predicted = argmax(model.forward(batch.inputs), 1);
    correct += static_cast<int64_t>(sum(eq(predicted, batch.labels)).item());
    seen += batch.size();
  }
  model.train();
  return seen > 0 ? static_cast<double>(correct) / static_cast<double>(seen) : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt = parseArgs(argc, argv);
  try {
    tensor::setNumThreads(opt.threads);
    data::TensorDataset trainSet = data::FashionMnist::load(data::Split::kTrain, opt.dataDir);
    data::TensorDataset testSet = data::FashionMnist::load(data::Split::kTest, opt.dataDir);
    if (opt.limit > 0 && opt.limit < trainSet.size()) {
      trainSet = data::TensorDataset(narrow(trainSet.inputs(), 0, 0, opt.limit),
                                     narrow(trainSet.labels(), 0, 0, opt.limit));
    }
    std::printf("train_local: Fashion-MNIST %lld train / %lld test images, LeNet-5, Adam lr %g, batch %lld, "
                "%d thread(s)\n",
                static_cast<long long>(trainSet.size()), static_cast<long long>(testSet.size()), opt.lr,
                static_cast<long long>(opt.batchSize), opt.threads);

    tensor::Generator gen(opt.seed);
    auto model = std::make_shared<models::LeNet5>(gen);
    models::optim::Adam optimizer(model->parameters(), {.learningRate = opt.lr});
    models::optim::CosineAnnealingLR schedule(optimizer, opt.epochs);
    data::DataLoader loader(trainSet, {.batchSize = opt.batchSize, .shuffle = true, .seed = opt.seed});

    double trainSeconds = 0;
    int64_t trainImages = 0;
    double accuracy = 0;
    for (int64_t epoch = 1; epoch <= opt.epochs; ++epoch) {
      Progress progress(epoch, opt.epochs, loader.numBatches());
      auto t0 = std::chrono::steady_clock::now();
      int64_t done = 0;
      int64_t images = 0;
      double runningLoss = 0;
      for (const auto& batch : loader) {
        Tensor loss = crossEntropy(model->forward(batch.inputs), batch.labels);
        optimizer.zeroGrad();
        distgrad::backward(loss);
        optimizer.step();
        double l = loss.item();
        DG_CHECK(std::isfinite(l), "train_local: loss became ", l, " at epoch ", epoch, " batch ", done);
        runningLoss = done == 0 ? l : 0.95 * runningLoss + 0.05 * l;
        images += batch.size();
        progress.update(++done, images, runningLoss);
      }
      double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      trainSeconds += seconds;
      trainImages += images;
      schedule.step();
      accuracy = evaluate(*model, testSet);
      std::printf("epoch %lld: test accuracy %.2f%%, %.0f images/s, lr %.2g\n", static_cast<long long>(epoch),
                  100.0 * accuracy, static_cast<double>(images) / seconds, optimizer.learningRate());
      std::fflush(stdout);
    }

    std::filesystem::path ckpt(opt.checkpoint);
    if (ckpt.has_parent_path()) std::filesystem::create_directories(ckpt.parent_path());
    models::saveCheckpoint(*model, opt.checkpoint);

    std::printf(
        "{\"example\":\"train_local\",\"model\":\"lenet5\",\"epochs\":%lld,\"batch_size\":%lld,\"threads\":%d,"
        "\"train_images\":%lld,\"test_accuracy\":%.4f,\"images_per_s\":%.1f,\"peak_rss_mib\":%.1f,"
        "\"checkpoint\":\"%s\"}\n",
        static_cast<long long>(opt.epochs), static_cast<long long>(opt.batchSize), opt.threads,
        static_cast<long long>(trainSet.size()), accuracy, static_cast<double>(trainImages) / trainSeconds,
        peakRssMiB(), opt.checkpoint.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "train_local: error: " << e.what() << "\n";
    return 1;
  }
}
