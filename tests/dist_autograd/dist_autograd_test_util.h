// Shared setup of the distributed autograd end-to-end tests (gradients_test.cpp, modes_test.cpp,
// failure_test.cpp, training_test.cpp): float64 parameters on every worker (and an identical, independent
// copy for the single-process reference), registered stage functions that run layers on those parameters
// (plain, through a chain A→B→C, bouncing back A→B→A, or with a custom op whose backward blocks or throws)
// and hand out RRefs to them, two small RemoteModule types (an MLP stage and a conv stage), and a cluster
// fixture over inproc and tcp whose registry installs the RRef functions and distributed autograd (suites
// add their own bindings through bindExtra).
//
// Everything lives in namespace e2e (and the module types have their own DG_REMOTE_MODULE declarations) so
// that other test files of the same binary can declare their own functions and modules without ODR clashes.
// Not thread-safe beyond what World's mutex guards; parameters are created before the agents start and only
// read (never written) by handlers (training tests update them in place through a DistributedOptimizer,
// between the passes that read them).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "autograd/distributed/dist_autograd.h"
#include "autograd/engine.h"
#include "autograd/node.h"
#include "autograd/ops.h"
#include "models/nn/conv.h"
#include "models/nn/module.h"
#include "models/zoo/mlp.h"
#include "rpc/agent.h"
#include "rref/context.h"
#include "rref/remote_module.h"
#include "tensor/error.h"
#include "tensor/random.h"
#include "tests/rpc/agent_test_util.h"
#include "tests/rref/rref_test_util.h"

namespace distgrad::autograd::distributed::e2e {

using namespace std::chrono_literals;
using rpc::testing::eventually;

// Gradients of the distributed pass must equal the single-process ones to this (float64 everywhere).
inline constexpr double kGradTolerance = 1e-10;

// ---------------------------------------------------------------- parameters

// Every layer key and its shape (in -> out features). Every worker gets its own parameters for every key
// (values depend on the worker and the key), so any worker can run any layer.
struct LayerShape {
  int64_t in;
  int64_t out;
};
inline const std::map<std::string, LayerShape>& layerShapes() {
  static const std::map<std::string, LayerShape> shapes = {
      {"l1", {5, 7}},           // input (5 features) -> hidden
      {"l1b", {5, 7}},          // a second stage on the input (the unused branch)
      {"l2", {7, 6}},           // hidden -> hidden
      {"l3", {6, 6}},           // hidden -> hidden (the post-processing step of a bounce)
      {"head", {6, 3}},         // hidden -> 3 classes
      {"head7", {7, 3}},        // hidden (7 features) -> 3 classes
      {"cnn_head", {12, 3}},    // flattened conv stage ([3, 2, 2]) -> 3 classes
      {"cnn_hidden", {12, 6}},  // flattened conv stage -> hidden (the CNN split in three)
  };
  return shapes;
}

struct Layer {
  Tensor weight;  // [out, in], float64, requires grad (a leaf)
  Tensor bias;    // [out]
};

inline Tensor leafParameter(const Shape& shape, uint64_t seed) {
  tensor::Generator gen(seed);
  Tensor t = tensor::uniform(shape, -0.8, 0.8, gen, DType::kFloat64);
  t.setRequiresGrad(true);
  return t;
}

inline uint64_t seedOf(const std::string& worker, const std::string& key, int which) {
  uint64_t h = 1469598103934665603ull;
  for (char c : worker + "/" + key) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h + static_cast<uint64_t>(which);
}

// All layers of one worker.
using Layers = std::map<std::string, Layer>;

inline Layers makeLayers(const std::string& worker) {
  Layers layers;
  for (const auto& [key, shape] : layerShapes()) {
    layers[key] = Layer{leafParameter({shape.out, shape.in}, seedOf(worker, key, 0)),
                        leafParameter({shape.out}, seedOf(worker, key, 1))};
  }
  return layers;
}

// The computation every stage runs (the same code runs in handlers and in the local reference).
inline Tensor applyLayer(const Tensor& x, const Layer& layer) { return tanh(linear(x, layer.weight, layer.bias)); }
inline Tensor headLoss(const Tensor& h, const Layer& head, const Tensor& labels) {
  return crossEntropy(linear(h, head.weight, head.bias), labels);
}

// A float64 input (optionally a leaf requiring grad) and int64 labels in [0, classes).
inline Tensor input(const Shape& shape, uint64_t seed, bool requiresGrad = true) {
  tensor::Generator gen(seed);
  Tensor t = tensor::uniform(shape, -1.0, 1.0, gen, DType::kFloat64);
  if (requiresGrad) t.setRequiresGrad(true);
  return t;
}
inline Tensor labels(int64_t n, int64_t classes, uint64_t seed) {
  tensor::Generator gen(seed);
  std::vector<int64_t> values;
  for (int64_t i = 0; i < n; ++i) values.push_back(static_cast<int64_t>(gen.below(static_cast<uint64_t>(classes))));
  return Tensor::fromVector(values, {n});
}
// An independent leaf with the same values (the local reference's copy of a distributed leaf).
inline Tensor twin(const Tensor& leaf) {
  Tensor t = leaf.cloneData();
  if (leaf.requiresGrad()) t.setRequiresGrad(true);
  return t;
}

// ---------------------------------------------------------------- RemoteModule types

// An MLP stage (5 -> 7 -> 6, ReLU between) in float64.
class MlpStage : public models::Module {
 public:
  explicit MlpStage(uint64_t seed) : Module("MlpStage") {
    tensor::Generator gen(seed);
    mlp_ = registerModule("mlp", std::make_shared<models::MLP>(std::vector<int64_t>{5, 7, 6}, gen));
    toDType(DType::kFloat64);
  }
  Tensor forward(const Tensor& x) override { return mlp_->forward(x); }

 private:
  std::shared_ptr<models::MLP> mlp_;
};

// conv2d (2 -> 3 channels, 3x3) + relu + 2x2 max pool + flatten: [N, 2, 6, 6] -> [N, 12], float64.
class ConvStage : public models::Module {
 public:
  explicit ConvStage(uint64_t seed) : Module("ConvStage") {
    tensor::Generator gen(seed);
    conv_ = registerModule("conv", std::make_shared<models::Conv2d>(2, 3, 3, gen));
    toDType(DType::kFloat64);
  }
  Tensor forward(const Tensor& x) override {
    Pool2dOptions pool;
    pool.kernel = {2, 2};
    return flatten(maxPool2d(relu(conv_->forward(x)), pool), 1);
  }

 private:
  std::shared_ptr<models::Conv2d> conv_;
};

inline const rpc::Class<MlpStage> kMlpStageClass = rref::moduleClass<MlpStage>("e2e.MlpStage");
inline const rpc::Class<ConvStage> kConvStageClass = rref::moduleClass<ConvStage>("e2e.ConvStage");

}  // namespace distgrad::autograd::distributed::e2e

DG_REMOTE_MODULE(distgrad::autograd::distributed::e2e::MlpStage, distgrad::autograd::distributed::e2e::kMlpStageClass);
DG_REMOTE_MODULE(distgrad::autograd::distributed::e2e::ConvStage,
                 distgrad::autograd::distributed::e2e::kConvStageClass);

namespace distgrad::autograd::distributed::e2e {

// ---------------------------------------------------------------- registered functions

// What a stage does besides its layer, in its backward.
enum class Behavior : int64_t {
  kPlain = 0,
  kGate = 1,        // the backward calls World::onGatedBackward (blocks until the test lets it go)
  kExplode = 2,     // the backward throws std::runtime_error(kExplodeMessage)
  kWrongShape = 3,  // the backward returns a gradient of the wrong shape (the engine refuses it)
};
inline constexpr const char* kExplodeMessage = "exploding backward: gradient shape [8, 7] does not match [8, 6]";

// The worker's layer `key` on x.
inline const rpc::Function<Tensor(std::string, Tensor)> kLayer{"e2e.layer"};
// The same with a behavior (Behavior as int64) recorded after the layer.
inline const rpc::Function<Tensor(std::string, int64_t, Tensor)> kLayerWith{"e2e.layer_with"};
// This worker's layer `key`, then `next`'s layer `nextKey` (with `nextBehavior`) through a nested call,
// then (when `postKey` is not empty) this worker's layer `postKey` on what came back. next == caller
// makes the bounce A→B→A.
inline const rpc::Function<Tensor(std::string, std::string, std::string, int64_t, std::string, Tensor)> kChain{
    "e2e.chain"};
// At a parameter owner: the gradient context `contextId` holds there for layer `key`'s weight (an undefined
// tensor when none), as a user's handler would read it.
inline const rpc::Function<Tensor(uint64_t, std::string)> kWeightGradient{"e2e.weight_gradient"};

// The worker's parameter itself (layer `key`'s weight, or its bias), as a parameter server hands it out.
inline const rpc::Function<Tensor(std::string, bool)> kParameter{"e2e.parameter"};
inline const rpc::Function<Tensor(Tensor)> kIdentity{"e2e.identity"};        // returns its argument
inline const rpc::Function<Tensor(Tensor, Tensor)> kProduct{"e2e.product"};  // a * b (elementwise)
// Fetches the RRef's value (toHereAsync, in the handler's synchronous part) and applies layer `key`.
inline const rpc::Function<Tensor(std::string, rref::RRef<Tensor>)> kConsumeRef{"e2e.consume_ref"};
// RRefs owned by the callee to its layer `key`'s weight and bias (their owner-side values are the
// parameters themselves): what a DistributedOptimizer over the layer's parameters needs.
inline const rpc::Function<std::vector<rref::RRef<Tensor>>(std::string)> kLayerParameters{"e2e.layer_parameters"};

// Parks: answers the number of elements of x plus the value the test later gives World::parked (no
// executor thread is held meanwhile). x may require grad (the callee then joins the context); the answer
// never does.
inline const rpc::Function<int64_t(Tensor)> kParked{"e2e.parked"};

struct World {
  std::mutex mutex;
  std::shared_ptr<rpc::Promise<int64_t>> parked;  // the pending kParked call's promise
  rpc::testing::Event parkedEntered;
  std::map<std::string, rpc::Agent*> agents;
  std::map<std::string, Layers> layers;  // per worker; created before start, read-only afterwards
  // Modules created by the RemoteModule factories, by seed (the test reads their parameters directly).
  std::map<uint64_t, std::shared_ptr<models::Module>> modules;
  // Called (on the thread running the backward) by a kGate stage's backward.
  std::function<void()> onGatedBackward;

  const Layer& layer(const std::string& worker, const std::string& key) { return layers.at(worker).at(key); }
  rpc::Agent& agent(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex);
    return *agents.at(name);
  }
  std::shared_ptr<models::Module> module(uint64_t seed) {
    std::lock_guard<std::mutex> lock(mutex);
    return modules.at(seed);
  }
};

// y with a recorded op after it whose forward is the identity and whose backward does what `behavior` says.
inline Tensor withBehavior(World& world, const Tensor& y, Behavior behavior) {
  if (behavior == Behavior::kPlain) return y;
  Tensor out = y.cloneData();
  const char* name = behavior == Behavior::kGate      ? "GatedBackward"
                     : behavior == Behavior::kExplode ? "ExplodingBackward"
                                                      : "WrongShapeBackward";
  return autograd::recordOp(name, {y}, out, [&world, behavior](const std::vector<Tensor>& g, const autograd::Node&) {
    if (behavior == Behavior::kExplode) throw std::runtime_error(kExplodeMessage);
    if (behavior == Behavior::kWrongShape) {
      return std::vector<Tensor>{sum(g[0], {1}, /*keepDim=*/true)};
    }
    std::function<void()> gate;
    {
      std::lock_guard<std::mutex> lock(world.mutex);
      gate = world.onGatedBackward;
    }
    if (gate) gate();
    return std::vector<Tensor>{g[0]};
  });
}

// Binds the stage functions and RemoteModule classes (plus what every distributed autograd worker needs).
inline void bindStages(rpc::Registry& reg, World& world) {
  rref::RRefContext::install(reg);
  install(reg);
  reg.bind(kLayer, [&world](const rpc::CallContext& ctx, std::string key, Tensor x) {
    return applyLayer(x, world.layer(ctx.callee, key));
  });
  reg.bind(kLayerWith, [&world](const rpc::CallContext& ctx, std::string key, int64_t behavior, Tensor x) {
    return withBehavior(world, applyLayer(x, world.layer(ctx.callee, key)), static_cast<Behavior>(behavior));
  });
  reg.bind(kChain,
           [&world](const rpc::CallContext& ctx, std::string key, std::string next, std::string nextKey,
                    int64_t nextBehavior, std::string postKey, Tensor x) -> rpc::Future<Tensor> {
             Tensor h = applyLayer(x, world.layer(ctx.callee, key));
             // The nested call is made in the handler's synchronous part, where the context is active; the
             // continuation only runs local ops (recorded as usual) on what came back.
             return ctx.agent->rpcAsync(next, kLayerWith, nextKey, nextBehavior, h)
                 .then([&world, callee = ctx.callee, postKey](Tensor r) {
                   return postKey.empty() ? r : applyLayer(r, world.layer(callee, postKey));
                 });
           });
  reg.bind(kWeightGradient, [&world](const rpc::CallContext& ctx, uint64_t contextId, std::string key) {
    return gradientsOf(*ctx.agent, contextId).get(world.layer(ctx.callee, key).weight);
  });
  reg.bind(kParameter, [&world](const rpc::CallContext& ctx, std::string key, bool bias) {
    const Layer& l = world.layer(ctx.callee, key);
    return bias ? l.bias : l.weight;
  });
  reg.bind(kIdentity, [](Tensor x) { return x; });
  reg.bind(kProduct, [](Tensor a, Tensor b) { return mul(a, b); });
  reg.bind(kConsumeRef, [&world](const rpc::CallContext& ctx, std::string key, rref::RRef<Tensor> r) {
    return r.toHereAsync().then(
        [&world, callee = ctx.callee, key](Tensor v) { return applyLayer(v, world.layer(callee, key)); });
  });
  reg.bind(kLayerParameters, [&world](const rpc::CallContext& ctx, std::string key) {
    auto rrefs = rref::RRefContext::of(*ctx.agent);
    const Layer& l = world.layer(ctx.callee, key);
    return std::vector<rref::RRef<Tensor>>{rrefs->own<Tensor>(l.weight), rrefs->own<Tensor>(l.bias)};
  });
  reg.bind(kParked, [&world](Tensor x) -> rpc::Future<int64_t> {
    auto promise = std::make_shared<rpc::Promise<int64_t>>(*rpc::Executor::current());
    auto future = promise->getFuture().then([n = x.numel()](int64_t v) { return v + n; });
    {
      std::lock_guard<std::mutex> lock(world.mutex);
      world.parked = promise;
    }
    world.parkedEntered.set();
    return future;
  });
  rref::bindRemoteModule(reg, kMlpStageClass).factory<uint64_t>([&world](uint64_t seed) {
    auto m = std::make_shared<MlpStage>(seed);
    std::lock_guard<std::mutex> lock(world.mutex);
    world.modules[seed] = m;
    return m;
  });
  rref::bindRemoteModule(reg, kConvStageClass).factory<uint64_t>([&world](uint64_t seed) {
    auto m = std::make_shared<ConvStage>(seed);
    std::lock_guard<std::mutex> lock(world.mutex);
    world.modules[seed] = m;
    return m;
  });
}

// ---------------------------------------------------------------- comparisons

// actual == expected elementwise within `tolerance` (both defined, float64, same shape).
// Private copies of tensors' current values.
inline std::vector<Tensor> copies(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> out;
  for (const Tensor& t : tensors) out.push_back(t.cloneData());
  return out;
}

// Copies of the values the RRefs hold now (toHere copies on every transport; call it outside a context).
inline std::vector<Tensor> fetch(const std::vector<rref::RRef<Tensor>>& params) {
  std::vector<Tensor> out;
  for (const auto& p : params) out.push_back(p.toHere());
  return out;
}

inline ::testing::AssertionResult allClose(const Tensor& actual, const Tensor& expected,
                                           double tolerance = kGradTolerance) {
  if (!expected.defined()) return ::testing::AssertionFailure() << "the expected gradient is undefined";
  if (!actual.defined()) return ::testing::AssertionFailure() << "no gradient (undefined tensor)";
  if (actual.dtype() != DType::kFloat64) {
    return ::testing::AssertionFailure() << "dtype " << dtypeName(actual.dtype()) << ", expected float64";
  }
  if (actual.shape() != expected.shape()) {
    return ::testing::AssertionFailure() << "shape " << tensor::shapeStr(actual.shape()) << ", expected "
                                         << tensor::shapeStr(expected.shape());
  }
  const std::vector<double> a = actual.toVector<double>();
  const std::vector<double> e = expected.toVector<double>();
  double worst = 0.0;
  size_t at = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::abs(a[i] - e[i]);
    if (!(d <= worst)) {  // also catches NaN
      worst = d;
      at = i;
    }
  }
  if (!(worst <= tolerance)) {
    return ::testing::AssertionFailure() << "max |difference| " << worst << " at element " << at << " (got " << a[at]
                                         << ", expected " << e[at] << ")";
  }
  return ::testing::AssertionSuccess();
}

// One leaf whose distributed gradient is checked: it lives on `worker`.
struct Expected {
  std::string worker;
  std::string what;  // for messages: "worker1 l1.weight"
  Tensor leaf;       // the distributed leaf (a parameter or input on `worker`)
  Tensor gradient;   // the single-process gradient of its twin
};

inline const std::vector<BackwardMode>& bothModes() {
  static const std::vector<BackwardMode> modes = {BackwardMode::kExact, BackwardMode::kFast};
  return modes;
}

// Twin layers for the local reference: the same values (same seeds), independent leaves.
class Reference {
 public:
  const Layer& layer(const std::string& worker, const std::string& key) {
    auto it = layers_.find(worker);
    if (it == layers_.end()) it = layers_.emplace(worker, makeLayers(worker)).first;
    return it->second.at(key);
  }
  // d loss / d leaf for each of `leaves` (twins), in one autograd::grad (nothing touches .grad).
  static std::vector<Tensor> gradients(const Tensor& loss, const std::vector<Tensor>& leaves) {
    return autograd::grad({loss}, leaves, {}, /*retainGraph=*/false);
  }

 private:
  std::map<std::string, Layers> layers_;
};

inline void appendAll(std::vector<Expected>& out, std::vector<Expected> more) {
  for (auto& e : more) out.push_back(std::move(e));
}

// ---------------------------------------------------------------- the fixture

class DistAutogradFixture : public ::testing::TestWithParam<std::string> {
 protected:
  void start(int size = 3) {
    rpc::testing::ClusterSpec spec;
    spec.transport = GetParam();
    spec.size = size;
    for (int rank = 0; rank < size; ++rank) {
      const std::string name = "worker" + std::to_string(rank);
      world_.layers[name] = makeLayers(name);
    }
    bindStages(registry_, world_);
    bindExtra(registry_);
    rpc::testing::startCluster(cluster_, spec, rpcWorld_, registry_);
    for (size_t i = 0; i < cluster_.errors.size(); ++i) {
      if (!cluster_.errors[i]) continue;
      try {
        std::rethrow_exception(cluster_.errors[i]);
      } catch (const std::exception& e) {
        FAIL() << "rank " << i << " failed to start: " << e.what();
      }
    }
    std::lock_guard<std::mutex> lock(world_.mutex);
    for (auto& agent : cluster_.agents) {
      ASSERT_EQ(agent->name(), "worker" + std::to_string(agent->rank()));
      world_.agents[agent->name()] = agent.get();
    }
  }
  // Suites bind their own functions and classes here (called by start(), before the agents start).
  virtual void bindExtra(rpc::Registry& registry) {}
  void TearDown() override {
    std::shared_ptr<rpc::Promise<int64_t>> parked;
    {
      std::lock_guard<std::mutex> lock(world_.mutex);
      world_.onGatedBackward = nullptr;
      parked.swap(world_.parked);
    }
    // A parked promise is bound to its agent's executor: complete it while the agents still run.
    if (parked) parked->trySetValue(0);
  }

  rpc::Agent& agent(int rank) { return *cluster_.agents.at(rank); }
  rpc::Agent& agent(const std::string& name) { return world_.agent(name); }
  std::string name(int rank) { return "worker" + std::to_string(rank); }
  std::shared_ptr<rref::RRefContext> rrefs(int rank) { return rref::RRefContext::of(agent(rank)); }
  const Layer& layer(const std::string& worker, const std::string& key) { return world_.layer(worker, key); }

  // Every worker holds no context any more (bounded wait: releases travel asynchronously).
  bool allReleased(std::chrono::milliseconds bound = rpc::testing::kTestTimeout) {
    return eventually(
        [&] {
          for (auto& a : cluster_.agents) {
            if (liveContexts(*a) != 0) return false;
          }
          return true;
        },
        bound);
  }
  std::string liveCounts() {
    std::string out;
    for (auto& a : cluster_.agents) out += a->name() + ": " + std::to_string(liveContexts(*a)) + " live; ";
    return out;
  }

  // Every RRef table of every worker empty (the RRef protocol settled, nothing leaked): bounded wait.
  bool rrefsSettled() { return rref::testing::rrefsSettled(cluster_.agents); }
  std::string rrefTables() { return rref::testing::rrefTables(cluster_.agents); }

  // The distributed gradients of context `ctx` (created on `root`) equal the expected ones; every worker
  // in `expected` holds exactly the listed leaves (nothing extra), and no leaf's .grad was touched.
  void expectGradients(const DistContext& ctx, int root, const std::vector<Expected>& expected) {
    std::map<std::string, size_t> perWorker;
    for (const Expected& e : expected) ++perWorker[e.worker];
    for (const auto& [worker, count] : perWorker) {
      Gradients grads = worker == name(root) ? ctx.gradients() : gradientsOf(agent(worker), ctx.id());
      EXPECT_EQ(grads.size(), count) << "gradients held by " << worker;
      for (const Expected& e : expected) {
        if (e.worker != worker) continue;
        EXPECT_TRUE(allClose(grads.get(e.leaf), e.gradient)) << e.what;
        EXPECT_FALSE(e.leaf.grad().defined()) << e.what << ": .grad was touched by a distributed backward";
      }
    }
    // The root's view through gradientsOf is the same as ctx.gradients().
    if (perWorker.count(name(root)) != 0) {
      Gradients viaAgent = gradientsOf(agent(root), ctx.id());
      for (const Expected& e : expected) {
        if (e.worker == name(root)) {
          EXPECT_TRUE(allClose(viaAgent.get(e.leaf), e.gradient)) << e.what << " (gradientsOf)";
        }
      }
    }
  }

  // Expectations for layer `key` of `worker` given the single-process gradients of its twin (weight, bias).
  std::vector<Expected> layerExpected(const std::string& worker, const std::string& key,
                                      const std::vector<Tensor>& twinGrads) {
    const Layer& l = layer(worker, key);
    return {Expected{worker, worker + " " + key + ".weight", l.weight, twinGrads.at(0)},
            Expected{worker, worker + " " + key + ".bias", l.bias, twinGrads.at(1)}};
  }

  // An MLP whose layers live on several workers: x (on worker0) -> each (worker, key) layer of `layers` in
  // turn -> worker0's head, cross-entropy on y. `loss` is its single-process twin's loss and `expected` the
  // gradients of x and of every layer's weight and bias, from one autograd::grad over the twins.
  struct LayerChain {
    Tensor x;
    Tensor y;
    Tensor loss;
    std::vector<Expected> expected;
  };
  LayerChain layerChain(uint64_t seed, const std::vector<std::pair<std::string, std::string>>& layers) {
    LayerChain c{input({8, 5}, seed), labels(8, 3, seed + 1), {}, {}};
    Reference ref;
    const Tensor xr = twin(c.x);
    Tensor h = xr;
    std::vector<Tensor> leaves = {xr};
    for (const auto& [worker, key] : layers) {
      const Layer& l = ref.layer(worker, key);
      h = applyLayer(h, l);
      leaves.push_back(l.weight);
      leaves.push_back(l.bias);
    }
    const Layer& rh = ref.layer("worker0", "head");
    leaves.push_back(rh.weight);
    leaves.push_back(rh.bias);
    c.loss = headLoss(h, rh, c.y);
    const auto g = Reference::gradients(c.loss, leaves);
    c.expected = {Expected{"worker0", "x", c.x, g[0]}};
    size_t next = 1;
    for (const auto& [worker, key] : layers) {
      appendAll(c.expected, layerExpected(worker, key, {g[next], g[next + 1]}));
      next += 2;
    }
    appendAll(c.expected, layerExpected("worker0", "head", {g[next], g[next + 1]}));
    return c;
  }
  // The two-worker MLP (worker1's l1, worker0's l2 and head) the failure and mode tests train.
  using TwoWorkerMlp = LayerChain;
  TwoWorkerMlp twoWorkerMlp(uint64_t seed) { return layerChain(seed, {{"worker1", "l1"}, {"worker0", "l2"}}); }
  // One distributed backward pass of `loss` in `mode`.
  static void backward(DistContext& ctx, const Tensor& loss, BackwardMode mode) {
    BackwardOptions options;
    options.mode = mode;
    ctx.backward(loss, options);
  }
  Tensor twoWorkerLoss(const TwoWorkerMlp& m) {
    Tensor h = agent(0).rpcSync(name(1), kLayer, std::string("l1"), m.x);
    return headLoss(applyLayer(h, layer("worker0", "l2")), layer("worker0", "head"), m.y);
  }
  // After a failed pass: new contexts on the same workers work in both modes.
  void expectStillWorking(const TwoWorkerMlp& m) {
    for (BackwardMode mode : bothModes()) {
      SCOPED_TRACE(std::string("a later context, ") + backwardModeName(mode));
      DistContext ctx(agent(0));
      Tensor loss = twoWorkerLoss(m);
      BackwardOptions options;
      options.mode = mode;
      options.timeout = 10s;
      ctx.backward(loss, options);
      expectGradients(ctx, 0, m.expected);
    }
  }

  // World before the cluster: handlers may use it until the agents are gone (members die in reverse order).
  World world_;
  rpc::testing::World rpcWorld_;
  rpc::Registry registry_;
  rpc::testing::Cluster cluster_;
};

}  // namespace distgrad::autograd::distributed::e2e
