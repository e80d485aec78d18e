// TensorDataset: a labelled data set held in memory as two tensors, inputs [N, ...] and labels [N, ...].
//
// Both are stored contiguous on the CPU, so a DataLoader can gather a sample with one memcpy per row.
// Copies of a TensorDataset share the tensors (handles), which makes passing one around cheap.
// Thread-safety: read-only after construction; concurrent readers are safe.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace distgrad::models::data {

class TensorDataset {
 public:
  TensorDataset() = default;
  // Validates that both are defined, CPU, at least 1-d and agree on N; makes them contiguous.
  TensorDataset(Tensor inputs, Tensor labels);

  int64_t size() const { return inputs_.defined() ? inputs_.size(0) : 0; }
  const Tensor& inputs() const { return inputs_; }
  const Tensor& labels() const { return labels_; }
  // Shape of one sample (inputs' shape without N).
  Shape sampleShape() const;

  // The rows [start, start + length) as views.
  TensorDataset slice(int64_t start, int64_t length) const;

 private:
  Tensor inputs_;
  Tensor labels_;
};

}  // namespace distgrad::models::data
