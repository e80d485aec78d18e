// Small evaluation helpers for training loops.
// Thread-safety: stateless.
#pragma once

#include <cstdint>

#include "tensor/tensor.h"

namespace distgrad::models {

// Number of rows of logits [N, C] whose argmax equals labels[i] (int64 [N]). Not differentiable.
int64_t countCorrect(const Tensor& logits, const Tensor& labels);
// countCorrect / N.
double accuracy(const Tensor& logits, const Tensor& labels);

}  // namespace distgrad::models
