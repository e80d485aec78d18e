// Seeded random number generation for tensors and initialisers.
// There is no process-wide generator: callers own a Generator and pass it, so runs are reproducible and
// threads never contend. Thread-safety: a Generator is not thread-safe; use one per thread.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace distgrad::tensor {

// xoshiro256** seeded through splitmix64: fast, good statistical quality, fully reproducible.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0x5EEDull) { manualSeed(seed); }
  void manualSeed(uint64_t seed);
  uint64_t nextU64();
  double uniform01();        // [0, 1)
  double normal();           // standard normal (Box-Muller, caches the second value)
  uint64_t below(uint64_t n);  // uniform in [0, n), n > 0

 private:
  uint64_t state_[4];
  bool hasSpare_ = false;
  double spare_ = 0;
};

// On a CUDA device the values come from a device-side Philox generator keyed by one draw from `gen`
// (Note [CUDA random streams] in tensor/cuda/random.cu): reproducible from the seed, but not equal to the
// CPU's values for the same seed.
Tensor uniform(const Shape& shape, double low, double high, Generator& gen, DType dtype = DType::kFloat32,
               Device device = Device::cpu());
Tensor normal(const Shape& shape, double mean, double stddev, Generator& gen, DType dtype = DType::kFloat32,
              Device device = Device::cpu());
// A random permutation of 0..n-1 (int64), drawn on the host (the same values for every device).
Tensor randperm(int64_t n, Generator& gen, Device device = Device::cpu());

// fan-in of a weight shaped [out, in, k...] (Linear and Conv layouts).
int64_t fanIn(const Shape& weightShape);
// Kaiming/He uniform init with gain sqrt(2 / (1 + a^2)), bound = gain * sqrt(3 / fanIn).
Tensor kaimingUniform(const Shape& shape, Generator& gen, double a = 0.0, Device device = Device::cpu());
// Kaiming normal (fan-out, ReLU), as torchvision ResNets use for convolutions.
Tensor kaimingNormalFanOut(const Shape& shape, Generator& gen, Device device = Device::cpu());

}  // namespace distgrad::tensor
