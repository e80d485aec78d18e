// LeNet-5 for 1x28x28 inputs (MNIST / Fashion-MNIST), in the ReLU + max-pool variant that trains better
// than the original tanh + average pooling:
//   conv 6@5x5 pad 2 -> ReLU -> maxpool 2 -> conv 16@5x5 -> ReLU -> maxpool 2 -> flatten(400)
//   -> fc 120 -> ReLU -> fc 84 -> ReLU -> fc numClasses
// A Sequential, so it can also be split into stages by index.
// Thread-safety: see models/nn/module.h.
#pragma once

#include "models/nn/sequential.h"
#include "tensor/random.h"

namespace distgrad::models {

class LeNet5 : public Sequential {
 public:
  explicit LeNet5(tensor::Generator& gen, int64_t numClasses = 10, int64_t inChannels = 1);
};

}  // namespace distgrad::models
