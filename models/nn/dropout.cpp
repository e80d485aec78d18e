#include "models/nn/dropout.h"

#include "autograd/ops.h"

namespace distgrad::models {

Dropout::Dropout(double p, uint64_t seed) : Module("Dropout"), p_(p), gen_(seed) {
  DG_CHECK(p >= 0 && p < 1, "Dropout: p must be in [0, 1), got ", p);
}

Dropout::Dropout(double p, tensor::Generator& gen) : Dropout(p, gen.nextU64()) {}

Tensor Dropout::forward(const Tensor& input) { return dropout(input, p_, isTraining(), gen_); }

}  // namespace distgrad::models
