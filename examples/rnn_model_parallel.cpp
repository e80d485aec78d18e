// rnn_model_parallel: an RNN split across two workers, PyTorch's "RNN model parallel" RPC tutorial done
// natively. The embedding table and the decoder live on a parameter-server worker (rank 1) as RemoteModules;
// the LSTM lives on the trainer (rank 0), which drives:
//   tokens --rpc--> Embedding (worker1) --> LSTM (worker0) --rpc--> Linear decoder (worker1) --> loss (worker0)
// Every step runs in a distributed autograd context: ctx.backward(loss) sends the gradients back over both
// RPC edges, and one DistributedOptimizer (Adam) steps the server's embedding and decoder (through their
// parameter RRefs) and the trainer's LSTM.
//
// Data: real Fashion-MNIST read as token sequences. Each image row becomes one token, so an image is a
// sentence of 28 tokens: the row's 28 pixels are cut into --segments equal runs (default 7 runs of 4
// pixels), each run's mean brightness is quantised to --levels levels (default 3: dark, mid, bright), and the
// token id is those digits in base `levels` (3^7 = 2187 ids). The quantised rows keep each garment's
// silhouette (sleeves, collar, the gap between trouser legs, a shoe's sole), so the LSTM reads an image top
// to bottom like a sentence and classifies it from its last hidden state. With the defaults it reaches about
// 80% test accuracy in two epochs (78% after one; chance is 10%). Finer quantisations trained no better in
// two epochs (measured: 14 binary runs of 2 pixels, 16384 ids: 78%; 7 runs of 4 levels, 16384 ids: 80%).
//
// rpc_overhead_share is measured, not assumed: the trainer times its own compute in every step (LSTM
// forward and loss; the local parts of the backward, delimited by gradient hooks on the tensors where the
// backward leaves and re-enters this worker; its part of the optimizer step), and the server times its
// compute for one step of the same shapes on its real modules before each epoch (embedding and decoder
// forward + backward, and the part of its Adam update that outlasts the trainer's own). The share is the rest of the
// trainer's step wall time: serialisation, transport, queueing and waiting, divided by the step time.
//
// Run it on two local workers:
//   build/tools/distgrad-run --nproc 2 -- build/examples/rnn_model_parallel [--epochs N] [--batch-size N]
//       [--lr X] [--seed N] [--limit N] [--data-dir DIR] [--threads N] [--embedding-dim N] [--hidden N]
//       [--segments N] [--levels N]
// The last line rank 0 prints is {"example":"rnn_model_parallel","mode":"rnn_mp",...}.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "autograd/engine.h"
#include "autograd/ops.h"
#include "examples/example_util.h"
#include "examples/remote_modules.h"
#include "models/data/data_loader.h"
#include "models/data/fashion_mnist.h"
#include "models/nn/embedding.h"
#include "models/nn/linear.h"
#include "models/nn/lstm.h"
#include "models/optim/adam.h"
#include "models/optim/distributed_optimizer.h"
#include "rpc/agent.h"
#include "rref/remote_module.h"
#include "tensor/cpu/dnnl_context.h"

using namespace distgrad;
using models::Embedding;
using models::Linear;
using Clock = std::chrono::steady_clock;

// What both workers declare: the example's own functions (the server's module classes are in
// examples/remote_modules.h, shared with rpc_ddp_hybrid).
namespace rnn {
// Peak RSS of the worker that serves it (MiB).
inline const rpc::Function<double()> kPeakRss{"rnn.peak_rss_mib"};
// Times the server's compute of one training step on its own modules: {forward + backward seconds,
// optimizer-update seconds} (medians over `reps`), for tokens [T, N] and decoder inputs [N, H].
inline const rpc::Function<std::vector<double>(rref::RemoteModule<Embedding>, rref::RemoteModule<Linear>, Tensor,
                                               Tensor, int64_t)>
    kTimeServerStep{"rnn.time_server_step"};
}  // namespace rnn

namespace {

struct Options {
  std::string device = "cpu";  // --device
  int64_t epochs = 2;
  int64_t batchSize = 64;
  double lr = 5e-3;
  uint64_t seed = 0;
  int threads = 1;
  int64_t limit = 0;
  std::string dataDir;
  int64_t embeddingDim = 64;
  int64_t hidden = 128;
  int64_t segments = 7;
  int64_t levels = 3;
};

Options parseArgs(int argc, char** argv) {
  Options o;
  examples::Flags flags("rnn_model_parallel",
                        "embedding + decoder on a parameter server (rank 1), LSTM on the trainer (rank 0), "
                        "Fashion-MNIST rows as tokens; run with distgrad-run --nproc 2");
  flags.add("--epochs", o.epochs, "passes over the training set")
      .add("--batch-size", o.batchSize, "images (token sequences) per step")
      .add("--lr", o.lr, "Adam learning rate")
      .add("--seed", o.seed, "initialisation and shuffling seed")
      .add("--threads", o.threads, "oneDNN threads per process")
      .add("--limit", o.limit, "use only the first N training and test images (0 = all)")
      .add("--data-dir", o.dataDir, "Fashion-MNIST directory (default: the Debian package's)")
      .add("--embedding-dim", o.embeddingDim, "embedding size (server)")
      .add("--hidden", o.hidden, "LSTM hidden size (trainer)")
      .add("--segments", o.segments, "runs per image row (a divisor of 28)")
      .add("--levels", o.levels, "brightness levels per run (vocabulary = levels^segments)")
      .add("--device", o.device, examples::kDeviceHelp);
  flags.parse(argc, argv);
  (void)examples::cpuOnlyDeviceFromFlag(flags, o.device,
                                        "the embedding and decoder on the parameter server exchange host tensors "
                                        "with the trainer over RPC (CUDA tensors over RPC are issue 9's RPC part)");
  flags.require(o.epochs >= 1 && o.batchSize >= 1 && o.lr > 0 && o.threads >= 1 && o.limit >= 0,
                "--epochs, --batch-size, --threads must be >= 1, --lr > 0, --limit >= 0");
  flags.require(o.embeddingDim >= 1 && o.hidden >= 1, "--embedding-dim and --hidden must be >= 1");
  flags.require(o.segments >= 1 && 28 % o.segments == 0, "--segments must divide 28 (1, 2, 4, 7, 14 or 28)");
  flags.require(o.levels >= 2 && std::pow(static_cast<double>(o.levels), static_cast<double>(o.segments)) <= 1 << 20,
                "--levels must be >= 2 and levels^segments at most 2^20 (the embedding table's rows)");
  return o;
}

int64_t vocabularySize(const Options& o) {
  int64_t v = 1;
  for (int64_t s = 0; s < o.segments; ++s) v *= o.levels;
  return v;
}

// Images [N, 1, 28, 28] (normalised) -> token ids [N, 28]: one token per row (see the file comment).
Tensor tokenize(const Tensor& images, const Options& o) {
  using models::data::FashionMnist;
  const int64_t n = images.size(0);
  const int64_t run = 28 / o.segments;
  const std::vector<float> pixels = contiguous(images).toVector<float>();
  std::vector<int64_t> tokens(static_cast<size_t>(n * 28));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t row = 0; row < 28; ++row) {
      const float* p = pixels.data() + (i * 28 + row) * 28;
      int64_t token = 0;
      for (int64_t s = o.segments - 1; s >= 0; --s) {
        double mean = 0;
        for (int64_t k = 0; k < run; ++k) mean += p[s * run + k] * FashionMnist::kStd + FashionMnist::kMean;
        mean /= static_cast<double>(run);
        const int64_t level =
            std::clamp<int64_t>(static_cast<int64_t>(mean * static_cast<double>(o.levels)), 0, o.levels - 1);
        token = token * o.levels + level;
      }
      tokens[static_cast<size_t>(i * 28 + row)] = token;
    }
  }
  return Tensor::fromVector(tokens, {n, 28});
}

models::data::TensorDataset tokenized(const models::data::TensorDataset& set, const Options& o) {
  return models::data::TensorDataset(tokenize(set.inputs(), o), set.labels());
}

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Server side of kTimeServerStep: one step's worth of the server's compute, on its real modules.
std::vector<double> timeServerStep(const rref::RemoteModule<Embedding>& embeddingModule,
                                   const rref::RemoteModule<Linear>& decoderModule, const Tensor& tokens,
                                   const Tensor& hidden, int64_t reps) {
  std::shared_ptr<Embedding> embedding = embeddingModule.moduleRRef().localValue();
  std::shared_ptr<Linear> decoder = decoderModule.moduleRRef().localValue();
  std::vector<Tensor> params = embedding->parameters();
  for (const Tensor& p : decoder->parameters()) params.push_back(p);
  // The update runs on copies: timing must not change the model being trained.
  std::vector<Tensor> copies;
  for (const Tensor& p : params) copies.push_back(p.cloneData().setRequiresGrad(true));
  models::optim::Adam adam(copies, {});
  const Tensor input = hidden.detach().setRequiresGrad(true);
  std::vector<double> forwardBackward, update;
  for (int64_t r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    Tensor embedded = embedding->forward(tokens);
    Tensor logits = decoder->forward(input);
    std::vector<Tensor> grads =
        autograd::grad({embedded, logits}, params, {Tensor::ones(embedded.shape()), Tensor::ones(logits.shape())});
    const auto t1 = Clock::now();
    adam.step(grads);
    const auto t2 = Clock::now();
    forwardBackward.push_back(seconds(t0, t1));
    update.push_back(seconds(t1, t2));
  }
  return {median(forwardBackward), median(update)};
}

// Where the trainer's step time goes, summed over an epoch.
struct StepTimes {
  double step = 0;            // wall time of whole steps
  double trainerCompute = 0;  // the trainer's own compute inside them
  double serverCompute = 0;   // the server's compute per step (measured there) times the steps
  int64_t steps = 0;
};

int runTrainer(rpc::Agent& agent, const Options& opt) {
  examples::Data data = examples::loadFashionMnist(opt.dataDir, opt.limit);
  const models::data::TensorDataset trainSet = tokenized(data.train, opt);
  const models::data::TensorDataset testSet = tokenized(data.test, opt);
  const int64_t vocab = vocabularySize(opt);
  std::printf(
      "rnn_model_parallel: Fashion-MNIST %lld train / %lld test images as 28-token sequences "
      "(vocabulary %lld); Embedding(%lld, %lld) + Linear(%lld, 10) on worker1, LSTM(%lld -> %lld) on "
      "worker0; Adam lr %g, batch %lld\n",
      static_cast<long long>(trainSet.size()), static_cast<long long>(testSet.size()), static_cast<long long>(vocab),
      static_cast<long long>(vocab), static_cast<long long>(opt.embeddingDim), static_cast<long long>(opt.hidden),
      static_cast<long long>(opt.embeddingDim), static_cast<long long>(opt.hidden), opt.lr,
      static_cast<long long>(opt.batchSize));

  // The server's modules, built there from the seed; the LSTM here.
  auto rrefs = rref::RRefContext::of(agent);
  auto embedding = rref::RemoteModule<Embedding>::create(rrefs, "worker1", vocab, opt.embeddingDim, opt.seed);
  auto decoder = rref::RemoteModule<Linear>::create(rrefs, "worker1", opt.hidden, int64_t{10}, opt.seed + 1);
  tensor::Generator gen(opt.seed + 2);
  auto lstm = std::make_shared<models::LSTM>(opt.embeddingDim, opt.hidden, gen);

  std::vector<rref::RRef<Tensor>> remoteParams = embedding.remoteParameters();
  for (auto& p : decoder.remoteParameters()) remoteParams.push_back(std::move(p));
  models::optim::DistributedOptimizer optimizer(agent, models::optim::OptimizerSpec::adam({.learningRate = opt.lr}),
                                                remoteParams, lstm->parameters());

  // Logits for token ids [N, 28]: embedding (remote), LSTM (here), decoder on the last hidden state (remote).
  auto predict = [&](const Tensor& tokens) {
    Tensor embedded = embedding.forward(contiguous(transpose(tokens, 0, 1)));
    return decoder.forward(select(lstm->forwardWithState(embedded).state.h, 0, lstm->numLayers() - 1));
  };

  models::data::DataLoader loader(trainSet, {.batchSize = opt.batchSize, .shuffle = true, .seed = opt.seed});
  double trainSeconds = 0;
  int64_t trainImages = 0;
  double accuracy = 0;
  StepTimes total;
  for (int64_t epoch = 1; epoch <= opt.epochs; ++epoch) {
    const std::string label = "epoch " + std::to_string(epoch) + "/" + std::to_string(opt.epochs);
    examples::Progress progress(label, loader.numBatches());
    examples::RunningLoss runningLoss;
    // The server's compute for one step of these shapes, measured there on its real modules: {forward +
    // backward, optimizer update} seconds.
    const models::data::TensorDataset sample = trainSet.slice(0, std::min(opt.batchSize, trainSet.size()));
    const std::vector<double> server =
        agent.rpcSync("worker1", rnn::kTimeServerStep, embedding, decoder, contiguous(transpose(sample.inputs(), 0, 1)),
                      Tensor::zeros({sample.size(), opt.hidden}), int64_t{20});
    StepTimes times;
    int64_t done = 0;
    int64_t images = 0;
    const auto epochStart = Clock::now();
    for (const auto& batch : loader) {
      // Moments of the step; the backward's are stamped by gradient hooks (on whichever thread runs them).
      Clock::time_point t0, embedded0, lstm0, decoder0, loss0, backward0, step0, step1;
      std::atomic<Clock::rep> decoderGradOut{0}, hiddenGradIn{0}, embeddedGradOut{0};
      auto stampInto = [](std::atomic<Clock::rep>& slot) {
        return [&slot](const Tensor& grad) {
          slot.store(Clock::now().time_since_epoch().count());
          return grad;
        };
      };
      Tensor loss;
      {
        t0 = Clock::now();
        autograd::distributed::DistContext ctx(agent);
        const Tensor sequence = contiguous(transpose(batch.inputs, 0, 1));  // [T, N]: the LSTM's layout
        embedded0 = Clock::now();
        Tensor embedded = embedding.forward(sequence);  // [T, N, E], computed on worker1
        lstm0 = Clock::now();
        Tensor last = select(lstm->forwardWithState(embedded).state.h, 0, lstm->numLayers() - 1);  // [N, H]
        decoder0 = Clock::now();
        Tensor logits = decoder.forward(last);  // [N, 10], computed on worker1
        loss0 = Clock::now();
        loss = crossEntropy(logits, batch.labels);
        logits.registerHook(stampInto(decoderGradOut));     // the loss's backward done: off to worker1
        last.registerHook(stampInto(hiddenGradIn));         // worker1's gradient is back: the LSTM's turn
        embedded.registerHook(stampInto(embeddedGradOut));  // the LSTM's backward done: off to worker1
        backward0 = Clock::now();
        ctx.backward(loss);
        step0 = Clock::now();
        rpc::Future<void> update = optimizer.stepAsync(ctx.id());  // this worker's part runs before it returns
        step1 = Clock::now();
        update.get();
      }
      auto stamped = [](const std::atomic<Clock::rep>& slot) {
        return Clock::time_point(Clock::duration(slot.load()));
      };
      const double trainerCompute = seconds(t0, embedded0) + seconds(lstm0, decoder0) + seconds(loss0, backward0) +
                                    seconds(backward0, stamped(decoderGradOut)) +
                                    seconds(stamped(hiddenGradIn), stamped(embeddedGradOut)) + seconds(step0, step1);
      times.step += seconds(t0, Clock::now());
      times.trainerCompute += trainerCompute;
      // The server updates its parameters while this worker updates the LSTM: only the part of its update
      // that outlasts ours is on the step's critical path.
      times.serverCompute += server.at(0) + std::max(0.0, server.at(1) - seconds(step0, step1));
      ++times.steps;
      images += batch.size();
      ++done;
      progress.update(done, images, runningLoss.add(loss.item(), label + " batch " + std::to_string(done)));
    }
    const double epochSeconds = examples::secondsSince(epochStart);
    trainSeconds += epochSeconds;
    trainImages += images;

    total.step += times.step;
    total.trainerCompute += times.trainerCompute;
    total.serverCompute += times.serverCompute;
    total.steps += times.steps;

    lstm->eval();
    accuracy = examples::testAccuracy(predict, testSet);
    lstm->train();
    const double overhead = 1.0 - (times.trainerCompute + times.serverCompute) / times.step;
    std::printf(
        "epoch %lld: test accuracy %.2f%%, %.0f images/s, step %.2f ms (trainer compute %.0f%%, server "
        "compute %.0f%%, rpc overhead %.0f%%)\n",
        static_cast<long long>(epoch), 100.0 * accuracy, static_cast<double>(images) / epochSeconds,
        1e3 * times.step / static_cast<double>(times.steps), 100.0 * times.trainerCompute / times.step,
        100.0 * times.serverCompute / times.step, 100.0 * overhead);
    std::fflush(stdout);
  }

  const double serverRss = agent.rpcSync("worker1", rnn::kPeakRss);
  const double rss = examples::peakRssMiB();
  examples::JsonLine("rnn_model_parallel")
      .add("mode", "rnn_mp")
      .add("workers", int64_t{2})
      .add("model", "embedding(" + std::to_string(vocab) + "x" + std::to_string(opt.embeddingDim) + ")+lstm(" +
                        std::to_string(opt.hidden) + ")+linear(10)")
      .add("epochs", opt.epochs)
      .add("batch_size", opt.batchSize)
      .add("threads", opt.threads)
      .add("train_images", trainSet.size())
      .add("images_per_s", static_cast<double>(trainImages) / trainSeconds)
      .add("test_accuracy", accuracy)
      .add("step_ms", 1e3 * total.step / static_cast<double>(total.steps))
      .add("trainer_compute_share", total.trainerCompute / total.step)
      .add("server_compute_share", total.serverCompute / total.step)
      .add("rpc_overhead_share", 1.0 - (total.trainerCompute + total.serverCompute) / total.step)
      .add("peak_rss_mib", rss)
      .add("peak_rss_mib_max", std::max(rss, serverRss))
      .print();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options opt = parseArgs(argc, argv);
  try {
    tensor::setNumThreads(opt.threads);
    rpc::Registry reg;
    examples::installRemoteModules(reg);  // RRefs, distributed autograd, the server's Embedding and Linear
    reg.bind(rnn::kPeakRss, [] { return examples::peakRssMiB(); });
    reg.bind(rnn::kTimeServerStep, &timeServerStep);
    auto agent = rpc::Agent::start(rpc::Options::fromEnv(), reg);
    if (agent->worldSize() != 2) {
      std::cerr << "rnn_model_parallel: needs exactly 2 workers (trainer + parameter server), got "
                << agent->worldSize() << ": run it with distgrad-run --nproc 2\n";
      agent->shutdown(false);
      return 2;
    }
    int status = 0;
    if (agent->rank() == 0) {
      status = runTrainer(*agent, opt);
    }
    agent->shutdown();  // rank 1 serves until rank 0 is done: the graceful shutdown is a barrier of both
    return status;
  } catch (const std::exception& e) {
    std::cerr << "rnn_model_parallel: error: " << e.what() << "\n";
    return 1;
  }
}
