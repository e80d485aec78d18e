// BatchNorm2d: batch normalisation over N, H, W of x [N, C, H, W] (also accepts [N, C], normalising over N,
// which makes it serve as BatchNorm1d too).
// In training, normalises with the batch statistics and updates the running statistics in place
// (running = (1 - momentum) * running + momentum * batch, with the unbiased batch variance, PyTorch's rule);
// in eval, normalises with the running statistics. weight (gamma) starts at 1, bias (beta) at 0; running_mean
// at 0, running_var at 1. Buffers: running_mean, running_var, num_batches_tracked (int64, PyTorch's names so
// state dicts line up).
// Thread-safety: see models/nn/module.h (forward in training mutates the buffers).
#pragma once

#include "models/nn/module.h"

namespace distgrad::models {

class BatchNorm2d : public Module {
 public:
  explicit BatchNorm2d(int64_t numFeatures, double momentum = 0.1, double eps = 1e-5);
  Tensor forward(const Tensor& input) override;

  int64_t numFeatures() const { return numFeatures_; }
  double momentum() const { return momentum_; }
  double eps() const { return eps_; }
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  const Tensor& runningMean() const { return runningMean_; }
  const Tensor& runningVar() const { return runningVar_; }
  int64_t numBatchesTracked() const;
  // Sets gamma to `value` (torchvision's zero_init_residual uses 0 for the last BN of a residual block).
  void fillWeight(double value) { weight_.fill(value); }

 private:
  int64_t numFeatures_;
  double momentum_;
  double eps_;
  Tensor weight_;
  Tensor bias_;
  Tensor runningMean_;
  Tensor runningVar_;
  Tensor numBatchesTracked_;
};

}  // namespace distgrad::models
