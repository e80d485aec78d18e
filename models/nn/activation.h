// Parameter-free activation modules (ReLU, Tanh, Sigmoid, GELU), for building Sequential models.
// Thread-safety: stateless apart from the Module base.
#pragma once

#include "models/nn/module.h"

namespace distgrad::models {

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}
  Tensor forward(const Tensor& input) override;
};

class Tanh : public Module {
 public:
  Tanh() : Module("Tanh") {}
  Tensor forward(const Tensor& input) override;
};

class Sigmoid : public Module {
 public:
  Sigmoid() : Module("Sigmoid") {}
  Tensor forward(const Tensor& input) override;
};

// Exact (erf) GELU.
class GELU : public Module {
 public:
  GELU() : Module("GELU") {}
  Tensor forward(const Tensor& input) override;
};

enum class Activation { kReLU, kTanh, kSigmoid, kGELU };
// A new module computing `activation`.
std::shared_ptr<Module> makeActivation(Activation activation);

}  // namespace distgrad::models
