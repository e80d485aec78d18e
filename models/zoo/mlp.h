// MLP: Linear layers of the given sizes with an activation between them (none after the last), e.g.
// MLP({784, 256, 10}, gen) = Linear(784, 256), ReLU, Linear(256, 10). Parameters are named "0.weight",
// "2.bias", ... (it is a Sequential). Inputs of any rank are flattened from dim 1, so image batches work too.
// Thread-safety: see models/nn/module.h.
#pragma once

#include <vector>

#include "models/nn/activation.h"
#include "models/nn/sequential.h"
#include "tensor/random.h"

namespace distgrad::models {

class MLP : public Sequential {
 public:
  MLP(const std::vector<int64_t>& sizes, tensor::Generator& gen, Activation activation = Activation::kReLU);
  Tensor forward(const Tensor& input) override;
  const std::vector<int64_t>& sizes() const { return sizes_; }

 private:
  std::vector<int64_t> sizes_;
};

}  // namespace distgrad::models
