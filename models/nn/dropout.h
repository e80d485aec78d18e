// Dropout: inverted dropout in training (zero with probability p, scale survivors by 1 / (1 - p)), the
// identity in eval. Owns its Generator, seeded at construction, so masks are reproducible and no global RNG
// exists.
// Thread-safety: forward advances the module's generator; see models/nn/module.h.
#pragma once

#include "models/nn/module.h"
#include "tensor/random.h"

namespace distgrad::models {

class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5, uint64_t seed = 0x0D50u);
  // Seeds the module's own generator from `gen` (one draw), so a model built from one generator is
  // reproducible as a whole.
  Dropout(double p, tensor::Generator& gen);
  Tensor forward(const Tensor& input) override;
  double p() const { return p_; }
  void manualSeed(uint64_t seed) { gen_.manualSeed(seed); }

 private:
  double p_;
  tensor::Generator gen_;
};

}  // namespace distgrad::models
