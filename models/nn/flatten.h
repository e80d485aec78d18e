// Flatten: merges dims startDim..endDim (default: everything after the batch dim, [N, C, H, W] -> [N, CHW]).
// Thread-safety: stateless apart from the Module base.
#pragma once

#include "models/nn/module.h"

namespace distgrad::models {

class Flatten : public Module {
 public:
  explicit Flatten(int64_t startDim = 1, int64_t endDim = -1) : Module("Flatten"), startDim_(startDim), endDim_(endDim) {}
  Tensor forward(const Tensor& input) override;

 private:
  int64_t startDim_;
  int64_t endDim_;
};

}  // namespace distgrad::models
