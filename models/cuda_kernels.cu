// The CUDA side of models/cuda_kernels.h. Each kernel mirrors the CPU loop it replaces (models/optim/sgd.cpp,
// adam.cpp, clip_grad.cpp, gradient_aggregator.cpp) expression for expression, so float32 results differ
// from the CPU's only by the GPU's fused multiply-adds and sqrt rounding (tests compare with a tolerance).
// Compiled, untested on hardware (no GPU was available when this was written).
#include <cuda_runtime_api.h>

#include <algorithm>

#include "models/cuda_kernels.h"
#include "tensor/cuda/cuda_check.h"

namespace distgrad::models::detail {
namespace {

using tensor::cuda::DeviceGuard;
using tensor::cuda::rawStream;
using tensor::cuda::Stream;

constexpr int kThreads = 256;
// Enough blocks to fill an H100 several times over; larger tensors loop (grid-stride), which also keeps the
// grid inside CUDA's limits for any n.
constexpr int64_t kMaxBlocks = 4096;

int blocksFor(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks)); }

void checkLaunch(const char* kernel) { tensor::cuda::checkCuda(cudaGetLastError(), kernel); }

template <typename T, bool kMomentum, bool kFirstStep, bool kNesterov>
__global__ void sgdKernel(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ buf, int64_t n, T lr, T wd, T mom,
                          T keep) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T d = g[i] + wd * p[i];
    if constexpr (!kMomentum) {
      p[i] -= lr * d;
    } else {
      const T b = kFirstStep ? d : mom * buf[i] + keep * d;
      buf[i] = b;
      p[i] -= lr * (kNesterov ? d + mom * b : b);
    }
  }
}

template <typename T, bool kAmsgrad>
__global__ void adamKernel(T* __restrict__ p, const T* __restrict__ g, T* __restrict__ m, T* __restrict__ v,
                           T* __restrict__ vmax, int64_t n, T b1, T b2, T oneMinusB1, T oneMinusB2, T eps, T l2,
                           T decay, T stepSize, T invBc2Sqrt) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const T pi = p[i] * decay;
    const T gi = g[i] + l2 * p[i];
    const T mi = b1 * m[i] + oneMinusB1 * gi;
    const T vi = b2 * v[i] + oneMinusB2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    T denomSource = vi;
    if constexpr (kAmsgrad) {
      denomSource = vmax[i] > vi ? vmax[i] : vi;
      vmax[i] = denomSource;
    }
    p[i] = pi - stepSize * mi / (sqrt(denomSource) * invBc2Sqrt + eps);
  }
}

template <typename T>
__global__ void sumOfSquaresKernel(const T* __restrict__ x, int64_t n, double* __restrict__ accumulator) {
  __shared__ double partial[kThreads];
  double s = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double xi = static_cast<double>(x[i]);
    s += xi * xi;
  }
  partial[threadIdx.x] = s;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (static_cast<int>(threadIdx.x) < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(accumulator, partial[0]);
}

template <typename T>
__global__ void scaleKernel(T* __restrict__ x, int64_t n, T factor) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) x[i] *= factor;
}

template <typename T>
__global__ void axpyKernel(T* __restrict__ acc, const T* __restrict__ src, int64_t n, T factor) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    acc[i] += factor * src[i];
  }
}

__global__ void maxInt64Kernel(int64_t* __restrict__ acc, const int64_t* __restrict__ src, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    acc[i] = acc[i] > src[i] ? acc[i] : src[i];
  }
}

__global__ void incrementKernel(int64_t* value) { ++*value; }

template <typename T, bool kMomentum, bool kFirstStep, bool kNesterov>
void launchSgd(cudaStream_t stream, T* p, const T* g, T* buf, int64_t n, const SgdStepArgs& a) {
  sgdKernel<T, kMomentum, kFirstStep, kNesterov><<<blocksFor(n), kThreads, 0, stream>>>(
      p, g, buf, n, static_cast<T>(a.learningRate), static_cast<T>(a.weightDecay), static_cast<T>(a.momentum),
      static_cast<T>(1.0 - a.dampening));
}

}  // namespace

template <typename T>
void sgdStepCuda(int device, T* param, const T* grad, T* momentumBuffer, int64_t n, const SgdStepArgs& args) {
  if (n == 0) return;
  DeviceGuard guard(device);
  cudaStream_t stream = rawStream(Stream::current(device));
  if (momentumBuffer == nullptr) {
    launchSgd<T, false, false, false>(stream, param, grad, momentumBuffer, n, args);
  } else if (args.firstStep) {
    if (args.nesterov)
      launchSgd<T, true, true, true>(stream, param, grad, momentumBuffer, n, args);
    else
      launchSgd<T, true, true, false>(stream, param, grad, momentumBuffer, n, args);
  } else {
    if (args.nesterov)
      launchSgd<T, true, false, true>(stream, param, grad, momentumBuffer, n, args);
    else
      launchSgd<T, true, false, false>(stream, param, grad, momentumBuffer, n, args);
  }
  checkLaunch("SGD step kernel");
}

template <typename T>
void adamStepCuda(int device, T* param, const T* grad, T* expAvg, T* expAvgSq, T* maxExpAvgSq, int64_t n,
                  const AdamStepArgs& a) {
  if (n == 0) return;
  DeviceGuard guard(device);
  cudaStream_t stream = rawStream(Stream::current(device));
  const T b1 = static_cast<T>(a.beta1), b2 = static_cast<T>(a.beta2);
  const T oneMinusB1 = static_cast<T>(1.0 - a.beta1), oneMinusB2 = static_cast<T>(1.0 - a.beta2);
  const T eps = static_cast<T>(a.eps), l2 = static_cast<T>(a.l2), decay = static_cast<T>(a.decay);
  const T stepSize = static_cast<T>(a.stepSize), invBc2Sqrt = static_cast<T>(a.invBiasCorrection2Sqrt);
  if (maxExpAvgSq == nullptr) {
    adamKernel<T, false><<<blocksFor(n), kThreads, 0, stream>>>(param, grad, expAvg, expAvgSq, maxExpAvgSq, n, b1, b2,
                                                                oneMinusB1, oneMinusB2, eps, l2, decay, stepSize,
                                                                invBc2Sqrt);
  } else {
    adamKernel<T, true><<<blocksFor(n), kThreads, 0, stream>>>(param, grad, expAvg, expAvgSq, maxExpAvgSq, n, b1, b2,
                                                               oneMinusB1, oneMinusB2, eps, l2, decay, stepSize,
                                                               invBc2Sqrt);
  }
  checkLaunch("Adam step kernel");
}

template <typename T>
void addSumOfSquaresCuda(int device, const T* x, int64_t n, double* accumulator) {
  if (n == 0) return;
  DeviceGuard guard(device);
  sumOfSquaresKernel<T><<<blocksFor(n), kThreads, 0, rawStream(Stream::current(device))>>>(x, n, accumulator);
  checkLaunch("gradient norm kernel");
}

double readDeviceDouble(int device, const double* value) {
  DeviceGuard guard(device);
  cudaStream_t stream = rawStream(Stream::current(device));
  double host = 0;
  // Into pageable memory: the copy is staged, and the stream sync below is what makes `host` valid.
  DG_CUDA_CHECK(cudaMemcpyAsync(&host, value, sizeof(double), cudaMemcpyDeviceToHost, stream));
  DG_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

template <typename T>
void scaleCuda(int device, T* x, int64_t n, double factor) {
  if (n == 0) return;
  DeviceGuard guard(device);
  scaleKernel<T><<<blocksFor(n), kThreads, 0, rawStream(Stream::current(device))>>>(x, n, static_cast<T>(factor));
  checkLaunch("gradient scale kernel");
}

template <typename T>
void axpyCuda(int device, T* acc, const T* src, int64_t n, double factor) {
  if (n == 0) return;
  DeviceGuard guard(device);
  axpyKernel<T><<<blocksFor(n), kThreads, 0, rawStream(Stream::current(device))>>>(acc, src, n, static_cast<T>(factor));
  checkLaunch("weighted average kernel");
}

void maxInt64Cuda(int device, int64_t* acc, const int64_t* src, int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  maxInt64Kernel<<<blocksFor(n), kThreads, 0, rawStream(Stream::current(device))>>>(acc, src, n);
  checkLaunch("buffer maximum kernel");
}

void incrementInt64Cuda(int device, int64_t* value) {
  DeviceGuard guard(device);
  incrementKernel<<<1, 1, 0, rawStream(Stream::current(device))>>>(value);
  checkLaunch("counter increment kernel");
}

void zeroBytesCuda(int device, void* ptr, size_t nbytes) {
  if (nbytes == 0) return;
  DeviceGuard guard(device);
  DG_CUDA_CHECK(cudaMemsetAsync(ptr, 0, nbytes, rawStream(Stream::current(device))));
}

#define DG_INSTANTIATE_MODEL_KERNELS(T)                                                       \
  template void sgdStepCuda<T>(int, T*, const T*, T*, int64_t, const SgdStepArgs&);           \
  template void adamStepCuda<T>(int, T*, const T*, T*, T*, T*, int64_t, const AdamStepArgs&); \
  template void addSumOfSquaresCuda<T>(int, const T*, int64_t, double*);                      \
  template void scaleCuda<T>(int, T*, int64_t, double);                                       \
  template void axpyCuda<T>(int, T*, const T*, int64_t, double);
DG_INSTANTIATE_MODEL_KERNELS(float)
DG_INSTANTIATE_MODEL_KERNELS(double)
#undef DG_INSTANTIATE_MODEL_KERNELS

}  // namespace distgrad::models::detail
