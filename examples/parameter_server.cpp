// parameter_server: one parameter server and N trainers on Fashion-MNIST, synchronous or asynchronous
// (PyTorch's "parameter server with RPC" tutorial, with its batched-update variant).
//
//   build/tools/distgrad-run --nproc 3 -- build/examples/parameter_server --mode ssgd   # server + 2 trainers
//   build/tools/distgrad-run --nproc 5 -- build/examples/parameter_server --mode asgd   # server + 4 trainers
//   build/examples/parameter_server --mode local --batch-size 64                       # the 1-process reference
//
// Rank 0 is the server: it owns the model (any model of the zoo, built from a models/pipeline/model_spec.h
// ModelSpec like the other examples', so bench/modes.cpp compares every mode on the same network: --model
// lenet5 (the default here), mlp, resnet18 or resnet50, --width for the ResNets) and its optimizer, tests the model
// after every epoch and prints the summary and the final JSON line. Ranks 1..N are trainers; trainer i trains on shard
// i of each epoch's shuffled order (DistributedSampler: positions i, i + N, i + 2N, ...). Trainer 1 shows a progress
// bar; the others are quiet.
//
// Design. Each trainer keeps a replica of the model, runs forward and backward locally, and sends its
// gradients in ONE call, kPush, whose reply is the server's new parameters, which it copies into its replica:
// one round trip of parameter-sized messages per step, the least a parameter server can do. (Running the
// forward through a RemoteModule would put every trainer's compute on the server's cores and ship activations
// both ways; fetching the parameters in a call of their own would add a round trip per step.)
//   ssgd: kPush is an async handler. It hands the gradients to a GradientAggregator
//     (models/optim/gradient_aggregator.h) and returns the aggregator's future: the call stays open, but no
//     executor thread waits. When the last trainer's gradients of step k arrive, that handler's thread
//     averages them (weighted by batch size, summed in trainer order, so runs are reproducible), takes ONE
//     optimizer step and completes every trainer's future with the same new parameters. With batch b per
//     trainer, step k's N batches are exactly positions kNb .. (k+1)Nb - 1 of the epoch's order (when N divides
//     the training set): the batch of `--mode local --batch-size N*b` with the same seed, so SSGD takes the
//     single worker's steps up to float rounding (with one trainer, bit for bit the same run);
//     tests/examples/check_parameter_server_target.sh checks the accuracies agree.
//   asgd: kPush applies the trainer's gradients on arrival, one optimizer step each, serialised by a mutex
//     (held for one step and a parameter copy, well under a millisecond), and replies with the latest
//     parameters and their version. Staleness = steps other trainers applied between the version a trainer
//     computed its gradients on and the step that applies them.
// Buffers. BatchNorm's running mean and variance (and num_batches_tracked) change only in a training forward,
// which runs on the trainers, never on the server; left alone, the server's buffers would keep their initial
// values and its eval-mode test accuracy would be wrong. So kPush also carries the trainer's buffers (after its
// forward), the server updates its own from them, and every reply carries parameters AND buffers, which the
// trainer copies into its replica (so each step starts from the server's buffers).
//   ssgd: the aggregator merges the round's buffers like the gradients (weighted by batch size, in trainer
//     order; integer buffers take the maximum): since every trainer started the step from the server's
//     buffers, the merged running mean is exactly the single worker's with the union batch, the running
//     variance averages the trainers' batch variances (close, not exact), num_batches_tracked advances by one.
//   asgd: the server takes the pushing trainer's floating buffers (integer ones: the larger of the server's and
//     the trainer's, so a counter never goes back). Why not average or add deltas: running statistics are an
//     exponential average over ~1/momentum = 10 batches, far longer than the staleness of a push, so the newest
//     trainer's estimate (the server's buffers of a recent version plus its latest batch) is as good as any, is
//     a state a replica really had, and costs nothing to keep; the batches of other trainers it overwrites only
//     make the average forget slightly sooner.
// A reply carries a copy of the parameters (and buffers) taken under the step: it is encoded after the handler returns,
// when another step may already be updating the parameters in place. Each epoch ends at a barrier (kEpochEnd):
// trainers report images, loss, compute and RPC time and peak RSS, the server's main thread tests the model
// (quiescent: every trainer is waiting) and answers with the accuracy.
//
// Failures. The calls that wait for other trainers (kJoin, kEpochEnd, kPush in ssgd) have no deadline, since a
// slow trainer is legitimate; liveness comes from the agent instead. When a trainer's connection closes or its
// heartbeats stop, the server fails the open step and barrier with an error naming it: the other trainers'
// calls fail with that error, every process exits 1, and the server prints which trainer left (ssgd cannot
// complete a step without it; asgd cannot end the epoch). When the server dies, trainers' calls fail with
// `disconnected`. tests/examples/check_parameter_server_fault.sh kills a trainer mid-run to check this.
//
// rpc_overhead_share: per trainer step, compute = batch gathering, forward, backward; rpc = from sending kPush
// until the new parameters are in the replica (the server's step and, in ssgd, waiting for the slowest trainer
// included). The share is sum(rpc) / sum(rpc + compute) over every trainer and step, measured. server_wait_share
// is the part of it spent inside the server's kPush (waiting for the other trainers in ssgd, for the step lock
// in asgd, the step itself); the rest is the wire: encoding, transport, decoding, copying the parameters in.
//
// The server's last line: {"example":"parameter_server","mode":"ps_ssgd"|"ps_asgd"|"local","workers":N+1,
// "trainers":N,"model","width",...,"batch_size" (per trainer),"global_batch","steps" (optimizer steps),
// "test_accuracy","images_per_s" (all trainers),"peak_rss_mib" (server),"peak_rss_mib_max" (every process),
// "rpc_overhead_share","server_wait_share","staleness_mean","staleness_max"}.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "examples/example_util.h"
#include "models/data/sampler.h"
#include "models/optim/adam.h"
#include "models/optim/gradient_aggregator.h"
#include "models/optim/sgd.h"
#include "models/pipeline/model_spec.h"
#include "rpc/agent.h"
#include "tensor/cpu/dnnl_context.h"

using namespace distgrad;
namespace data = distgrad::models::data;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  std::string mode = "ssgd";  // ssgd | asgd | local
  std::string model = "lenet5";
  int64_t width = 16;  // ResNets' base width
  std::string optimizer = "adam";
  int64_t epochs = 3;
  int64_t batchSize = 32;  // per trainer
  double lr = 2e-3;
  double momentum = 0.9;
  uint64_t seed = 0;
  int threads = 1;
  int64_t limit = 0;
  std::string dataDir;
  std::string device = "cpu";
};

Options parseArgs(int argc, char** argv) {
  Options o;
  examples::Flags flags("parameter_server", "a parameter server (rank 0) and trainers (ranks 1..N) on Fashion-MNIST");
  flags.add("--mode", o.mode, "ssgd (synchronous), asgd (asynchronous) or local (one process, no RPC)")
      .add("--model", o.model, "lenet5 | mlp | resnet18 | resnet50")
      .add("--width", o.width, "ResNet base width (torchvision's is 64)")
      .add("--optimizer", o.optimizer, "adam or sgd (momentum --momentum) on the server")
      .add("--epochs", o.epochs, "passes over the training set")
      .add("--batch-size", o.batchSize, "images per step per trainer")
      .add("--lr", o.lr, "learning rate (try 0.05 with --optimizer sgd)")
      .add("--momentum", o.momentum, "SGD momentum")
      .add("--seed", o.seed, "initialisation and shuffling seed")
      .add("--threads", o.threads, "oneDNN threads per process")
      .add("--limit", o.limit, "use only the first N training and test images (0 = all)")
      .add("--data-dir", o.dataDir, "Fashion-MNIST directory (default: the Debian package's)")
      .add("--device", o.device, examples::kDeviceHelp);
  flags.parse(argc, argv);
  (void)examples::cpuOnlyDeviceFromFlag(flags, o.device,
                                        "the trainers' gradients travel to the server as host tensors (CUDA "
                                        "tensors over RPC are issue 9's RPC part)");
  flags.require(o.mode == "ssgd" || o.mode == "asgd" || o.mode == "local", "--mode must be ssgd, asgd or local");
  flags.require(o.model == "lenet5" || o.model == "mlp" || o.model == "resnet18" || o.model == "resnet50",
                "--model must be lenet5, mlp, resnet18 or resnet50");
  flags.require(o.optimizer == "adam" || o.optimizer == "sgd", "--optimizer must be adam or sgd");
  flags.require(o.epochs >= 1 && o.batchSize >= 1 && o.width >= 1 && o.lr > 0 && o.momentum >= 0 && o.threads >= 1 &&
                    o.limit >= 0,
                "--epochs, --batch-size, --width, --threads must be >= 1, --lr > 0, --momentum and --limit >= 0");
  return o;
}

models::pipeline::ModelSpec modelSpec(const Options& o) {
  models::pipeline::ModelSpec spec;
  spec.name = o.model;
  spec.baseWidth = o.width;
  spec.seed = o.seed;
  return spec;
}

// The same initial weights in every process (built from --seed): the trainers' replicas start equal to the
// server's model even before the first reply overwrites them.
std::shared_ptr<models::Module> makeModel(const Options& o) { return models::pipeline::buildModel(modelSpec(o)); }

std::unique_ptr<models::optim::Optimizer> makeOptimizer(const Options& o, std::vector<Tensor> params) {
  if (o.optimizer == "sgd") {
    return std::make_unique<models::optim::SGD>(
        std::move(params), models::optim::SgdOptions{.learningRate = o.lr, .momentum = o.momentum});
  }
  return std::make_unique<models::optim::Adam>(std::move(params), models::optim::AdamOptions{.learningRate = o.lr});
}

// ---- what trainers call on the server ----
struct Params {  // one version of the server's parameters and buffers
  int64_t version = 0;
  std::vector<Tensor> tensors;
  std::vector<Tensor> buffers;  // model->buffers() order (BatchNorm statistics; empty for lenet5 and mlp)
  template <class V>
  void visitFields(V& v) {
    v("version", version);
    v("tensors", tensors);
    v("buffers", buffers);
  }
};
// One epoch of one trainer (or, summed by the server, of all of them). The server adds `seconds`, its wall
// clock for the epoch, and `serverSeconds`, the part of the trainers' rpcSeconds their kPush calls spent in the
// server (waiting for the other trainers in ssgd, for the step lock in asgd, and the step itself).
struct EpochReport {
  int64_t steps = 0, images = 0;
  double lossSum = 0, computeSeconds = 0, rpcSeconds = 0, peakRssMiB = 0;
  double seconds = 0, serverSeconds = 0;  // filled in by the server
  template <class V>
  void visitFields(V& v) {
    v("steps", steps);
    v("images", images);
    v("loss_sum", lossSum);
    v("compute_s", computeSeconds);
    v("rpc_s", rpcSeconds);
    v("peak_rss_mib", peakRssMiB);
    v("seconds", seconds);
    v("server_s", serverSeconds);
  }
  void add(const EpochReport& r) {
    steps += r.steps, images += r.images, lossSum += r.lossSum, computeSeconds += r.computeSeconds;
    rpcSeconds += r.rpcSeconds, peakRssMiB = std::max(peakRssMiB, r.peakRssMiB);
    seconds += r.seconds, serverSeconds += r.serverSeconds;
  }
  double rpcShare() const { return rpcSeconds / std::max(rpcSeconds + computeSeconds, 1e-12); }
  double serverShare() const { return serverSeconds / std::max(rpcSeconds + computeSeconds, 1e-12); }
};
const std::string kServer = "worker0";
const rpc::Function<Params(int64_t, int64_t)> kJoin{"ps.join"};  // (trainer, steps per epoch) -> version 0
// (trainer, version, batch, gradients, buffers) -> the new parameters and buffers
const rpc::Function<Params(int64_t, int64_t, int64_t, std::vector<Tensor>, std::vector<Tensor>)> kPush{"ps.push"};
const rpc::Function<double(int64_t, EpochReport)> kEpochEnd{"ps.epoch_end"};  // -> test accuracy
const rpc::CallOptions kNoDeadline = [] {
  rpc::CallOptions options;
  options.timeout = std::chrono::milliseconds(-1);
  return options;
}();

// A barrier for N parties that holds no thread per waiting caller: arrive() (from a handler) returns a future;
// the main thread waits for all N with waitAll(), does the epoch's work, and answers everyone with release().
// fail() answers the waiting and every later caller with an error, and makes waitAll() throw it.
template <typename In, typename Out>
class Barrier {
 public:
  explicit Barrier(int64_t parties) : slots_(static_cast<size_t>(parties)) {}

  rpc::Future<Out> arrive(rpc::Executor& executor, int64_t party, In value) {
    rpc::Promise<Out> promise(executor);
    rpc::Future<Out> future = promise.getFuture();
    std::lock_guard<std::mutex> lock(mutex_);
    if (failed_) {
      promise.setError(*failed_);
    } else if (party < 0 || party >= static_cast<int64_t>(slots_.size()) || slots_[static_cast<size_t>(party)]) {
      promise.setError(rpc::Error::failed("trainer " + std::to_string(party + 1) + " is unknown or arrived twice"));
    } else {
      slots_[static_cast<size_t>(party)].emplace(std::move(value), std::move(promise));
      if (++arrived_ == static_cast<int64_t>(slots_.size())) {
        lastArrival_ = Clock::now();
        changed_.notify_all();
      }
    }
    return future;
  }
  std::vector<In> waitAll() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return failed_ || arrived_ == static_cast<int64_t>(slots_.size()); });
    if (failed_) throw rpc::RpcError(*failed_);
    std::vector<In> values;
    for (auto& slot : slots_) values.push_back(slot->first);
    return values;
  }
  void release(const Out& answer) {
    for (auto& promise : take()) promise.setValue(answer);
  }
  void fail(const rpc::Error& error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failed_) return;
      failed_ = error;
      changed_.notify_all();
    }
    for (auto& promise : take()) promise.setError(error);
  }
  Clock::time_point lastArrival() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return lastArrival_;
  }

 private:
  std::vector<rpc::Promise<Out>> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<rpc::Promise<Out>> out;
    for (auto& slot : slots_) {
      if (slot) out.push_back(std::move(slot->second));
      slot.reset();
    }
    arrived_ = 0;
    return out;
  }
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::optional<std::pair<In, rpc::Promise<Out>>>> slots_;
  int64_t arrived_ = 0;
  Clock::time_point lastArrival_;
  std::optional<rpc::Error> failed_;
};

// The server's state, shared by its handlers (executor threads) and its main thread.
struct Server {
  Server(const Options& o, int64_t numTrainers)
      : trainers(numTrainers),
        model(makeModel(o)),
        params(model->parameters()),
        buffers(model->buffers()),
        optimizer(makeOptimizer(o, params)),
        aggregator(numTrainers, models::optim::GradientAggregator<Params>::ApplyWithBuffers(
                                    [this](std::vector<Tensor> avg, std::vector<Tensor> merged, int64_t round) {
                                      return step(avg, merged, round, /*synchronous=*/true);
                                    })),
        joins(numTrainers),
        epochEnds(numTrainers) {}

  // One optimizer step from `grads` computed on parameters of `version`, and the buffers taken from
  // `newBuffers` (ssgd: the round's merged buffers; asgd: the pushing trainer's, integer ones never going
  // back); the new parameters and buffers, copied. Callers serialise it (the aggregator runs one round at a
  // time; asgd holds stepMutex).
  Params step(const std::vector<Tensor>& grads, const std::vector<Tensor>& newBuffers, int64_t version,
              bool synchronous) {
    if (auto problem = models::optim::gradientMismatch(params, grads)) DG_CHECK(false, "bad gradients: ", *problem);
    if (auto problem = models::optim::bufferMismatch(buffers, newBuffers)) DG_CHECK(false, "bad buffers: ", *problem);
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (synchronous || tensor::isFloatingPoint(buffers[i].dtype())) {
        buffers[i].copyFrom(newBuffers[i]);
      } else {
        buffers[i].copyFrom(models::optim::averageBuffers({{buffers[i]}, {newBuffers[i]}}, {1.0, 1.0})[0]);  // max
      }
    }
    const int64_t behind = currentVersion - version;
    DG_CHECK(behind >= 0, "gradients of version ", version, ", but the parameters are at version ", currentVersion);
    stalenessSum += behind, stalenessMax = std::max(stalenessMax, behind);
    optimizer->step(grads);
    ++currentVersion;
    return snapshot();
  }
  Params snapshot() const {
    Params p{currentVersion, {}, {}};
    for (const Tensor& t : params) p.tensors.push_back(t.cloneData());
    for (const Tensor& t : buffers) p.buffers.push_back(t.cloneData());
    return p;
  }
  int64_t steps() const { return currentVersion; }
  void addServerTime(Clock::time_point since) {
    serverNanos += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count();
  }

  const int64_t trainers;
  std::shared_ptr<models::Module> model;
  std::vector<Tensor> params;
  std::vector<Tensor> buffers;  // the model's; written only by step()
  std::unique_ptr<models::optim::Optimizer> optimizer;
  std::mutex stepMutex;        // asgd: one step at a time
  int64_t currentVersion = 0;  // steps taken (guarded by the aggregator's rounds or stepMutex)
  int64_t stalenessSum = 0, stalenessMax = 0;
  models::optim::GradientAggregator<Params> aggregator;  // ssgd
  Barrier<int64_t, Params> joins;                        // (steps per epoch) -> version 0
  Barrier<EpochReport, double> epochEnds;                // -> test accuracy
  std::atomic<int64_t> serverNanos{0};                   // kPush time in the server, this epoch
  std::atomic<bool> finished{false};                     // trainers leaving afterwards is no failure
};

// Tells the server when a trainer's connection closes or its heartbeats stop.
class TrainerWatch : public rpc::AgentExtension {
 public:
  explicit TrainerWatch(Server& server, bool synchronous) : server_(server), synchronous_(synchronous) {}
  void onPeerDown(const std::string& peer, const rpc::Error& error) override {
    if (server_.finished) return;
    rpc::Error left = rpc::Error::disconnected(
        "trainer " + peer + " left the job (" + error.message + "); " +
        (synchronous_ ? "synchronous training cannot take a step without it" : "the epoch cannot end without it"));
    left.worker = peer;
    server_.aggregator.abort(left);
    server_.joins.fail(left);
    server_.epochEnds.fail(left);
  }

 private:
  Server& server_;
  bool synchronous_;
};

void bindServer(rpc::Registry& reg, Server& s, bool synchronous) {
  reg.bind(kJoin, [&s](const rpc::CallContext& ctx, int64_t trainer, int64_t stepsPerEpoch) {
    return s.joins.arrive(ctx.agent->executor(), trainer, stepsPerEpoch);
  });
  reg.bind(kEpochEnd, [&s](const rpc::CallContext& ctx, int64_t trainer, EpochReport report) {
    return s.epochEnds.arrive(ctx.agent->executor(), trainer, report);
  });
  if (synchronous) {
    reg.bind(kPush, [&s](const rpc::CallContext& ctx, int64_t trainer, int64_t version, int64_t batch,
                         std::vector<Tensor> grads, std::vector<Tensor> buffers) {
      const auto arrived = Clock::now();
      return s.aggregator
          .submit(ctx.agent->executor(), trainer, version, std::move(grads), static_cast<double>(batch),
                  std::move(buffers))
          .then(rpc::kInlineSafe, [&s, arrived](rpc::Result<Params> reply) {
            s.addServerTime(arrived);
            return reply;
          });
    });
  } else {
    reg.bind(kPush, [&s](int64_t trainer, int64_t version, int64_t batch, std::vector<Tensor> grads,
                         std::vector<Tensor> buffers) {
      const auto arrived = Clock::now();
      std::lock_guard<std::mutex> lock(s.stepMutex);
      Params latest = s.step(grads, buffers, version, /*synchronous=*/false);
      s.addServerTime(arrived);
      return latest;
    });
  }
}

void printEpoch(int64_t epoch, const Options& o, const EpochReport& t, double accuracy) {
  std::printf(
      "epoch %lld/%lld: test accuracy %.2f%%, %.0f images/s, mean loss %.4f, rpc share %.1f%% (%.1f%% in "
      "the server)\n",
      static_cast<long long>(epoch), static_cast<long long>(o.epochs), 100.0 * accuracy,
      static_cast<double>(t.images) / t.seconds, t.lossSum / static_cast<double>(std::max<int64_t>(t.steps, 1)),
      100.0 * t.rpcShare(), 100.0 * t.serverShare());
  std::fflush(stdout);
}

double evaluate(models::Module& model, const data::TensorDataset& test) {
  model.eval();
  const double accuracy = examples::testAccuracy([&](const Tensor& x) { return model.forward(x); }, test);
  model.train();
  return accuracy;
}

examples::JsonLine summary(const Options& o, const std::string& mode, int64_t workers, int64_t trainers,
                           int64_t optimizerSteps, const EpochReport& all, double accuracy) {
  examples::JsonLine json("parameter_server");
  json.add("mode", mode).add("workers", workers).add("trainers", trainers).add("model", o.model);
  json.add("width", o.width);
  json.add("optimizer", o.optimizer).add("epochs", o.epochs).add("batch_size", o.batchSize);
  json.add("global_batch", o.batchSize * trainers).add("lr", o.lr).add("train_images", all.images / o.epochs);
  json.add("steps", optimizerSteps).add("test_accuracy", accuracy);
  json.add("images_per_s", static_cast<double>(all.images) / all.seconds).add("peak_rss_mib", examples::peakRssMiB());
  json.add("peak_rss_mib_max", std::max(all.peakRssMiB, examples::peakRssMiB()));
  json.add("rpc_overhead_share", all.rpcShare()).add("server_wait_share", all.serverShare());
  return json;
}

// ---- the server (rank 0) ----
int runServer(const Options& o, rpc::Agent& agent, Server& s) {
  // The server needs only the test set (the trainers read the training images).
  data::TensorDataset test = data::FashionMnist::load(data::Split::kTest, o.dataDir);
  if (o.limit > 0 && o.limit < test.size()) {
    test = data::TensorDataset(narrow(test.inputs(), 0, 0, o.limit), narrow(test.labels(), 0, 0, o.limit));
  }
  std::printf("parameter_server: %s, %lld trainers, %s (%lld parameters), %s lr %g, batch %lld per trainer\n",
              o.mode.c_str(), static_cast<long long>(s.trainers), modelSpec(o).describe().c_str(),
              static_cast<long long>(s.model->numParameters()), o.optimizer.c_str(), o.lr,
              static_cast<long long>(o.batchSize));
  std::vector<int64_t> stepsPerEpoch = s.joins.waitAll();
  if (std::adjacent_find(stepsPerEpoch.begin(), stepsPerEpoch.end(), std::not_equal_to<>()) != stepsPerEpoch.end()) {
    std::string list;
    for (int64_t n : stepsPerEpoch) list += (list.empty() ? "" : ", ") + std::to_string(n);
    rpc::Error error = rpc::Error::failed("trainers disagree on the steps per epoch (" + list +
                                          "): start every process with the same flags");
    s.joins.fail(error);
    throw rpc::RpcError(error);
  }
  s.joins.release(s.snapshot());
  EpochReport all;
  double accuracy = 0;
  auto epochStart = Clock::now();
  for (int64_t epoch = 1; epoch <= o.epochs; ++epoch) {
    EpochReport t;
    for (const EpochReport& r : s.epochEnds.waitAll()) t.add(r);
    t.seconds = std::chrono::duration<double>(s.epochEnds.lastArrival() - epochStart).count();
    t.serverSeconds = static_cast<double>(s.serverNanos.exchange(0)) * 1e-9;  // quiescent: all at the barrier
    accuracy = evaluate(*s.model, test);
    printEpoch(epoch, o, t, accuracy);
    all.add(t);
    if (epoch == o.epochs) s.finished = true;
    s.epochEnds.release(accuracy);
    epochStart = Clock::now();
  }
  const double stepsApplied = static_cast<double>(std::max<int64_t>(s.steps(), 1));
  summary(o, "ps_" + o.mode, agent.worldSize(), s.trainers, s.steps(), all, accuracy)
      .add("staleness_mean", static_cast<double>(s.stalenessSum) / stepsApplied)
      .add("staleness_max", s.stalenessMax)
      .print();
  return 0;
}

// ---- a trainer (ranks 1..N), and the single-worker reference ----
// One epoch: forward and backward on the local model, then update(batch size, gradients), which is a kPush
// round trip for a trainer and the optimizer's step for the reference. Its time is the report's rpcSeconds.
EpochReport trainEpoch(models::Module& model, data::DataLoader& loader, const std::string& label, bool showProgress,
                       const std::function<void(int64_t, std::vector<Tensor>)>& update) {
  std::optional<examples::Progress> progress;
  if (showProgress) progress.emplace(label, loader.numBatches());
  const std::vector<Tensor> params = model.parameters();
  EpochReport report;
  examples::RunningLoss runningLoss;
  auto stepEnd = Clock::now();
  for (const auto& batch : loader) {  // the next batch is gathered here: compute time
    Tensor loss = crossEntropy(model.forward(batch.inputs), batch.labels);
    model.zeroGrad();
    distgrad::backward(loss);
    std::vector<Tensor> grads;
    for (const Tensor& p : params) grads.push_back(p.grad());
    const auto sent = Clock::now();
    update(batch.size(), std::move(grads));
    const auto now = Clock::now();
    report.computeSeconds += std::chrono::duration<double>(sent - stepEnd).count();
    report.rpcSeconds += std::chrono::duration<double>(now - sent).count();
    stepEnd = now;
    const double l = loss.item();
    report.lossSum += l, report.images += batch.size(), ++report.steps;
    const double shown = runningLoss.add(l, label + " step " + std::to_string(report.steps));
    if (progress) progress->update(report.steps, report.images, shown);
  }
  report.peakRssMiB = examples::peakRssMiB();
  return report;
}

std::string epochLabel(int64_t epoch, const Options& o) {
  return "epoch " + std::to_string(epoch) + "/" + std::to_string(o.epochs);
}

void runTrainer(const Options& o, rpc::Agent& agent) {
  const int64_t trainers = agent.worldSize() - 1;
  const int64_t index = agent.rank() - 1;
  examples::Data data = examples::loadFashionMnist(o.dataDir, o.limit);
  auto sampler = std::make_shared<data::DistributedSampler>(data.train.size(), trainers, index, true, o.seed);
  data::DataLoader loader(data.train, {.batchSize = o.batchSize}, sampler);
  auto model = makeModel(o);  // a replica: its values come from the server
  std::vector<Tensor> params = model->parameters();
  std::vector<Tensor> buffers = model->buffers();  // handles: load() writes into them in place
  auto load = [&](const Params& from) {
    DG_CHECK(from.tensors.size() == params.size() && from.buffers.size() == buffers.size(), "the server sent ",
             from.tensors.size(), " parameters and ", from.buffers.size(), " buffers for ", params.size(), " and ",
             buffers.size());
    for (size_t i = 0; i < params.size(); ++i) params[i].copyFrom(from.tensors[i]);
    for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copyFrom(from.buffers[i]);
  };
  Params current = agent.rpcSyncWith(kNoDeadline, kServer, kJoin, index, loader.numBatches());
  auto push = [&](int64_t batch, std::vector<Tensor> grads) {
    // The buffers are encoded before rpcSyncWith returns, so they go as the model's own handles.
    current = agent.rpcSyncWith(kNoDeadline, kServer, kPush, index, current.version, batch, std::move(grads), buffers);
    load(current);
  };
  load(current);
  for (int64_t epoch = 1; epoch <= o.epochs; ++epoch) {
    EpochReport report = trainEpoch(*model, loader, epochLabel(epoch, o), index == 0, push);
    agent.rpcSyncWith(kNoDeadline, kServer, kEpochEnd, index, report);  // the server prints the figures
  }
}

int runLocal(const Options& o) {
  examples::Data data = examples::loadFashionMnist(o.dataDir, o.limit);
  // A DistributedSampler of one: the same epoch orders as the trainers' shards put together.
  auto sampler = std::make_shared<data::DistributedSampler>(data.train.size(), 1, 0, true, o.seed);
  data::DataLoader loader(data.train, {.batchSize = o.batchSize}, sampler);
  auto model = makeModel(o);
  auto optimizer = makeOptimizer(o, model->parameters());
  std::printf("parameter_server: local, %s (%lld parameters), %s lr %g, batch %lld\n", modelSpec(o).describe().c_str(),
              static_cast<long long>(model->numParameters()), o.optimizer.c_str(), o.lr,
              static_cast<long long>(o.batchSize));
  EpochReport all;
  double accuracy = 0;
  for (int64_t epoch = 1; epoch <= o.epochs; ++epoch) {
    const auto start = Clock::now();
    EpochReport t = trainEpoch(*model, loader, epochLabel(epoch, o), true,
                               [&](int64_t, std::vector<Tensor> grads) { optimizer->step(grads); });
    t.seconds = examples::secondsSince(start);
    t.computeSeconds += t.rpcSeconds;  // no RPC here: the optimizer's step is compute
    t.rpcSeconds = 0;
    accuracy = evaluate(*model, data.test);
    printEpoch(epoch, o, t, accuracy);
    all.add(t);
  }
  summary(o, "local", 1, 1, all.steps, all, accuracy)
      .add("staleness_mean", 0.0)
      .add("staleness_max", int64_t{0})
      .print();
  return 0;
}

// ---- the server (rank 0) ----
int serve(const Options& o, const rpc::Options& rpcOptions) {
  const bool synchronous = o.mode == "ssgd";
  Server server(o, rpcOptions.worldSize - 1);
  rpc::Registry reg;
  bindServer(reg, server, synchronous);
  auto agent = rpc::Agent::start(rpcOptions, reg);
  agent->extension("examples.parameter_server",
                   [&](rpc::Agent&) { return std::make_shared<TrainerWatch>(server, synchronous); });
  for (const std::string& name : agent->workerNames()) {  // a trainer lost before the watch was in place
    if (name != agent->name() && !agent->metrics(name).connected) {
      TrainerWatch(server, synchronous).onPeerDown(name, rpc::Error::disconnected("not connected after start"));
    }
  }
  try {
    runServer(o, *agent, server);
  } catch (...) {
    // A trainer is gone, so the graceful shutdown's barrier would wait for it in vain. Let the error replies to
    // the other trainers' open calls leave first (they say which trainer left), then stop.
    const auto deadline = Clock::now() + std::chrono::seconds(2);
    while (agent->runningHandlers() > 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    agent->shutdown(false);
    throw;
  }
  agent->shutdown();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parseArgs(argc, argv);
  std::string who = "parameter_server";
  try {
    tensor::setNumThreads(o.threads);
    if (o.mode == "local") return runLocal(o);
    const rpc::Options rpcOptions = rpc::Options::fromEnv();
    if (rpcOptions.worldSize < 2) {
      std::cerr << "parameter_server: --mode " << o.mode << " needs a server and at least one trainer: run it as "
                << "distgrad-run --nproc N+1 -- parameter_server ... (or use --mode local)\n";
      return 2;
    }
    if (rpcOptions.rank == 0) return serve(o, rpcOptions);
    who += " (trainer " + std::to_string(rpcOptions.rank) + ")";
    auto agent = rpc::Agent::start(rpcOptions, rpc::Registry());  // trainers serve nothing
    runTrainer(o, *agent);
    agent->shutdown();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << who << ": error: " << e.what() << "\n";
    return 1;
  }
}
