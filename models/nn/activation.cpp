#include "models/nn/activation.h"

#include "autograd/ops.h"

namespace distgrad::models {

Tensor ReLU::forward(const Tensor& input) { return relu(input); }
Tensor Tanh::forward(const Tensor& input) { return tanh(input); }
Tensor Sigmoid::forward(const Tensor& input) { return sigmoid(input); }
Tensor GELU::forward(const Tensor& input) { return gelu(input); }

std::shared_ptr<Module> makeActivation(Activation activation) {
  switch (activation) {
    case Activation::kReLU: return std::make_shared<ReLU>();
    case Activation::kTanh: return std::make_shared<Tanh>();
    case Activation::kSigmoid: return std::make_shared<Sigmoid>();
    case Activation::kGELU: return std::make_shared<GELU>();
  }
  DG_CHECK(false, "makeActivation: unknown activation ", static_cast<int>(activation));
  return nullptr;
}

}  // namespace distgrad::models
