// ResNet-18 and ResNet-50 (He et al. 2016) in torchvision's layout, parameter names and initialisation.
//
// Children: conv1, bn1, relu, maxpool (ImageNet stem only), layer1..layer4 (Sequentials of BasicBlock or
// Bottleneck, stride in the first block of layers 2-4, torchvision v1.5 style: the stride sits on the 3x3
// conv of a Bottleneck), avgpool, flatten, fc. So names read "layer1.0.conv1.weight",
// "layer2.0.downsample.1.running_mean", "fc.bias", as in torchvision. Convolutions are bias-free with kaiming
// normal (fan-out) weights; BN starts at weight 1, bias 0 (0 for each block's last BN with
// zeroInitResidual); fc uses Linear's default init.
//
// Stems: kImageNet (default; 7x7 stride-2 conv, BN, ReLU, 3x3 stride-2 max pool) or kCifar (3x3 stride-1
// conv, BN, ReLU, no pool) for 32x32 inputs. Widths are baseWidth x {1, 2, 4, 8} (x4 at the output of
// bottleneck stages).
//
// stages() returns [stem, layer1, layer2, layer3, layer4, head] where head = avgpool + flatten + fc, each a
// module sharing the model's submodules (and so its parameters), whose composition is forward(). A pipeline
// can place the stages on different workers.
// Thread-safety: see models/nn/module.h.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "models/nn/batch_norm.h"
#include "models/nn/conv.h"
#include "models/nn/sequential.h"
#include "tensor/random.h"

namespace distgrad::models {

enum class ResNetStem { kImageNet, kCifar };
// "imagenet" or "cifar" (the names used on command lines); anything else is a ValueError.
ResNetStem parseResNetStem(const std::string& name);
const char* resNetStemName(ResNetStem stem);

struct ResNetConfig {
  int64_t numClasses = 1000;
  int64_t inChannels = 3;
  int64_t baseWidth = 64;
  ResNetStem stem = ResNetStem::kImageNet;
  bool zeroInitResidual = false;
};

// Two 3x3 convs with a residual connection (ResNet-18/34).
class BasicBlock : public Module {
 public:
  static constexpr int64_t kExpansion = 1;
  BasicBlock(int64_t inPlanes, int64_t planes, int64_t stride, tensor::Generator& gen, bool zeroInitResidual = false);
  Tensor forward(const Tensor& input) override;

 private:
  std::shared_ptr<Conv2d> conv1_, conv2_;
  std::shared_ptr<BatchNorm2d> bn1_, bn2_;
  std::shared_ptr<Sequential> downsample_;  // null when the shapes already match
};

// 1x1 reduce, 3x3 (strided), 1x1 expand (x4), with a residual connection (ResNet-50/101/152).
class Bottleneck : public Module {
 public:
  static constexpr int64_t kExpansion = 4;
  Bottleneck(int64_t inPlanes, int64_t planes, int64_t stride, tensor::Generator& gen, bool zeroInitResidual = false);
  Tensor forward(const Tensor& input) override;

 private:
  std::shared_ptr<Conv2d> conv1_, conv2_, conv3_;
  std::shared_ptr<BatchNorm2d> bn1_, bn2_, bn3_;
  std::shared_ptr<Sequential> downsample_;
};

class ResNet : public Module {
 public:
  enum class Block { kBasic, kBottleneck };
  ResNet(Block block, const std::array<int64_t, 4>& blocksPerLayer, const ResNetConfig& config, tensor::Generator& gen);

  Tensor forward(const Tensor& input) override;
  // [stem, layer1, layer2, layer3, layer4, head]; see the file comment.
  const std::vector<std::shared_ptr<Module>>& stages() const { return stages_; }
  const ResNetConfig& config() const { return config_; }
  // Channels entering fc (baseWidth * 8 * expansion).
  int64_t featureDim() const { return featureDim_; }

 private:
  ResNetConfig config_;
  int64_t featureDim_ = 0;
  std::vector<std::shared_ptr<Module>> stages_;
};

std::shared_ptr<ResNet> resnet18(tensor::Generator& gen, const ResNetConfig& config = {});
std::shared_ptr<ResNet> resnet50(tensor::Generator& gen, const ResNetConfig& config = {});

}  // namespace distgrad::models
