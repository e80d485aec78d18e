// Random tensors on the device (tensor/random.h with a CUDA device).
//
// Note [CUDA random streams]: a Generator is a host object (xoshiro256**); a CUDA uniform/normal call
// draws ONE 64-bit value from it and uses it as the key of a counter-based Philox4x32-10 generator on the
// device. Element group g (4 float32 or 2 float64 values) is a pure function of (key, g), so the values do
// not depend on the launch configuration, the stream or the GPU, and a run is reproducible from the
// Generator's seed and the sequence of calls. CUDA values differ from the CPU's for the same seed (the CPU
// draws from xoshiro directly); only the distribution is the same. The kernel runs on the current stream.
#include <cuda_runtime.h>

#include <type_traits>

#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/tensor_kernels.h"

namespace distgrad::tensor::cuda {
namespace {

constexpr double kTwoPi = 6.28318530717958647692;

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
__device__ __forceinline__ uint4 philox(uint4 ctr, uint2 key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key.x += kW0;
      key.y += kW1;
    }
    const uint32_t lo0 = kM0 * ctr.x, hi0 = __umulhi(kM0, ctr.x);
    const uint32_t lo1 = kM1 * ctr.z, hi1 = __umulhi(kM1, ctr.z);
    ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
  }
  return ctr;
}

// [0, 1) with 24 (float) or 53 (double) random bits; the *Open variants give (0, 1] for logarithms.
__device__ __forceinline__ float unitFloat(uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }
__device__ __forceinline__ float unitFloatOpen(uint32_t x) {
  return static_cast<float>((x >> 8) + 1) * (1.0f / 16777216.0f);
}
__device__ __forceinline__ double unitDouble(uint32_t a, uint32_t b) {
  return static_cast<double>(((static_cast<uint64_t>(a) << 32) | b) >> 11) * (1.0 / 9007199254740992.0);
}
__device__ __forceinline__ double unitDoubleOpen(uint32_t a, uint32_t b) {
  return static_cast<double>((((static_cast<uint64_t>(a) << 32) | b) >> 11) + 1) * (1.0 / 9007199254740992.0);
}

template <typename T>
__global__ void randomKernel(T* out, int64_t n, uint2 key, bool isNormal, double p0, double p1) {
  constexpr int kPerGroup = std::is_same_v<T, float> ? 4 : 2;
  const int64_t groups = (n + kPerGroup - 1) / kPerGroup;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const uint4 r = philox(make_uint4(static_cast<uint32_t>(g), static_cast<uint32_t>(static_cast<uint64_t>(g) >> 32), 0, 0), key);
    T v[kPerGroup];
    if constexpr (std::is_same_v<T, float>) {
      if (isNormal) {  // Box-Muller on (x, y) and (z, w); p0 = mean, p1 = stddev
        const float r0 = sqrtf(-2.0f * logf(unitFloatOpen(r.x))), t0 = static_cast<float>(kTwoPi) * unitFloat(r.y);
        const float r1 = sqrtf(-2.0f * logf(unitFloatOpen(r.z))), t1 = static_cast<float>(kTwoPi) * unitFloat(r.w);
        float s0, c0, s1, c1;
        sincosf(t0, &s0, &c0);
        sincosf(t1, &s1, &c1);
        const float mean = static_cast<float>(p0), sd = static_cast<float>(p1);
        v[0] = mean + sd * r0 * c0;
        v[1] = mean + sd * r0 * s0;
        v[2] = mean + sd * r1 * c1;
        v[3] = mean + sd * r1 * s1;
      } else {  // p0 = low, p1 = high, computed in double as on the CPU
        v[0] = static_cast<float>(p0 + (p1 - p0) * unitFloat(r.x));
        v[1] = static_cast<float>(p0 + (p1 - p0) * unitFloat(r.y));
        v[2] = static_cast<float>(p0 + (p1 - p0) * unitFloat(r.z));
        v[3] = static_cast<float>(p0 + (p1 - p0) * unitFloat(r.w));
      }
    } else {
      if (isNormal) {
        const double rad = sqrt(-2.0 * log(unitDoubleOpen(r.x, r.y)));
        double s, c;
        sincos(kTwoPi * unitDouble(r.z, r.w), &s, &c);
        v[0] = p0 + p1 * rad * c;
        v[1] = p0 + p1 * rad * s;
      } else {
        v[0] = p0 + (p1 - p0) * unitDouble(r.x, r.y);
        v[1] = p0 + (p1 - p0) * unitDouble(r.z, r.w);
      }
    }
#pragma unroll
    for (int j = 0; j < kPerGroup; ++j) {
      const int64_t i = g * kPerGroup + j;
      if (i < n) out[i] = v[j];
    }
  }
}

Tensor generate(const Shape& shape, uint64_t seed, DType dtype, Device device, bool isNormal, double p0, double p1,
                const char* op) {
  DG_CHECK(isFloatingPoint(dtype), "random tensors must be floating point, got ", dtypeName(dtype));
  requireDevice(device.index, op);
  // The 16-bit storage types are drawn in float32 and rounded, as the CPU draws in float64 and rounds.
  const DType drawType = dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  Tensor t = Tensor::empty(shape, drawType, device);
  const int64_t n = t.numel();
  if (n > 0) {
    const uint2 key = make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    const int64_t groups = (n + 1) / 2;  // an upper bound for both group sizes
    DeviceGuard guard(device.index);
    cudaStream_t stream = currentStream(device);
    if (drawType == DType::kFloat32) {
      randomKernel<float><<<blocksFor(groups), kThreads, 0, stream>>>(typed<float>(t), n, key, isNormal, p0, p1);
    } else {
      randomKernel<double><<<blocksFor(groups), kThreads, 0, stream>>>(typed<double>(t), n, key, isNormal, p0, p1);
    }
    checkLaunch(op);
  }
  return dtype == drawType ? t : t.toDType(dtype);
}

}  // namespace

Tensor uniform(const Shape& shape, double low, double high, uint64_t seed, DType dtype, Device device) {
  return generate(shape, seed, dtype, device, /*isNormal=*/false, low, high, "uniform");
}

Tensor normal(const Shape& shape, double mean, double stddev, uint64_t seed, DType dtype, Device device) {
  return generate(shape, seed, dtype, device, /*isNormal=*/true, mean, stddev, "normal");
}

}  // namespace distgrad::tensor::cuda
