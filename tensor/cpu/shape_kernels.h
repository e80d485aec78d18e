// Raw layout kernels: strided views over the same storage, typed copies between layouts, materialised
// broadcasts and concatenation. Not differentiable (autograd/ops/shape.cpp records the graph).
//
// Views never copy: they are new TensorImpls over the same Storage (Tensor::fromStorage), so writes
// through one are visible through the other. Copies dispatch on the element size (2, 4 or 8 bytes), so
// they also move the 16-bit storage types.
// Thread-safety: stateless; safe to call concurrently (writes into a shared destination are the caller's
// business).
#pragma once

#include <optional>
#include <vector>

#include "tensor/tensor.h"

namespace distgrad::tensor::kernels {

// A view of t's storage with the given geometry (offset in elements, absolute within the storage).
Tensor asStrided(const Tensor& t, const Shape& shape, const Shape& strides, int64_t offset);

// Strides that let a tensor of (oldShape, oldStrides) be viewed as newShape without copying, or nullopt
// when the memory layout does not allow it (numel must already match).
std::optional<Shape> viewStrides(const Shape& oldShape, const Shape& oldStrides, const Shape& newShape);

// Copies src into dst (same dtype; src broadcast to dst's shape). dst may be any strided view.
void copyInto(const Tensor& dst, const Tensor& src, const char* op = "copy");

// `t` itself when contiguous, else a contiguous copy.
Tensor contiguous(const Tensor& t);
// `t` converted to `dtype` (if needed) and made contiguous (if needed); an undefined `t` passes through.
Tensor contiguousAs(const Tensor& t, DType dtype);

// t broadcast to `shape` and written out as a new contiguous tensor.
Tensor broadcastTo(const Tensor& t, const Shape& shape, const char* op = "broadcastTo");

// Concatenates along dim (already wrapped); shapes must agree elsewhere and dtypes must match.
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim, const char* op = "cat");

}  // namespace distgrad::tensor::kernels
