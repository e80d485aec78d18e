// Conv2d: 2-D convolution of x [N, C, H, W] with weight [outChannels, C / groups, kH, kW].
// Default initialisation is PyTorch's (kaiming_uniform(a = sqrt(5)) weight, U(-1/sqrt(fanIn), +) bias);
// ResNets ask for kaiming normal (fan-out) weights instead, like torchvision.
// Thread-safety: see models/nn/module.h.
#pragma once

#include "autograd/ops.h"
#include "models/nn/module.h"
#include "tensor/random.h"

namespace distgrad::models {

// How the weight is initialised: PyTorch's default (kaiming uniform, a = sqrt(5)) or kaiming normal with
// fan-out and ReLU gain (torchvision's ResNet convolutions).
enum class ConvInit { kDefault, kKaimingNormalFanOut };

class Conv2d : public Module {
 public:
  Conv2d(int64_t inChannels, int64_t outChannels, Pair kernel, tensor::Generator& gen,
         const Conv2dOptions& options = {}, bool bias = true, ConvInit init = ConvInit::kDefault);
  // Square kernel, symmetric stride and padding.
  Conv2d(int64_t inChannels, int64_t outChannels, int64_t kernel, tensor::Generator& gen, int64_t stride = 1,
         int64_t padding = 0, bool bias = true);
  Tensor forward(const Tensor& input) override;

  // Replaces the weight's values in place (same shape and dtype), e.g. with kaimingNormalFanOut.
  void resetWeight(const Tensor& values);

  int64_t inChannels() const { return inChannels_; }
  int64_t outChannels() const { return outChannels_; }
  Pair kernel() const { return kernel_; }
  const Conv2dOptions& options() const { return options_; }
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }

 private:
  int64_t inChannels_;
  int64_t outChannels_;
  Pair kernel_;
  Conv2dOptions options_;
  Tensor weight_;
  Tensor bias_;
};

}  // namespace distgrad::models
