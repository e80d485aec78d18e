#include "models/nn/conv.h"

#include <cmath>

namespace distgrad::models {

Conv2d::Conv2d(int64_t inChannels, int64_t outChannels, Pair kernel, tensor::Generator& gen,
               const Conv2dOptions& options, bool bias, ConvInit init)
    : Module("Conv2d"), inChannels_(inChannels), outChannels_(outChannels), kernel_(kernel), options_(options) {
  DG_CHECK(inChannels > 0 && outChannels > 0, "Conv2d: channel counts must be > 0, got in=", inChannels,
           " out=", outChannels);
  DG_CHECK(kernel[0] > 0 && kernel[1] > 0, "Conv2d: kernel must be > 0, got [", kernel[0], ", ", kernel[1], "]");
  DG_CHECK(options.groups > 0 && inChannels % options.groups == 0 && outChannels % options.groups == 0,
           "Conv2d: groups (", options.groups, ") must divide in (", inChannels, ") and out (", outChannels,
           ") channels");
  for (int i = 0; i < 2; ++i) {
    DG_CHECK(options.stride[i] > 0 && options.dilation[i] > 0 && options.padding[i] >= 0,
             "Conv2d: stride and dilation must be > 0 and padding >= 0, got stride [", options.stride[0], ", ",
             options.stride[1], "], dilation [", options.dilation[0], ", ", options.dilation[1], "], padding [",
             options.padding[0], ", ", options.padding[1], "]");
  }
  const Shape weightShape{outChannels, inChannels / options.groups, kernel[0], kernel[1]};
  weight_ = init == ConvInit::kDefault ? tensor::kaimingUniform(weightShape, gen, std::sqrt(5.0))
                                       : tensor::kaimingNormalFanOut(weightShape, gen);
  registerParameter("weight", weight_);
  if (bias) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(tensor::fanIn(weight_.shape())));
    bias_ = tensor::uniform({outChannels}, -bound, bound, gen);
    registerParameter("bias", bias_);
  }
}

Conv2d::Conv2d(int64_t inChannels, int64_t outChannels, int64_t kernel, tensor::Generator& gen, int64_t stride,
               int64_t padding, bool bias)
    : Conv2d(inChannels, outChannels, Pair{kernel, kernel}, gen,
             Conv2dOptions{.stride = {stride, stride}, .padding = {padding, padding}}, bias) {}

Tensor Conv2d::forward(const Tensor& input) {
  DG_CHECK(input.dim() == 4 && input.size(1) == inChannels_, "Conv2d(", inChannels_, " -> ", outChannels_,
           "): expected input [N, ", inChannels_, ", H, W], got ", tensor::shapeStr(input.shape()));
  return conv2d(input, weight_, bias_, options_);
}

void Conv2d::resetWeight(const Tensor& values) {
  DG_CHECK(values.shape() == weight_.shape(), "Conv2d::resetWeight: expected shape ",
           tensor::shapeStr(weight_.shape()), ", got ", tensor::shapeStr(values.shape()));
  weight_.copyFrom(values);
}

}  // namespace distgrad::models
