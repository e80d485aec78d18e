// Raw reduction CPU kernels: sums over any set of dims, max/argmax over one dim, max over all elements.
// Not differentiable (autograd/ops/reduction.cpp records the graph).
//
// Sums accumulate float32 in float64 (per output element; runs are summed in float32 lanes in short
// blocks first), so long reductions stay accurate without giving up vectorisation. Both reduction
// patterns are fast: reducing the innermost dims (a contiguous run per output) and reducing leading or
// interleaved dims (e.g. N,H,W of NCHW for a bias gradient: rows are added into the output elementwise).
// Thread-safety: stateless; safe to call concurrently.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace distgrad::tensor::kernels {

// Normalises dims (wrapping negatives; `op` names errors) into a per-dimension mask. Duplicate dims are
// an error.
std::vector<bool> reductionMask(const std::vector<int64_t>& dims, int64_t ndim, const char* op);

// Sum of every element: a 0-d tensor of a's dtype.
Tensor sumAll(const Tensor& a);
// Sum over the dims flagged in `mask` (size a.dim()). keepDim keeps them as size 1. An all-false mask
// gives a copy.
Tensor sumDims(const Tensor& a, const std::vector<bool>& mask, bool keepDim);

// Largest element (NaN-propagating): a 0-d tensor. Throws on an empty tensor.
Tensor maxAll(const Tensor& a);
// Largest value along `dim` and the index of its first occurrence (int64). Either output pointer may be
// null. NaN counts as larger than everything (so NaNs propagate, as in PyTorch).
void maxDim(const Tensor& a, int64_t dim, bool keepDim, Tensor* values, Tensor* indices, const char* op = "max");

// Gradient of maxDim's values: zeros of inputShape with grad[o, j] written at the argmax position
// indices[o, j] along dim (grad/indices have maxDim's output shape, with or without keepDim).
Tensor maxDimBackward(const Tensor& grad, const Tensor& indices, const Shape& inputShape, int64_t dim);

// The shape after reducing the masked dims (kept as 1 when keepDim).
Shape reducedShape(const Shape& shape, const std::vector<bool>& mask, bool keepDim);

}  // namespace distgrad::tensor::kernels
