#include "models/zoo/mlp.h"

#include "autograd/ops.h"
#include "models/nn/linear.h"

namespace distgrad::models {

MLP::MLP(const std::vector<int64_t>& sizes, tensor::Generator& gen, Activation activation)
    : Sequential("MLP"), sizes_(sizes) {
  DG_CHECK(sizes.size() >= 2, "MLP: needs at least an input and an output size, got ", sizes.size(), " sizes");
  for (size_t i = 0; i + 1 < sizes.size(); ++i) {
    add(std::make_shared<Linear>(sizes[i], sizes[i + 1], gen));
    if (i + 2 < sizes.size()) add(makeActivation(activation));
  }
}

Tensor MLP::forward(const Tensor& input) {
  return Sequential::forward(input.dim() > 2 ? flatten(input, 1) : input);
}

}  // namespace distgrad::models
