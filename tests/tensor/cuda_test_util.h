// Helpers every CUDA test shares (tests/tensor and tests/autograd): a skip for machines without a GPU,
// CUDA copies of CPU inputs, element-wise comparison with a stated tolerance, and CPU-vs-CUDA checks of an
// op's values and (through autograd) gradients. The API is deliberately small and stable; other CUDA test
// files copy its shape.
//
// Usage:
//   TEST(CudaElementwise, Add) {
//     DG_SKIP_WITHOUT_CUDA();
//     cuda_testing::expectCudaMatchesCpu([](const std::vector<Tensor>& in) { return std::vector{add(in[0], in[1])}; },
//                                        {randomTensor({3, 4}, 1), randomTensor({4}, 2)}, kFloat32Tol, "add");
//   }
//
// expectCudaGradsMatchCpu needs autograd (link dg_autograd); the rest needs only dg_tensor. Inline functions
// that a test never calls are never emitted, so tensor_tests can include this header without autograd.
// Thread-safety: single-threaded test code.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "tensor/cuda/runtime.h"
#include "tensor/error.h"
#include "tensor/random.h"
#include "tensor/tensor.h"

// Skips the current test (returns from it) unless a usable CUDA device is present.
#define DG_SKIP_WITHOUT_CUDA()                                                   \
  do {                                                                           \
    if (!::distgrad::tensor::cuda::isAvailable()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

namespace distgrad::cuda_testing {

// |actual - expected| <= atol + rtol * |expected| per element.
struct Tolerance {
  double rtol = 1e-5;
  double atol = 1e-6;
};
// Different summation orders and device math libraries (CUDA's expf/tanhf vs our vectorised CPU versions)
// differ by a few ulp; float32 reductions over thousands of elements by more.
inline constexpr Tolerance kFloat32Tol{1e-5, 1e-6};
inline constexpr Tolerance kFloat64Tol{1e-11, 1e-13};
inline constexpr Tolerance kExact{0, 0};

inline Device cudaDevice(int index = 0) { return Device::cuda(index); }

// Normal(0, 1) values (int64: uniform in [-10, 10)) from a generator seeded with `seed`, on the CPU.
inline Tensor randomTensor(const Shape& shape, uint64_t seed, DType dtype = DType::kFloat32) {
  tensor::Generator gen(seed);
  if (dtype == DType::kInt64) return tensor::uniform(shape, -10, 10, gen, DType::kFloat64).toDType(DType::kInt64);
  return tensor::normal(shape, 0, 1, gen, dtype);
}

// A copy of `cpu` on the CUDA device with the same shape, dtype, values AND layout (strides, offset: a
// transposed or sliced CPU view gives the same view of a device copy of its storage), so strided device
// paths are exercised; a leaf requiring grad when `cpu` does.
inline Tensor cudaCopyOf(const Tensor& cpu, int device = 0) {
  if (!cpu.defined()) return cpu;
  Tensor out;
  if (cpu.isContiguous() && cpu.offset() == 0) {
    out = cpu.detach().to(cudaDevice(device));
  } else {
    const tensor::Storage& storage = cpu.storage();
    const int64_t elements = static_cast<int64_t>(storage.nbytes() / cpu.itemSize());
    Tensor whole = Tensor::fromStorage(storage, {elements}, {1}, 0, cpu.dtype()).to(cudaDevice(device));
    out = Tensor::fromStorage(whole.storage(), cpu.shape(), cpu.strides(), cpu.offset(), cpu.dtype());
  }
  if (cpu.requiresGrad()) out.setRequiresGrad(true);
  return out;
}

// Element-wise comparison (actual may live on any device). NaNs must match NaNs and infinities must match
// exactly; shapes and dtypes must agree.
inline ::testing::AssertionResult tensorsClose(const Tensor& actual, const Tensor& expected, Tolerance tol) {
  if (actual.defined() != expected.defined()) {
    return ::testing::AssertionFailure() << "one tensor is undefined (actual " << actual.defined() << ", expected "
                                         << expected.defined() << ")";
  }
  if (!actual.defined()) return ::testing::AssertionSuccess();
  if (actual.shape() != expected.shape()) {
    return ::testing::AssertionFailure() << "shape " << tensor::shapeStr(actual.shape()) << " vs expected "
                                         << tensor::shapeStr(expected.shape());
  }
  if (actual.dtype() != expected.dtype()) {
    return ::testing::AssertionFailure() << "dtype " << actual.dtype() << " vs expected " << expected.dtype();
  }
  const std::vector<double> a = actual.toVector<double>();
  const std::vector<double> e = expected.toVector<double>();
  for (size_t i = 0; i < a.size(); ++i) {
    const bool bothNan = std::isnan(a[i]) && std::isnan(e[i]);
    const bool sameInf = std::isinf(e[i]) && a[i] == e[i];
    if (bothNan || sameInf) continue;
    if (!(std::abs(a[i] - e[i]) <= tol.atol + tol.rtol * std::abs(e[i]))) {
      return ::testing::AssertionFailure() << "element " << i << " of " << a.size() << ": " << a[i] << " vs expected "
                                           << e[i] << " (rtol " << tol.rtol << ", atol " << tol.atol << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

using TensorFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// Runs fn on `cpuInputs` and on CUDA copies of them (device 0). Every CUDA output must live on that device
// and match the CPU output in shape, dtype and values within `tol`.
inline void expectCudaMatchesCpu(const TensorFn& fn, const std::vector<Tensor>& cpuInputs, Tolerance tol,
                                 const std::string& what) {
  std::vector<Tensor> cudaInputs;
  for (const Tensor& t : cpuInputs) cudaInputs.push_back(cudaCopyOf(t));
  const std::vector<Tensor> expected = fn(cpuInputs);
  const std::vector<Tensor> actual = fn(cudaInputs);
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i].defined()) {
      EXPECT_EQ(actual[i].device(), cudaDevice()) << what << " output " << i;
    }
    EXPECT_TRUE(tensorsClose(actual[i], expected[i], tol)) << what << " output " << i;
  }
}

// expectCudaMatchesCpu, then gradients: every input that requires grad is a leaf on both devices; the
// outputs are back-propagated with the same seeded upstream gradients on both, and d/d(input) of the CUDA
// run (which must be on the device) must match the CPU's within `tol`. Needs dg_autograd.
inline void expectCudaGradsMatchCpu(const TensorFn& fn, const std::vector<Tensor>& cpuInputs, Tolerance tol,
                                    const std::string& what) {
  std::vector<Tensor> cudaInputs;
  std::vector<Tensor> cpuLeaves, cudaLeaves;
  for (const Tensor& t : cpuInputs) {
    cudaInputs.push_back(cudaCopyOf(t));
    if (t.defined() && t.requiresGrad()) {
      cpuLeaves.push_back(t);
      cudaLeaves.push_back(cudaInputs.back());
    }
  }
  ASSERT_FALSE(cpuLeaves.empty()) << what << ": no input requires grad";
  const std::vector<Tensor> cpuOut = fn(cpuInputs);
  const std::vector<Tensor> cudaOut = fn(cudaInputs);
  ASSERT_EQ(cpuOut.size(), cudaOut.size()) << what;
  std::vector<Tensor> cpuRoots, cudaRoots, cpuSeeds, cudaSeeds;
  for (size_t i = 0; i < cpuOut.size(); ++i) {
    ASSERT_TRUE(tensorsClose(cudaOut[i], cpuOut[i], tol)) << what << " output " << i;
    if (!cpuOut[i].defined() || !cpuOut[i].requiresGrad()) continue;
    Tensor seed = randomTensor(cpuOut[i].shape(), 1000 + i, cpuOut[i].dtype());
    cpuRoots.push_back(cpuOut[i]);
    cudaRoots.push_back(cudaOut[i]);
    cpuSeeds.push_back(seed);
    cudaSeeds.push_back(seed.to(cudaDevice()));
  }
  ASSERT_FALSE(cpuRoots.empty()) << what << ": no output requires grad";
  const std::vector<Tensor> expected = autograd::grad(cpuRoots, cpuLeaves, cpuSeeds);
  const std::vector<Tensor> actual = autograd::grad(cudaRoots, cudaLeaves, cudaSeeds);
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (actual[i].defined()) {
      EXPECT_EQ(actual[i].device(), cudaDevice()) << what << " gradient " << i;
    }
    EXPECT_TRUE(tensorsClose(actual[i], expected[i], tol)) << what << " gradient of input " << i;
  }
}

// f must throw a ValueError whose message contains every fragment.
template <typename F>
void expectValueErrorMentions(F&& f, std::initializer_list<std::string> fragments) {
  try {
    f();
    ADD_FAILURE() << "expected a ValueError";
  } catch (const ValueError& e) {
    const std::string message = e.what();
    for (const std::string& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos) << "'" << fragment << "' missing from: " << message;
    }
  }
}

}  // namespace distgrad::cuda_testing
