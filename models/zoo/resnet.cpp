#include "models/zoo/resnet.h"

#include "autograd/ops.h"
#include "models/nn/activation.h"
#include "models/nn/flatten.h"
#include "models/nn/linear.h"
#include "models/nn/pooling.h"

namespace distgrad::models {
namespace {

std::shared_ptr<Conv2d> convKxK(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t padding,
                                tensor::Generator& gen) {
  return std::make_shared<Conv2d>(in, out, Pair{kernel, kernel}, gen,
                                  Conv2dOptions{.stride = {stride, stride}, .padding = {padding, padding}},
                                  /*bias=*/false, ConvInit::kKaimingNormalFanOut);
}
std::shared_ptr<Conv2d> conv3x3(int64_t in, int64_t out, int64_t stride, tensor::Generator& gen) {
  return convKxK(in, out, 3, stride, 1, gen);
}
std::shared_ptr<Conv2d> conv1x1(int64_t in, int64_t out, int64_t stride, tensor::Generator& gen) {
  return convKxK(in, out, 1, stride, 0, gen);
}

// The 1x1 conv + BN that brings the identity branch to the block's output shape, or null when not needed.
std::shared_ptr<Sequential> makeDownsample(int64_t inPlanes, int64_t outPlanes, int64_t stride, tensor::Generator& gen) {
  if (stride == 1 && inPlanes == outPlanes) return nullptr;
  auto ds = std::make_shared<Sequential>();
  ds->add(conv1x1(inPlanes, outPlanes, stride, gen));
  ds->add(std::make_shared<BatchNorm2d>(outPlanes));
  return ds;
}

void checkBlockArgs(int64_t inPlanes, int64_t planes, int64_t stride, const char* block) {
  DG_CHECK(inPlanes > 0 && planes > 0 && stride > 0, block, ": inPlanes, planes and stride must be > 0, got ",
           inPlanes, ", ", planes, ", ", stride);
}

}  // namespace

ResNetStem parseResNetStem(const std::string& name) {
  if (name == "imagenet") return ResNetStem::kImageNet;
  if (name == "cifar") return ResNetStem::kCifar;
  DG_CHECK(false, "ResNet stem must be \"imagenet\" or \"cifar\", got \"", name, "\"");
  return ResNetStem::kImageNet;
}

const char* resNetStemName(ResNetStem stem) { return stem == ResNetStem::kImageNet ? "imagenet" : "cifar"; }

BasicBlock::BasicBlock(int64_t inPlanes, int64_t planes, int64_t stride, tensor::Generator& gen, bool zeroInitResidual)
    : Module("BasicBlock") {
  checkBlockArgs(inPlanes, planes, stride, "BasicBlock");
  conv1_ = registerModule("conv1", conv3x3(inPlanes, planes, stride, gen));
  bn1_ = registerModule("bn1", std::make_shared<BatchNorm2d>(planes));
  conv2_ = registerModule("conv2", conv3x3(planes, planes, 1, gen));
  bn2_ = registerModule("bn2", std::make_shared<BatchNorm2d>(planes));
  if (zeroInitResidual) bn2_->fillWeight(0.0);
  downsample_ = makeDownsample(inPlanes, planes * kExpansion, stride, gen);
  if (downsample_) registerModule("downsample", downsample_);
}

Tensor BasicBlock::forward(const Tensor& input) {
  Tensor out = relu(bn1_->forward(conv1_->forward(input)));
  out = bn2_->forward(conv2_->forward(out));
  const Tensor identity = downsample_ ? downsample_->forward(input) : input;
  return relu(add(out, identity));
}

Bottleneck::Bottleneck(int64_t inPlanes, int64_t planes, int64_t stride, tensor::Generator& gen, bool zeroInitResidual)
    : Module("Bottleneck") {
  checkBlockArgs(inPlanes, planes, stride, "Bottleneck");
  conv1_ = registerModule("conv1", conv1x1(inPlanes, planes, 1, gen));
  bn1_ = registerModule("bn1", std::make_shared<BatchNorm2d>(planes));
  conv2_ = registerModule("conv2", conv3x3(planes, planes, stride, gen));
  bn2_ = registerModule("bn2", std::make_shared<BatchNorm2d>(planes));
  conv3_ = registerModule("conv3", conv1x1(planes, planes * kExpansion, 1, gen));
  bn3_ = registerModule("bn3", std::make_shared<BatchNorm2d>(planes * kExpansion));
  if (zeroInitResidual) bn3_->fillWeight(0.0);
  downsample_ = makeDownsample(inPlanes, planes * kExpansion, stride, gen);
  if (downsample_) registerModule("downsample", downsample_);
}

Tensor Bottleneck::forward(const Tensor& input) {
  Tensor out = relu(bn1_->forward(conv1_->forward(input)));
  out = relu(bn2_->forward(conv2_->forward(out)));
  out = bn3_->forward(conv3_->forward(out));
  const Tensor identity = downsample_ ? downsample_->forward(input) : input;
  return relu(add(out, identity));
}

ResNet::ResNet(Block block, const std::array<int64_t, 4>& blocksPerLayer, const ResNetConfig& config,
               tensor::Generator& gen)
    : Module("ResNet"), config_(config) {
  DG_CHECK(config.numClasses > 0 && config.inChannels > 0 && config.baseWidth > 0,
           "ResNet: numClasses, inChannels and baseWidth must be > 0, got ", config.numClasses, ", ",
           config.inChannels, ", ", config.baseWidth);
  for (int64_t b : blocksPerLayer) DG_CHECK(b > 0, "ResNet: every layer needs at least one block, got ", b);
  const int64_t expansion = block == Block::kBasic ? BasicBlock::kExpansion : Bottleneck::kExpansion;
  const int64_t width = config.baseWidth;

  // Stem.
  auto stem = std::make_shared<Sequential>();
  std::shared_ptr<Conv2d> conv1 = config.stem == ResNetStem::kImageNet
                                      ? convKxK(config.inChannels, width, 7, 2, 3, gen)
                                      : convKxK(config.inChannels, width, 3, 1, 1, gen);
  stem->add(registerModule("conv1", conv1));
  stem->add(registerModule("bn1", std::make_shared<BatchNorm2d>(width)));
  stem->add(registerModule("relu", std::make_shared<ReLU>()));
  if (config.stem == ResNetStem::kImageNet) stem->add(registerModule("maxpool", std::make_shared<MaxPool2d>(3, 2, 1)));
  stages_.push_back(stem);

  // Residual stages.
  int64_t inPlanes = width;
  for (int layer = 0; layer < 4; ++layer) {
    const int64_t planes = width << layer;
    const int64_t stride = layer == 0 ? 1 : 2;
    auto seq = std::make_shared<Sequential>();
    for (int64_t b = 0; b < blocksPerLayer[static_cast<size_t>(layer)]; ++b) {
      const int64_t s = b == 0 ? stride : 1;
      if (block == Block::kBasic) {
        seq->add(std::make_shared<BasicBlock>(inPlanes, planes, s, gen, config.zeroInitResidual));
      } else {
        seq->add(std::make_shared<Bottleneck>(inPlanes, planes, s, gen, config.zeroInitResidual));
      }
      inPlanes = planes * expansion;
    }
    stages_.push_back(registerModule("layer" + std::to_string(layer + 1), seq));
  }
  featureDim_ = inPlanes;

  // Head.
  auto head = std::make_shared<Sequential>();
  head->add(registerModule("avgpool", std::make_shared<AdaptiveAvgPool2d>(Pair{1, 1})));
  head->add(registerModule("flatten", std::make_shared<Flatten>(1)));
  head->add(registerModule("fc", std::make_shared<Linear>(featureDim_, config.numClasses, gen)));
  stages_.push_back(head);
}

Tensor ResNet::forward(const Tensor& input) {
  DG_CHECK(input.dim() == 4 && input.size(1) == config_.inChannels, "ResNet: expected input [N, ", config_.inChannels,
           ", H, W], got ", tensor::shapeStr(input.shape()));
  Tensor x = input;
  for (const auto& stage : stages_) x = stage->forward(x);
  return x;
}

std::shared_ptr<ResNet> resnet18(tensor::Generator& gen, const ResNetConfig& config) {
  return std::make_shared<ResNet>(ResNet::Block::kBasic, std::array<int64_t, 4>{2, 2, 2, 2}, config, gen);
}

std::shared_ptr<ResNet> resnet50(tensor::Generator& gen, const ResNetConfig& config) {
  return std::make_shared<ResNet>(ResNet::Block::kBottleneck, std::array<int64_t, 4>{3, 4, 6, 3}, config, gen);
}

}  // namespace distgrad::models
