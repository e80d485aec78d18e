// RemoteModule over inproc and tcp: a module constructed on another worker computes what the same module
// built locally computes; remoteParameters are RRefs to the owner's own parameter tensors; a RemoteModule
// passed to a third worker (and returned) still works; placement and binding errors are clear; every
// reference table settles once the handles are gone.
#include <gtest/gtest.h>

#include "models/nn/activation.h"
#include "models/nn/linear.h"
#include "models/zoo/mlp.h"
#include "rref/remote_module.h"
#include "rref_test_util.h"
#include "tensor/cuda/runtime.h"
#include "tensor/random.h"
#include "tests/transport_params.h"

namespace distgrad::rref::testing {

inline const rpc::Class<models::Linear> kLinearClass = moduleClass<models::Linear>("Linear");
inline const rpc::Class<models::MLP> kMlpClass = moduleClass<models::MLP>("MLP");
// Declared by hand and bound with a plain bindClass: forward works, remoteParameters says what is missing.
inline const rpc::Class<models::ReLU> kReluClass =
    rpc::Class<models::ReLU>("ReLU").method("forward", &models::ReLU::forward);

}  // namespace distgrad::rref::testing

DG_REMOTE_MODULE(distgrad::models::Linear, distgrad::rref::testing::kLinearClass);
DG_REMOTE_MODULE(distgrad::models::MLP, distgrad::rref::testing::kMlpClass);
DG_REMOTE_MODULE(distgrad::models::ReLU, distgrad::rref::testing::kReluClass);

namespace distgrad::rref::testing {
namespace {

using models::Linear;
using models::MLP;

inline const rpc::Function<Tensor(RemoteModule<Linear>, Tensor)> kCallForward{"call_forward"};
inline const rpc::Function<RemoteModule<Linear>(RemoteModule<Linear>)> kEchoModule{"echo_module"};
// At the owner of a parameter RRef: fills the parameter in place (what an optimizer step does).
inline const rpc::Function<bool(RRef<Tensor>, double)> kFillParameter{"fill_parameter"};

std::shared_ptr<Linear> makeLinear(int64_t in, int64_t out, uint64_t seed) {
  tensor::Generator gen(seed);
  return std::make_shared<Linear>(in, out, gen);
}

Tensor input(const Shape& shape, uint64_t seed) {
  tensor::Generator gen(seed);
  return tensor::uniform(shape, -1.0, 1.0, gen);
}

class RemoteModuleTest : public RRefFixture {
 protected:
  void bindExtra(rpc::Registry& reg) override {
    bindRemoteModule(reg, kLinearClass).factory<int64_t, int64_t, uint64_t>(&makeLinear);
    bindRemoteModule(reg, kMlpClass).factory<std::vector<int64_t>, uint64_t>([](std::vector<int64_t> sizes, uint64_t seed) {
      tensor::Generator gen(seed);
      return std::make_shared<MLP>(sizes, gen);
    });
    reg.bindClass(kReluClass).ctor<>();
    reg.bind(kCallForward, [](RemoteModule<Linear> m, Tensor x) { return m.forwardAsync(x); });
    reg.bind(kEchoModule, [](RemoteModule<Linear> m) { return m; });
    reg.bind(kFillParameter, [](RRef<Tensor> p, double value) {
      // Only the owner holds the parameter itself; localValue refuses elsewhere.
      p.localValue()->fill(value);
      return true;
    });
  }
};

TEST_P(RemoteModuleTest, ForwardMatchesTheLocalModule) {
  start();
  {
    auto remote = RemoteModule<Linear>::create(rrefs(0), name(1), int64_t{4}, int64_t{3}, uint64_t{7});
    EXPECT_EQ(remote.owner(), name(1));
    EXPECT_EQ(remote.device(), "cpu");
    EXPECT_EQ(remote.moduleRRef().owner(), name(1));
    auto local = makeLinear(4, 3, 7);
    Tensor x = input({5, 4}, 11);
    const std::vector<float> expected = local->forward(x).toVector<float>();
    Tensor y = remote.forward(x);
    EXPECT_EQ(y.shape(), (Shape{5, 3}));
    EXPECT_EQ(y.toVector<float>(), expected);
    EXPECT_EQ(remote.forwardAsync(x).get().toVector<float>(), expected);
    // The result kept at the owner, then fetched.
    RRef<Tensor> kept = remote.forwardRemote(x);
    EXPECT_EQ(kept.owner(), name(1));
    EXPECT_EQ(kept.toHere().toVector<float>(), expected);

    // A deeper module (Sequential of Linear, ReLU, Linear), created with an explicit "worker/cpu" placement.
    auto mlp = RemoteModule<MLP>::create(agent(0), name(2) + "/cpu", std::vector<int64_t>{4, 8, 2}, uint64_t{3});
    tensor::Generator gen(3);
    MLP localMlp({4, 8, 2}, gen);
    EXPECT_EQ(mlp.forward(x).toVector<float>(), localMlp.forward(x).toVector<float>());
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RemoteModuleTest, RemoteParametersAreTheOwnersParameters) {
  start();
  {
    auto remote = RemoteModule<MLP>::create(rrefs(0), name(1), std::vector<int64_t>{3, 5, 2}, uint64_t{9});
    tensor::Generator gen(9);
    MLP local({3, 5, 2}, gen);
    const std::vector<Tensor> expected = local.parameters();
    std::vector<RRef<Tensor>> params = remote.remoteParameters();
    ASSERT_EQ(params.size(), expected.size());
    ASSERT_EQ(params.size(), 4u);  // 0.weight, 0.bias, 2.weight, 2.bias
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].owner(), name(1)) << i;
      EXPECT_FALSE(params[i].isOwner()) << i;
      Tensor value = params[i].toHere();
      EXPECT_EQ(value.shape(), expected[i].shape()) << i;
      EXPECT_EQ(value.toVector<float>(), expected[i].toVector<float>()) << i;
    }
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RemoteModuleTest, ParameterRRefsAliasTheOwnersTensors) {
  start();
  {
    // Created by its owner: the parameter RRefs are owner handles whose local values are the parameters.
    auto atOwner = RemoteModule<Linear>::create(rrefs(1), name(1), int64_t{2}, int64_t{2}, uint64_t{5});
    std::vector<RRef<Tensor>> own = atOwner.remoteParameters();
    std::shared_ptr<Linear> module = atOwner.moduleRRef().localValue();
    ASSERT_EQ(own.size(), 2u);
    EXPECT_TRUE(own[0].isOwner());
    EXPECT_EQ(own[0].localValue()->data<float>(), module->weight().data<float>());
    EXPECT_EQ(own[1].localValue()->data<float>(), module->bias().data<float>());

    // From a user: writing through a parameter RRef at its owner changes what the module computes.
    auto remote = RemoteModule<Linear>::create(rrefs(0), name(1), int64_t{2}, int64_t{3}, uint64_t{5});
    std::vector<RRef<Tensor>> params = remote.remoteParameters();
    ASSERT_EQ(params.size(), 2u);
    EXPECT_TRUE(agent(0).rpcSync(name(1), kFillParameter, params[0], 0.0));  // weight = 0
    EXPECT_TRUE(agent(0).rpcSync(name(1), kFillParameter, params[1], 0.5));  // bias = 0.5
    Tensor y = remote.forward(input({4, 2}, 1));
    EXPECT_EQ(y.toVector<float>(), std::vector<float>(12, 0.5f));
    EXPECT_EQ(params[0].toHere().toVector<float>(), std::vector<float>(6, 0.0f));
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RemoteModuleTest, PassedToAThirdWorker) {
  start();
  {
    auto remote = RemoteModule<Linear>::create(rrefs(0), name(1), int64_t{4}, int64_t{2}, uint64_t{13});
    Tensor x = input({3, 4}, 2);
    const std::vector<float> expected = makeLinear(4, 2, 13)->forward(x).toVector<float>();
    // Worker 2 receives the module (a user -> user fork) and calls forward at worker 1.
    Tensor y = agent(0).rpcSync(name(2), kCallForward, remote, x);
    EXPECT_EQ(y.toVector<float>(), expected);
    // Sent to a third worker and back: the same module at the same owner.
    RemoteModule<Linear> back = agent(0).rpcSync(name(2), kEchoModule, remote);
    EXPECT_EQ(back.owner(), name(1));
    EXPECT_EQ(back.device(), "cpu");
    EXPECT_EQ(back.moduleRRef().id(), remote.moduleRRef().id());
    remote = {};  // the returned copy keeps the module alive
    EXPECT_EQ(back.forward(x).toVector<float>(), expected);
    // Sent to its owner: the owner calls forward on its local module.
    EXPECT_EQ(agent(0).rpcSync(name(1), kCallForward, back, x).toVector<float>(), expected);
  }
  EXPECT_TRUE(allSettled()) << tables();
}

TEST_P(RemoteModuleTest, PlacementAndBindingErrors) {
  start();
  auto expectValueError = [](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected a ValueError containing '" << needle << "'";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto create = [&](const std::string& placement) {
    (void)RemoteModule<Linear>::create(rrefs(0), placement, int64_t{2}, int64_t{2}, uint64_t{1});
  };
  expectValueError([&] { create("nosuchworker"); }, "nosuchworker");
  expectValueError([&] { create("nosuchworker"); }, name(1));  // the message lists the workers
  expectValueError([&] { create(name(1) + "/tpu"); }, "unknown device 'tpu'");
  expectValueError([&] { create(name(1) + "/cuda:x"); }, "no valid index");
  expectValueError([&] { create(name(1) + "/cuda:64"); }, "index 64");
  expectValueError([&] { create(name(1) + "/cuda:0/x"); }, "more than one '/'");
  expectValueError([&] { create("/cpu"); }, "names no worker");
  // Placement strings are normalised ("cuda" is cuda:0).
  EXPECT_EQ(rref::ModulePlacement::parse("w/cuda").device, "cuda:0");
  EXPECT_EQ(rref::ModulePlacement::parse("w/cuda:3").device, "cuda:3");
  EXPECT_EQ(rref::ModulePlacement::parse("w/cuda:3").deviceValue, tensor::Device::cuda(3));
  EXPECT_EQ(rref::ModulePlacement::parse("w").device, "cpu");
  {
    // A CUDA device the owner does not have: the owner says so (naming itself and its device count), and
    // create() raises it.
    const int devices = tensor::cuda::deviceCount();
    const std::string placement = name(1) + "/cuda:" + std::to_string(devices);
    auto error = rpc::testing::errorOf([&] { create(placement); });
    EXPECT_EQ(error.worker, name(1)) << error.describe();
    EXPECT_NE(error.message.find("cuda:" + std::to_string(devices)), std::string::npos) << error.describe();
    EXPECT_NE(error.message.find("has " + std::to_string(devices) + " CUDA device(s)"), std::string::npos)
        << error.describe();
  }
  {
    // No constructor bound for these argument types: every call on the module says so.
    auto noCtor = RemoteModule<Linear>::create(rrefs(0), name(1), int64_t{2}, int64_t{2});
    auto error = rpc::testing::errorOf([&] { (void)noCtor.forward(Tensor::zeros({1, 2})); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kUnimplemented);
    EXPECT_NE(error.message.find("Linear"), std::string::npos) << error.describe();
    error = rpc::testing::errorOf([&] { (void)noCtor.remoteParameters(); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kUnimplemented) << error.describe();

    // Bound with a plain bindClass: forward works; remoteParameters names what is missing.
    auto relu = RemoteModule<models::ReLU>::create(rrefs(0), name(2));
    EXPECT_EQ(relu.forward(Tensor::fromVector({-1.0f, 2.0f}, {2})).toVector<float>(),
              (std::vector<float>{0.0f, 2.0f}));
    error = rpc::testing::errorOf([&] { (void)relu.remoteParameters(); });
    EXPECT_EQ(error.kind, rpc::ErrorKind::kUnimplemented);
    EXPECT_NE(error.message.find("bindRemoteModule"), std::string::npos) << error.describe();
    // An empty RemoteModule.
    RemoteModule<Linear> empty;
    EXPECT_FALSE(empty.valid());
    EXPECT_THROW((void)empty.remoteParameters(), ValueError);
  }
  EXPECT_TRUE(allSettled()) << tables();
}

INSTANTIATE_TEST_SUITE_P(Transports, RemoteModuleTest, ::testing::ValuesIn(distgrad::testing::endToEndTransports()));

}  // namespace
}  // namespace distgrad::rref::testing
