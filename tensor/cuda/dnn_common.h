// Internal to the CUDA backend (sources built with DG_WITH_CUDA): small helpers the Tensor-level CUDA ops
// share (blas_linalg.cpp, cudnn_ops.cpp, dnn_ops.cpp).
// Thread-safety: stateless.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "tensor/cuda/cuda_check.h"
#include "tensor/tensor.h"

namespace distgrad::tensor::cuda::dnn_detail {

// The device of a CUDA operand (callers have checked placement with onCuda).
inline int deviceOf(const Tensor& t) { return t.device().index; }

// A contiguous tensor with t's values on t's device: t itself when it is already contiguous, else a
// device-side copy (kernels::contiguous, the shape kernels' CUDA path).
Tensor contiguousOnDevice(const Tensor& t);

// Uninitialised / zero-filled tensors on `device`; the zero fill is a cudaMemsetAsync on `stream`.
Tensor emptyOn(const Shape& shape, DType dtype, int device);
Tensor zerosOn(const Shape& shape, DType dtype, int device, cudaStream_t stream);

// float32/float64 only on CUDA; names the op, operand and dtype otherwise.
void requireFloatOperand(const Tensor& t, const char* op, const char* what);

// Throws ValueError "<op>: <indexWord> V at position I is out of range for <limit> <rangeText> (expected
// 0..limit-1)" (the CPU kernels' wording) for the first index outside [0, limit). Waits for `stream` (not
// the device) to read the verdict.
void checkIndicesInRange(const Tensor& indices, int64_t limit, cudaStream_t stream, const char* op,
                         const char* indexWord, const char* rangeText);

}  // namespace distgrad::tensor::cuda::dnn_detail
