// Raw CUDA device memory for Storage. Built against the CUDA runtime when DG_WITH_CUDA is on; otherwise
// every call fails with a clear error. The caching allocator and streams come with the CUDA backend issue.
// Thread-safety: all functions are thread-safe.
#pragma once

#include <cstddef>

#include "tensor/cuda/runtime.h"

namespace distgrad::tensor::cuda {

void* deviceAlloc(size_t nbytes, int device);
void deviceFree(void* ptr, int device) noexcept;
// Copies between host and device memory (direction inferred by the runtime).
void copyBytes(void* dst, const void* src, size_t nbytes, int device);

}  // namespace distgrad::tensor::cuda
