#include "tensor/random.h"

#include <cmath>
#include <numbers>

#include "tensor/cuda/tensor_kernels.h"

namespace distgrad::tensor {
namespace {
uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

template <typename F>
Tensor generate(const Shape& shape, DType dtype, F&& sample) {
  DG_CHECK(isFloatingPoint(dtype), "random tensors must be floating point, got ", dtypeName(dtype));
  Tensor t = Tensor::empty(shape, DType::kFloat64);
  double* p = t.data<double>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = sample();
  return dtype == DType::kFloat64 ? t : t.toDType(dtype);
}
}  // namespace

void Generator::manualSeed(uint64_t seed) {
  uint64_t x = seed;
  for (auto& s : state_) s = splitmix64(x);
  hasSpare_ = false;
}

uint64_t Generator::nextU64() {
  const uint64_t result = rotl(state_[1] * 5, 7) * 9;
  const uint64_t t = state_[1] << 17;
  state_[2] ^= state_[0];
  state_[3] ^= state_[1];
  state_[1] ^= state_[2];
  state_[0] ^= state_[3];
  state_[2] ^= t;
  state_[3] = rotl(state_[3], 45);
  return result;
}

double Generator::uniform01() { return static_cast<double>(nextU64() >> 11) * 0x1.0p-53; }

double Generator::normal() {
  if (hasSpare_) {
    hasSpare_ = false;
    return spare_;
  }
  double u1 = uniform01();
  while (u1 <= 0.0) u1 = uniform01();
  double u2 = uniform01();
  double r = std::sqrt(-2.0 * std::log(u1));
  spare_ = r * std::sin(2 * std::numbers::pi * u2);
  hasSpare_ = true;
  return r * std::cos(2 * std::numbers::pi * u2);
}

uint64_t Generator::below(uint64_t n) {
  DG_CHECK(n > 0, "Generator::below: n must be > 0");
  // Lemire's rejection keeps the result unbiased.
  uint64_t threshold = -n % n;
  while (true) {
    uint64_t r = nextU64();
    if (r >= threshold) return r % n;
  }
}

Tensor uniform(const Shape& shape, double low, double high, Generator& gen, DType dtype, Device device) {
  DG_CHECK(low <= high, "uniform: low (", low, ") must be <= high (", high, ")");
  if (device.isCuda()) return cuda::uniform(shape, low, high, gen.nextU64(), dtype, device);
  return generate(shape, dtype, [&] { return low + (high - low) * gen.uniform01(); });
}

Tensor normal(const Shape& shape, double mean, double stddev, Generator& gen, DType dtype, Device device) {
  DG_CHECK(stddev >= 0, "normal: stddev must be >= 0, got ", stddev);
  if (device.isCuda()) return cuda::normal(shape, mean, stddev, gen.nextU64(), dtype, device);
  return generate(shape, dtype, [&] { return mean + stddev * gen.normal(); });
}

Tensor randperm(int64_t n, Generator& gen, Device device) {
  DG_CHECK(n >= 0, "randperm: n must be >= 0, got ", n);
  Tensor t = Tensor::arange(n, DType::kInt64);
  int64_t* p = t.data<int64_t>();
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[gen.below(static_cast<uint64_t>(i + 1))]);
  return device.isCpu() ? t : t.to(device);
}

int64_t fanIn(const Shape& s) {
  DG_CHECK(s.size() >= 2, "fanIn: weight must have at least 2 dims, got ", shapeStr(s));
  int64_t f = s[1];
  for (size_t i = 2; i < s.size(); ++i) f *= s[i];
  return f;
}

Tensor kaimingUniform(const Shape& shape, Generator& gen, double a, Device device) {
  double gain = std::sqrt(2.0 / (1.0 + a * a));
  double bound = gain * std::sqrt(3.0 / static_cast<double>(fanIn(shape)));
  return uniform(shape, -bound, bound, gen, DType::kFloat32, device);
}

Tensor kaimingNormalFanOut(const Shape& shape, Generator& gen, Device device) {
  DG_CHECK(shape.size() >= 2, "kaimingNormalFanOut: weight must have at least 2 dims");
  int64_t fanOut = shape[0];
  for (size_t i = 2; i < shape.size(); ++i) fanOut *= shape[i];
  return normal(shape, 0.0, std::sqrt(2.0 / static_cast<double>(fanOut)), gen, DType::kFloat32, device);
}

}  // namespace distgrad::tensor
