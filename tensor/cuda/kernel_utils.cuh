// Internal to the CUDA kernels (.cu files): strided indexing, launch configuration and launch checks.
//
// Note [CUDA pointwise indexing]: an op over operands of one logical shape (the output's) visits every
// linear index i of that shape with a grid-stride loop (int64, so more than 2^31 elements work with any
// grid) and turns i into each operand's element offset with OffsetCalc: the shape's dims are first
// coalesced (size-1 dims dropped, dims contiguous in every operand merged; kernels::coalesceDims), so
// contiguous operands cost one multiply per element, and broadcast operands carry stride 0 in broadcast
// dims. Up to kMaxDims dims remain after coalescing (more is a clear ValueError).
// Thread-safety: stateless.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "tensor/cpu/strided.h"
#include "tensor/cuda/cuda_check.h"
#include "tensor/cuda/runtime.h"
#include "tensor/tensor.h"

namespace distgrad::tensor::cuda {

inline constexpr int kMaxDims = 16;
inline constexpr int kThreads = 256;

template <int N>
struct OffsetCalc {
  int nd = 0;
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims][N];  // in elements

  // Element offsets of linear index i (row-major over sizes) in each operand.
  __device__ __forceinline__ void get(int64_t i, int64_t (&off)[N]) const {
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] = 0;
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t size = sizes[d];
      const int64_t q = i / size;
      const int64_t r = i - q * size;
      i = q;
#pragma unroll
      for (int k = 0; k < N; ++k) off[k] += r * strides[d][k];
    }
  }
};

// Strides (in elements) of t viewed at outShape under broadcasting: 0 where t has size 1 or lacks the dim.
inline Shape broadcastStridesOf(const Tensor& t, const Shape& outShape) {
  const size_t nd = outShape.size();
  const size_t td = t.shape().size();
  Shape strides(nd, 0);
  for (size_t i = 0; i < td; ++i) strides[nd - td + i] = t.shape()[i] == 1 ? 0 : t.strides()[i];
  return strides;
}

template <int N>
OffsetCalc<N> makeOffsetCalc(Shape shape, std::array<Shape, N> strides, const char* op) {
  kernels::coalesceDims(shape, strides);
  DG_CHECK(static_cast<int>(shape.size()) <= kMaxDims, op, ": CUDA kernels support at most ", kMaxDims,
           " non-mergeable dims, got ", shape.size());
  OffsetCalc<N> calc;
  calc.nd = static_cast<int>(shape.size());
  for (int d = 0; d < calc.nd; ++d) {
    calc.sizes[d] = shape[d];
    for (int k = 0; k < N; ++k) calc.strides[d][k] = strides[k][d];
  }
  return calc;
}

inline unsigned blocksFor(int64_t n) {
  // Grid-stride loops cover the rest; 2^16 blocks of 256 threads keep every SM busy on any current GPU.
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, int64_t{1} << 16));
}

inline void checkLaunch(const char* op) {
  checkCuda(cudaGetLastError(), op);
}

inline cudaStream_t currentStream(const Device& device) { return rawStream(Stream::current(device.index)); }

// Calls f(i, offsets) for every linear index i < n.
template <int N, typename F>
__global__ void pointwiseKernel(int64_t n, OffsetCalc<N> calc, F f) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    int64_t off[N];
    calc.get(i, off);
    f(off);
  }
}

// Launches f over every element of `shape` (operand k's strides in strides[k]) on the current stream of
// `device`. numel == 0 launches nothing.
template <int N, typename F>
void launchPointwise(const char* op, const Device& device, const Shape& shape, const std::array<Shape, N>& strides,
                     F f) {
  const int64_t n = numelOf(shape);
  if (n == 0) return;
  OffsetCalc<N> calc = makeOffsetCalc<N>(shape, strides, op);
  DeviceGuard guard(device.index);
  pointwiseKernel<N, F><<<blocksFor(n), kThreads, 0, currentStream(device)>>>(n, calc, f);
  checkLaunch(op);
}

// Typed pointer to element 0 of t's view.
template <typename T>
inline T* typed(const Tensor& t) {
  return static_cast<T*>(t.rawData());
}

}  // namespace distgrad::tensor::cuda
