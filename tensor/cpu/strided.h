// Iteration over strided views: the building block for copies and elementwise kernels.
// forEachStrided visits every index of `shape` once in row-major order and calls
// inner(ptrs, innerStrides, n) on runs along the last dimension, so kernels get a tight inner loop.
// Thread-safety: stateless.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "tensor/tensor.h"

namespace distgrad::tensor::kernels {

// Removes size-1 dims and merges dims that are contiguous with each other in every operand, so common
// cases (fully contiguous, broadcast of a row) collapse to one or two loop levels.
template <size_t N>
void coalesceDims(Shape& shape, std::array<Shape, N>& strides) {
  Shape outShape;
  std::array<Shape, N> outStrides;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    if (!outShape.empty()) {
      bool mergeable = true;
      for (size_t k = 0; k < N; ++k) {
        if (outStrides[k].back() != strides[k][d] * shape[d]) {
          mergeable = false;
          break;
        }
      }
      if (mergeable) {
        outShape.back() *= shape[d];
        for (size_t k = 0; k < N; ++k) outStrides[k].back() = strides[k][d];
        continue;
      }
    }
    outShape.push_back(shape[d]);
    for (size_t k = 0; k < N; ++k) outStrides[k].push_back(strides[k][d]);
  }
  if (outShape.empty()) {
    outShape.push_back(1);
    for (size_t k = 0; k < N; ++k) outStrides[k].push_back(0);
  }
  shape = std::move(outShape);
  strides = std::move(outStrides);
}

// ptrs are byte pointers to element 0 of each operand; strides are in bytes.
template <size_t N, typename Inner>
void forEachStrided(Shape shape, std::array<Shape, N> byteStrides, std::array<char*, N> ptrs,
                    Inner&& inner) {
  for (int64_t s : shape) {
    if (s == 0) return;
  }
  coalesceDims(shape, byteStrides);
  const int64_t nd = static_cast<int64_t>(shape.size());
  const int64_t innerSize = shape[nd - 1];
  std::array<int64_t, N> innerStrides;
  for (size_t k = 0; k < N; ++k) innerStrides[k] = byteStrides[k][nd - 1];
  std::vector<int64_t> counter(nd, 0);
  std::array<char*, N> cur = ptrs;
  while (true) {
    inner(cur, innerStrides, innerSize);
    // advance the outer dims (odometer)
    int64_t d = nd - 2;
    for (; d >= 0; --d) {
      ++counter[d];
      for (size_t k = 0; k < N; ++k) cur[k] += byteStrides[k][d];
      if (counter[d] < shape[d]) break;
      for (size_t k = 0; k < N; ++k) cur[k] -= byteStrides[k][d] * shape[d];
      counter[d] = 0;
    }
    if (d < 0) return;
  }
}

inline Shape byteStridesOf(const Tensor& t, const Shape& broadcastStrides) {
  Shape out(broadcastStrides.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = broadcastStrides[i] * static_cast<int64_t>(t.itemSize());
  return out;
}

}  // namespace distgrad::tensor::kernels
