// SGD with momentum, dampening, weight decay and Nesterov momentum, with PyTorch's semantics:
//   d = grad + weightDecay * p
//   buf = d (first step) | momentum * buf + (1 - dampening) * d
//   d = nesterov ? d + momentum * buf : buf          (when momentum != 0)
//   p -= lr * d
// Thread-safety: see models/optim/optimizer.h.
#pragma once

#include "models/optim/optimizer.h"

namespace distgrad::models::optim {

struct SgdOptions {
  double learningRate = 0.01;
  double momentum = 0.0;
  double dampening = 0.0;
  double weightDecay = 0.0;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  SGD(std::vector<Tensor> parameters, const SgdOptions& options);
  const SgdOptions& options() const { return options_; }
  // The momentum buffer of parameter `index` (undefined before its first update or without momentum).
  const Tensor& momentumBuffer(size_t index) const { return momentumBuffers_.at(index); }

 protected:
  void update(size_t index, const Tensor& param, const Tensor& grad) override;
  std::vector<StateField> stateFields() const override;
  Tensor getState(size_t index, const std::string& field) const override;
  void setState(size_t index, const std::string& field, const Tensor& value) override;
  void resetState(size_t index) override { momentumBuffers_[index] = Tensor(); }

 private:
  SgdOptions options_;
  std::vector<Tensor> momentumBuffers_;
};

}  // namespace distgrad::models::optim
