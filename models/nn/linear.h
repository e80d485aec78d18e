// Linear: y = x W^T + b over the last dimension of x ([..., inFeatures] -> [..., outFeatures]).
// Initialised like PyTorch: W ~ kaiming_uniform(a = sqrt(5)), i.e. U(-1/sqrt(fanIn), 1/sqrt(fanIn)), and
// b ~ U(-1/sqrt(fanIn), 1/sqrt(fanIn)).
// Thread-safety: see models/nn/module.h.
#pragma once

#include "models/nn/module.h"
#include "tensor/random.h"

namespace distgrad::models {

class Linear : public Module {
 public:
  Linear(int64_t inFeatures, int64_t outFeatures, tensor::Generator& gen, bool bias = true);
  Tensor forward(const Tensor& input) override;

  int64_t inFeatures() const { return inFeatures_; }
  int64_t outFeatures() const { return outFeatures_; }
  const Tensor& weight() const { return weight_; }  // [out, in]
  const Tensor& bias() const { return bias_; }      // [out], undefined without bias

 private:
  int64_t inFeatures_;
  int64_t outFeatures_;
  Tensor weight_;
  Tensor bias_;
};

}  // namespace distgrad::models
