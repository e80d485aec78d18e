// Adam and AdamW with PyTorch's semantics (bias-corrected moments; eps added to the corrected sqrt):
//   g = grad (+ weightDecay * p for Adam: L2 penalty)     p *= 1 - lr * weightDecay (AdamW: decoupled decay)
//   m = beta1 * m + (1 - beta1) * g;   v = beta2 * v + (1 - beta2) * g^2   (vmax = max(vmax, v) with amsgrad)
//   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// t counts the updates of each parameter (a parameter skipped for lack of a gradient does not advance).
// Thread-safety: see models/optim/optimizer.h.
#pragma once

#include "models/optim/optimizer.h"

namespace distgrad::models::optim {

struct AdamOptions {
  double learningRate = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weightDecay = 0.0;
  bool amsgrad = false;
};

// AdamW's options differ only in the default weight decay (PyTorch's 1e-2).
struct AdamWOptions {
  double learningRate = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weightDecay = 1e-2;
  bool amsgrad = false;
};

class Adam : public Optimizer {
 public:
  Adam(std::vector<Tensor> parameters, const AdamOptions& options);
  const AdamOptions& options() const { return options_; }
  // Per-parameter state, for inspection and tests (undefined before the parameter's first update).
  const Tensor& expAvg(size_t index) const { return state_.at(index).expAvg; }
  const Tensor& expAvgSq(size_t index) const { return state_.at(index).expAvgSq; }
  int64_t parameterStep(size_t index) const { return state_.at(index).step; }

 protected:
  Adam(std::vector<Tensor> parameters, const AdamOptions& options, bool decoupledWeightDecay, std::string name);
  void update(size_t index, const Tensor& param, const Tensor& grad) override;
  std::vector<StateField> stateFields() const override;
  Tensor getState(size_t index, const std::string& field) const override;
  void setState(size_t index, const std::string& field, const Tensor& value) override;
  void resetState(size_t index) override { state_[index] = State{}; }

 private:
  struct State {
    int64_t step = 0;
    Tensor expAvg;
    Tensor expAvgSq;
    Tensor maxExpAvgSq;  // amsgrad only
  };
  AdamOptions options_;
  bool decoupledWeightDecay_;
  std::vector<State> state_;
};

class AdamW : public Adam {
 public:
  AdamW(std::vector<Tensor> parameters, const AdamWOptions& options);
};

}  // namespace distgrad::models::optim
