#include "models/nn/flatten.h"

#include "autograd/ops.h"

namespace distgrad::models {

Tensor Flatten::forward(const Tensor& input) { return flatten(input, startDim_, endDim_); }

}  // namespace distgrad::models
