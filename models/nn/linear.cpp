#include "models/nn/linear.h"

#include <cmath>

#include "autograd/ops.h"

namespace distgrad::models {

Linear::Linear(int64_t inFeatures, int64_t outFeatures, tensor::Generator& gen, bool bias)
    : Module("Linear"), inFeatures_(inFeatures), outFeatures_(outFeatures) {
  DG_CHECK(inFeatures > 0 && outFeatures > 0, "Linear: inFeatures and outFeatures must be > 0, got ", inFeatures,
           " and ", outFeatures);
  weight_ = tensor::kaimingUniform({outFeatures, inFeatures}, gen, std::sqrt(5.0));
  registerParameter("weight", weight_);
  if (bias) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(inFeatures));
    bias_ = tensor::uniform({outFeatures}, -bound, bound, gen);
    registerParameter("bias", bias_);
  }
}

Tensor Linear::forward(const Tensor& input) {
  DG_CHECK(input.dim() >= 1 && input.size(-1) == inFeatures_, "Linear(", inFeatures_, " -> ", outFeatures_,
           "): expected input [..., ", inFeatures_, "], got ", tensor::shapeStr(input.shape()));
  return linear(input, weight_, bias_);
}

}  // namespace distgrad::models
