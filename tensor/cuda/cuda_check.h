// Internal to the CUDA backend: include only from sources compiled with DG_WITH_CUDA (they see the CUDA
// runtime headers). DG_CUDA_CHECK turns a failed runtime call into a ValueError naming the call and CUDA's
// message; rawStream() unwraps a Stream for kernel launches and library calls.
// Thread-safety: stateless.
#pragma once

#include <cuda_runtime_api.h>

#include "tensor/cuda/runtime.h"
#include "tensor/error.h"

#ifndef DG_WITH_CUDA
#error "tensor/cuda/cuda_check.h needs a build with DG_WITH_CUDA"
#endif

namespace distgrad::tensor::cuda {

inline void checkCuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) [[unlikely]] {
    cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
    throw ValueError(detail::concatMessage(what, " failed: ", cudaGetErrorString(err)));
  }
}

inline cudaStream_t rawStream(const Stream& stream) { return static_cast<cudaStream_t>(stream.handle()); }

}  // namespace distgrad::tensor::cuda

#define DG_CUDA_CHECK(expr) ::distgrad::tensor::cuda::checkCuda((expr), #expr)
