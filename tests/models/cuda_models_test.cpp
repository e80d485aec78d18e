// models/ on CUDA: Module::to, the optimizers' fused kernels, gradient clipping, the gradient aggregator's
// average, batches on a device, checkpoints of a CUDA module.
//
// Two kinds of tests. The "Gpu" ones run the same computation on CPU tensors and on CUDA copies and compare
// (tolerances stated per test); they skip without a GPU. The others run everywhere: they check the clear
// errors for unavailable devices and for operands on different devices. Those need a tensor that claims to
// live on cuda:0 without a GPU: fakeCuda() wraps host memory in a Storage labelled cuda:0. Only the
// validation paths may touch it (they throw before any kernel is launched or byte is read), which is
// exactly what those tests check.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "autograd/ops.h"
#include "examples/example_util.h"
#include "models/checkpoint.h"
#include "models/data/data_loader.h"
#include "models/nn/nn.h"
#include "models/optim/adam.h"
#include "models/optim/clip_grad.h"
#include "models/optim/gradient_aggregator.h"
#include "models/optim/sgd.h"
#include "tensor/cuda/runtime.h"
#include "tensor/random.h"
#include "test_util.h"

namespace distgrad::models {
namespace {

const Device kCuda0 = Device::cuda(0);

#define DG_REQUIRE_GPU() \
  if (!tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device"

// A tensor whose storage says cuda:0 but holds host memory (see the file comment). Keeps the memory alive
// through the storage's deleter.
Tensor fakeCuda(const Shape& shape, DType dtype = DType::kFloat32) {
  const size_t nbytes = static_cast<size_t>(tensor::numelOf(shape)) * tensor::itemSize(dtype);
  auto* block = new char[nbytes > 0 ? nbytes : 1]();
  tensor::Storage storage =
      tensor::Storage::wrap(block, nbytes, kCuda0, [](void* p) { delete[] static_cast<char*>(p); });
  return Tensor::fromStorage(storage, shape, tensor::contiguousStrides(shape), 0, dtype);
}

template <typename F>
std::string errorOf(F&& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "(no ValueError)";
}

Tensor randomTensor(const Shape& shape, uint64_t seed, DType dtype = DType::kFloat32) {
  tensor::Generator gen(seed);
  return tensor::normal(shape, 0.0, 1.0, gen).toDType(dtype);
}

// |a - b| <= atol + rtol * |b| elementwise, on host copies.
void expectClose(const Tensor& actual, const Tensor& expected, double rtol, double atol, const std::string& what) {
  const Tensor a = actual.device().isCpu() ? actual : actual.to(Device::cpu());
  const Tensor b = expected.device().isCpu() ? expected : expected.to(Device::cpu());
  ASSERT_EQ(a.shape(), b.shape()) << what;
  const auto av = a.toDType(DType::kFloat64).toVector<double>();
  const auto bv = b.toDType(DType::kFloat64).toVector<double>();
  for (size_t i = 0; i < av.size(); ++i) {
    ASSERT_NEAR(av[i], bv[i], atol + rtol * std::abs(bv[i])) << what << ", element " << i;
  }
}

// ---------------------------------------------------------------- errors that run everywhere

TEST(ModuleTo, UnavailableDeviceIsAClearErrorAndMovesNothing) {
  if (tensor::cuda::deviceCount() > 7) GTEST_SKIP() << "this machine has a cuda:7";
  tensor::Generator gen(1);
  Sequential model;
  model.add(std::make_shared<Linear>(4, 3, gen)).add(std::make_shared<BatchNorm2d>(3));
  const std::string message = errorOf([&] { model.to(Device::cuda(7)); });
  EXPECT_NE(message.find("Sequential::to(cuda:7)"), std::string::npos) << message;
  for (const auto& [name, t] : model.stateDict()) EXPECT_TRUE(t.device().isCpu()) << name;
  EXPECT_TRUE(model.device().isCpu());
}

TEST(ModuleTo, CpuToCpuKeepsEveryTensor) {
  tensor::Generator gen(2);
  Linear layer(3, 2, gen);
  const auto before = layer.parameters();
  layer.to(Device::cpu());
  const auto after = layer.parameters();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(before[i].sameAs(after[i]));
    EXPECT_TRUE(before[i].storage().sameAs(after[i].storage()));
  }
}

TEST(OptimizerDevices, CpuGradientForCudaParameterNamesBothDevices) {
  Tensor p = fakeCuda({4});
  p.setRequiresGrad(true);
  optim::SGD sgd({p}, {.learningRate = 0.1});
  const std::string message = errorOf([&] { sgd.step({Tensor::zeros({4})}); });
  EXPECT_NE(message.find("gradient 0 is on cpu"), std::string::npos) << message;
  EXPECT_NE(message.find("parameter 0 is on cuda:0"), std::string::npos) << message;
  EXPECT_EQ(sgd.stepCount(), 0);
}

TEST(OptimizerDevices, CudaGradientForCpuParameterIsAnErrorBeforeAnyUpdate) {
  Tensor a = Tensor::fromVector({1.0f, 2.0f}, {2});
  Tensor b = Tensor::fromVector({3.0f, 4.0f}, {2});
  a.setRequiresGrad(true);
  b.setRequiresGrad(true);
  optim::Adam adam({a, b}, {.learningRate = 0.1});
  // Parameter 0's gradient is fine, parameter 1's is on another device: nothing may be updated.
  const std::string message = errorOf([&] { adam.step({Tensor::ones({2}), fakeCuda({2})}); });
  EXPECT_NE(message.find("gradient 1 is on cuda:0 but parameter 1 is on cpu"), std::string::npos) << message;
  EXPECT_EQ(a.toVector<float>(), (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(adam.parameterStep(0), 0);
}

TEST(OptimizerDevices, StateLeftOnTheOldDeviceIsAClearError) {
  Tensor p = Tensor::fromVector({1.0f, 2.0f}, {2});
  p.setRequiresGrad(true);
  optim::SGD sgd({p}, {.learningRate = 0.1, .momentum = 0.9});
  sgd.step({Tensor::ones({2})});  // creates the momentum buffer on the CPU
  // What Module::to does to a parameter, done by hand (no GPU here): same impl, storage now on cuda:0.
  Tensor moved = fakeCuda({2});
  p.implPtr()->storage = moved.storage();
  const std::string message = errorOf([&] { sgd.step({fakeCuda({2})}); });
  EXPECT_NE(message.find("'momentum_buffer' state of parameter 0 is on cpu but the parameter is now on cuda:0"),
            std::string::npos)
      << message;
}

TEST(OptimizerDevices, NonContiguousCudaGradientIsRejected) {
  Tensor p = fakeCuda({2, 2});
  p.setRequiresGrad(true);
  optim::SGD sgd({p}, {.learningRate = 0.1});
  Tensor g = fakeCuda({2, 2});
  Tensor transposed = Tensor::fromStorage(g.storage(), {2, 2}, {1, 2}, 0, DType::kFloat32);
  const std::string message = errorOf([&] { sgd.step({transposed}); });
  EXPECT_NE(message.find("not contiguous"), std::string::npos) << message;
}

TEST(ClipGradDevices, NonContiguousCudaGradientIsRejected) {
  Tensor g = fakeCuda({2, 2});
  Tensor transposed = Tensor::fromStorage(g.storage(), {2, 2}, {1, 2}, 0, DType::kFloat32);
  const std::string message = errorOf([&] { optim::gradNorm({Tensor::ones({2}), transposed}); });
  EXPECT_NE(message.find("cuda:0 is not contiguous"), std::string::npos) << message;
}

TEST(AggregatorDevices, GradientsOfOneParameterOnTwoDevicesAreAnError) {
  const std::string message = errorOf([&] {
    optim::weightedAverage({{Tensor::ones({3})}, {fakeCuda({3})}}, {1.0, 1.0});
  });
  EXPECT_NE(message.find("gradient 0 is on cuda:0, expected cpu"), std::string::npos) << message;
  auto mismatch = optim::bufferMismatch({Tensor::zeros({2})}, {fakeCuda({2})});
  ASSERT_TRUE(mismatch.has_value());
  EXPECT_NE(mismatch->find("buffer 0 is on cuda:0, expected cpu"), std::string::npos) << *mismatch;
}

TEST(DataDevices, LoaderAndBatchRejectAnUnavailableDevice) {
  if (tensor::cuda::deviceCount() > 7) GTEST_SKIP() << "this machine has a cuda:7";
  data::TensorDataset set(Tensor::zeros({8, 2}), Tensor::zeros({8}, DType::kInt64));
  const std::string message =
      errorOf([&] { data::DataLoader loader(set, {.batchSize = 4, .device = Device::cuda(7)}); });
  EXPECT_NE(message.find("DataLoader (options.device cuda:7)"), std::string::npos) << message;
  data::Batch batch{Tensor::zeros({2, 2}), Tensor::zeros({2}, DType::kInt64)};
  EXPECT_THROW(batch.to(Device::cuda(7)), ValueError);
  // The CPU is always there: the same tensors come back.
  data::Batch same = batch.to(Device::cpu());
  EXPECT_TRUE(same.inputs.sameAs(batch.inputs));
}

TEST(DataDevices, DataSetOnADeviceIsRejected) {
  // The loader's gather is a host memcpy: TensorDataset (what every loader holds) refuses device tensors.
  const std::string message = errorOf([&] {
    data::TensorDataset set(fakeCuda({4, 2}), Tensor::zeros({4}, DType::kInt64));
  });
  EXPECT_NE(message.find("must be in host memory, got inputs on cuda:0 and labels on cpu"), std::string::npos)
      << message;
}

// The examples' --device flag (examples/example_util.h), parsed and checked here; tests/CMakeLists.txt runs
// the programs themselves with bad and unavailable devices.
TEST(ExampleDeviceFlag, ParsesCpuCudaAndOrdinals) {
  EXPECT_EQ(examples::parseDevice("cpu"), Device::cpu());
  EXPECT_EQ(examples::parseDevice("cuda"), Device::cuda(0));
  EXPECT_EQ(examples::parseDevice("cuda:0"), Device::cuda(0));
  EXPECT_EQ(examples::parseDevice("cuda:12"), Device::cuda(12));
  for (const char* bad : {"", "gpu", "CUDA", "cuda:", "cuda:-1", "cuda:1x", "cuda:00000", "cuda 0", "cpu:0"}) {
    const std::string message = errorOf([&] { examples::parseDevice(bad); });
    EXPECT_NE(message.find(std::string("bad device '") + bad + "'"), std::string::npos) << message;
  }
}

TEST(ExampleDeviceFlag, UnavailableDeviceReasonNamesTheDeviceAndTheCount) {
  EXPECT_EQ(examples::deviceUnavailableReason(Device::cpu()), "");
  const int count = tensor::cuda::deviceCount();
  const std::string reason = examples::deviceUnavailableReason(Device::cuda(count));
#ifdef DG_WITH_CUDA
  if (count == 0) {
    EXPECT_EQ(reason, "cuda:0 requested but no CUDA device is available (0 devices)");
  } else {
    EXPECT_NE(reason.find("cuda:" + std::to_string(count) + " requested but only " + std::to_string(count)),
              std::string::npos)
        << reason;
    EXPECT_EQ(examples::deviceUnavailableReason(Device::cuda(0)), "");
  }
#else
  EXPECT_EQ(reason, "cuda:0 requested but distgrad was built without CUDA (DG_WITH_CUDA=OFF)");
#endif
}

// ---------------------------------------------------------------- CPU vs CUDA (skip without a GPU)

// Runs `steps` optimizer steps from the same start and gradients on the CPU and on cuda:0, comparing the
// parameters (and every state tensor) after each step.
template <typename MakeOpt>
void compareOptimizer(MakeOpt makeOptimizer, DType dtype, double rtol, double atol) {
  const Shape shape{37, 129};  // not a multiple of the block size: the tail of the grid-stride loop runs
  Tensor cpuParam = randomTensor(shape, 10, dtype);
  Tensor gpuParam = cpuParam.to(kCuda0);
  cpuParam.setRequiresGrad(true);
  gpuParam.setRequiresGrad(true);
  auto cpuOpt = makeOptimizer(cpuParam);
  auto gpuOpt = makeOptimizer(gpuParam);
  for (int step = 0; step < 4; ++step) {
    Tensor grad = randomTensor(shape, 100 + static_cast<uint64_t>(step), dtype);
    cpuParam.setGrad(grad);
    gpuParam.setGrad(grad.to(kCuda0));
    cpuOpt->step();
    gpuOpt->step();
    expectClose(gpuParam, cpuParam, rtol, atol, "parameter after step " + std::to_string(step + 1));
  }
  const StateDict cpuState = cpuOpt->stateDict();
  const StateDict gpuState = gpuOpt->stateDict();
  ASSERT_EQ(cpuState.size(), gpuState.size());
  for (const auto& [key, value] : cpuState) {
    const Tensor* other = gpuState.find(key);
    ASSERT_NE(other, nullptr) << key;
    expectClose(*other, value, rtol, atol, "state " + key);
  }
}

TEST(GpuOptimizer, SgdMatchesCpu) {
  DG_REQUIRE_GPU();
  // float32: the GPU contracts a * b + c into one FMA where the CPU loop may not; a few ulps per step.
  for (bool nesterov : {false, true}) {
    compareOptimizer(
        [&](Tensor p) {
          return std::make_unique<optim::SGD>(
              std::vector<Tensor>{p},
              optim::SgdOptions{.learningRate = 0.05, .momentum = 0.9, .weightDecay = 1e-3, .nesterov = nesterov});
        },
        DType::kFloat32, 1e-5, 1e-6);
  }
  compareOptimizer(
      [](Tensor p) {
        return std::make_unique<optim::SGD>(std::vector<Tensor>{p},
                                            optim::SgdOptions{.learningRate = 0.05, .dampening = 0.0});
      },
      DType::kFloat32, 1e-5, 1e-6);
  compareOptimizer(
      [](Tensor p) {
        return std::make_unique<optim::SGD>(
            std::vector<Tensor>{p}, optim::SgdOptions{.learningRate = 0.05, .momentum = 0.5, .dampening = 0.25});
      },
      DType::kFloat64, 1e-12, 1e-14);
}

TEST(GpuOptimizer, AdamAndAdamWMatchCpu) {
  DG_REQUIRE_GPU();
  for (bool amsgrad : {false, true}) {
    compareOptimizer(
        [&](Tensor p) {
          return std::make_unique<optim::Adam>(
              std::vector<Tensor>{p},
              optim::AdamOptions{.learningRate = 1e-2, .weightDecay = 1e-2, .amsgrad = amsgrad});
        },
        DType::kFloat32, 1e-5, 1e-6);
    compareOptimizer(
        [&](Tensor p) {
          return std::make_unique<optim::AdamW>(std::vector<Tensor>{p},
                                                optim::AdamWOptions{.learningRate = 1e-2, .amsgrad = amsgrad});
        },
        DType::kFloat64, 1e-12, 1e-14);
  }
}

TEST(GpuOptimizer, StateDictMovesBetweenDevices) {
  DG_REQUIRE_GPU();
  Tensor cpuParam = randomTensor({5, 7}, 3);
  Tensor gpuParam = cpuParam.to(kCuda0);
  cpuParam.setRequiresGrad(true);
  gpuParam.setRequiresGrad(true);
  optim::Adam cpuOpt({cpuParam}, {.learningRate = 1e-2});
  optim::Adam gpuOpt({gpuParam}, {.learningRate = 1e-2});
  Tensor grad = randomTensor({5, 7}, 4);
  cpuOpt.step({grad});
  // A CPU optimizer's state (as read back from a checkpoint file) loads into a CUDA optimizer: on its device.
  gpuOpt.loadStateDict(cpuOpt.stateDict());
  ASSERT_EQ(gpuOpt.expAvg(0).device(), kCuda0);
  gpuParam.implPtr()->storage = cpuParam.to(kCuda0).storage();
  cpuOpt.step({grad});
  gpuOpt.step({grad.to(kCuda0)});
  expectClose(gpuParam, cpuParam, 1e-5, 1e-6, "parameter after a step from loaded state");
}

TEST(GpuClipGrad, NormAndScaleMatchCpu) {
  DG_REQUIRE_GPU();
  std::vector<Tensor> cpuGrads{randomTensor({1000}, 5), randomTensor({3, 333}, 6, DType::kFloat64), Tensor::zeros({0})};
  std::vector<Tensor> gpuGrads;
  for (const auto& g : cpuGrads) gpuGrads.push_back(g.to(kCuda0));
  const double cpuNorm = optim::gradNorm(cpuGrads);
  const double gpuNorm = optim::gradNorm(gpuGrads);
  EXPECT_NEAR(gpuNorm, cpuNorm, 1e-9 * cpuNorm);  // both accumulate in double; only the order differs
  // A CPU and a CUDA gradient in one call (model parallel): the norm covers both.
  EXPECT_NEAR(optim::gradNorm({cpuGrads[0], gpuGrads[1]}), cpuNorm, 1e-9 * cpuNorm);
  const double clippedCpu = optim::clipGradients(cpuGrads, 1.0);
  const double clippedGpu = optim::clipGradients(gpuGrads, 1.0);
  EXPECT_NEAR(clippedGpu, clippedCpu, 1e-9 * clippedCpu);
  for (size_t i = 0; i < cpuGrads.size(); ++i) expectClose(gpuGrads[i], cpuGrads[i], 1e-6, 1e-9, "clipped gradient");
  EXPECT_NEAR(optim::gradNorm(gpuGrads), 1.0, 1e-5);
}

TEST(GpuAggregator, WeightedAverageAndBufferMergeMatchCpu) {
  DG_REQUIRE_GPU();
  std::vector<std::vector<Tensor>> cpuSets{{randomTensor({300}, 7), Tensor()},
                                           {randomTensor({300}, 8), randomTensor({2, 2}, 9, DType::kFloat64)}};
  std::vector<std::vector<Tensor>> gpuSets;
  for (const auto& set : cpuSets) {
    std::vector<Tensor> moved;
    for (const auto& g : set) moved.push_back(g.defined() ? g.to(kCuda0) : Tensor());
    gpuSets.push_back(moved);
  }
  const auto cpuAvg = optim::weightedAverage(cpuSets, {32.0, 16.0});
  const auto gpuAvg = optim::weightedAverage(gpuSets, {32.0, 16.0});
  ASSERT_EQ(gpuAvg.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_EQ(gpuAvg[i].device(), kCuda0);
    expectClose(gpuAvg[i], cpuAvg[i], 1e-6, 1e-7, "average " + std::to_string(i));
  }
  Tensor counterA = Tensor::fromVector(std::vector<int64_t>{3, 9}, {2});
  Tensor counterB = Tensor::fromVector(std::vector<int64_t>{5, 1}, {2});
  const auto merged = optim::averageBuffers({{counterA.to(kCuda0)}, {counterB.to(kCuda0)}}, {1.0, 1.0});
  EXPECT_EQ(merged[0].to(Device::cpu()).toVector<int64_t>(), (std::vector<int64_t>{5, 9}));
}

TEST(GpuModule, ToMovesParametersAndBuffersKeepingIdentity) {
  DG_REQUIRE_GPU();
  tensor::Generator gen(11);
  Sequential model;
  model.add(std::make_shared<Linear>(6, 4, gen)).add(std::make_shared<BatchNorm2d>(4));
  const auto handles = model.parameters();
  const StateDict before = model.stateDict();
  model.to(kCuda0);
  EXPECT_EQ(model.device(), kCuda0);
  const auto after = model.parameters();
  for (size_t i = 0; i < handles.size(); ++i) {
    EXPECT_TRUE(handles[i].sameAs(after[i]));
    EXPECT_EQ(handles[i].device(), kCuda0);
    EXPECT_TRUE(handles[i].requiresGrad());
  }
  for (const auto& [name, t] : model.stateDict()) {
    EXPECT_EQ(t.device(), kCuda0) << name;
    expectClose(t, *before.find(name), 0, 0, "moved " + name);
  }
  model.to(Device::cpu());
  for (const auto& [name, t] : model.stateDict()) expectClose(t, *before.find(name), 0, 0, "round trip " + name);
}

TEST(GpuModule, TrainingStepMatchesCpuAndCheckpointsRoundTrip) {
  DG_REQUIRE_GPU();
  auto makeModel = [] {
    tensor::Generator gen(12);
    auto model = std::make_shared<Sequential>();
    model->add(std::make_shared<Linear>(8, 16, gen))
        .add(std::make_shared<BatchNorm2d>(16))
        .add(std::make_shared<ReLU>())
        .add(std::make_shared<Linear>(16, 3, gen));
    return model;
  };
  auto cpuModel = makeModel();
  auto gpuModel = makeModel();
  gpuModel->to(kCuda0);
  optim::SGD cpuOpt(cpuModel->parameters(), {.learningRate = 0.1, .momentum = 0.9});
  optim::SGD gpuOpt(gpuModel->parameters(), {.learningRate = 0.1, .momentum = 0.9});
  Tensor x = randomTensor({10, 8}, 13);
  Tensor y = Tensor::fromVector(std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1, 2, 0}, {10});
  data::Batch gpuBatch = data::Batch{x, y}.to(kCuda0);
  for (int step = 0; step < 3; ++step) {
    cpuOpt.zeroGrad();
    gpuOpt.zeroGrad();
    distgrad::backward(crossEntropy(cpuModel->forward(x), y));
    distgrad::backward(crossEntropy(gpuModel->forward(gpuBatch.inputs), gpuBatch.labels));
    cpuOpt.step();
    gpuOpt.step();
  }
  const StateDict cpuState = cpuModel->stateDict();
  for (const auto& [name, t] : gpuModel->stateDict()) {
    EXPECT_EQ(t.device(), kCuda0) << name;
    expectClose(t, *cpuState.find(name), 1e-4, 1e-5, name);
  }
  auto* bn = dynamic_cast<BatchNorm2d*>(gpuModel->children()[1].get());
  ASSERT_NE(bn, nullptr);
  EXPECT_EQ(bn->numBatchesTracked(), 3);

  // Save from CUDA (copied to the host on write), load into another CUDA module.
  testing::TempDir dir;
  saveCheckpoint(*gpuModel, dir.file("gpu.ckpt"));
  auto restored = makeModel();
  restored->to(kCuda0);
  loadCheckpoint(*restored, dir.file("gpu.ckpt"));
  const StateDict saved = gpuModel->stateDict();
  for (const auto& [name, t] : restored->stateDict()) {
    EXPECT_EQ(t.device(), kCuda0) << name;
    expectClose(t, *saved.find(name), 0, 0, "restored " + name);
  }
}

TEST(GpuData, LoaderDeliversBatchesOnTheDevice) {
  DG_REQUIRE_GPU();
  Tensor inputs = randomTensor({10, 3}, 14);
  Tensor labels = Tensor::arange(10, DType::kInt64);
  data::DataLoader host(data::TensorDataset(inputs, labels), {.batchSize = 4});
  data::DataLoader device(data::TensorDataset(inputs, labels), {.batchSize = 4, .device = kCuda0});
  auto h = host.begin();
  int64_t batches = 0;
  for (const auto& batch : device) {
    ASSERT_EQ(batch.inputs.device(), kCuda0);
    ASSERT_EQ(batch.labels.device(), kCuda0);
    expectClose(batch.inputs, h->inputs, 0, 0, "inputs");
    EXPECT_EQ(batch.labels.to(Device::cpu()).toVector<int64_t>(), h->labels.toVector<int64_t>());
    ++h;
    ++batches;
  }
  EXPECT_EQ(batches, 3);
}

}  // namespace
}  // namespace distgrad::models
