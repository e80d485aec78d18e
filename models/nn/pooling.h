// Pooling modules over x [N, C, H, W]: MaxPool2d, AvgPool2d (padding counted in the divisor, PyTorch's
// default) and AdaptiveAvgPool2d (fixed output size, e.g. {1, 1} for global average pooling).
// Thread-safety: stateless apart from the Module base.
#pragma once

#include "autograd/ops.h"
#include "models/nn/module.h"

namespace distgrad::models {

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(const Pool2dOptions& options);
  // Square window; stride 0 means "same as kernel".
  explicit MaxPool2d(int64_t kernel, int64_t stride = 0, int64_t padding = 0);
  Tensor forward(const Tensor& input) override;
  const Pool2dOptions& options() const { return options_; }

 private:
  Pool2dOptions options_;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(const Pool2dOptions& options);
  explicit AvgPool2d(int64_t kernel, int64_t stride = 0, int64_t padding = 0);
  Tensor forward(const Tensor& input) override;
  const Pool2dOptions& options() const { return options_; }

 private:
  Pool2dOptions options_;
};

class AdaptiveAvgPool2d : public Module {
 public:
  explicit AdaptiveAvgPool2d(Pair outputSize);
  Tensor forward(const Tensor& input) override;
  Pair outputSize() const { return outputSize_; }

 private:
  Pair outputSize_;
};

}  // namespace distgrad::models
