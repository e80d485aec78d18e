#include "models/nn/pooling.h"

namespace distgrad::models {
namespace {
void checkPoolOptions(const Pool2dOptions& o, const char* module) {
  for (int i = 0; i < 2; ++i) {
    DG_CHECK(o.kernel[i] > 0 && o.stride[i] >= 0 && o.padding[i] >= 0 && 2 * o.padding[i] <= o.kernel[i], module,
             ": expected kernel > 0, stride >= 0 (0 = kernel), 0 <= padding <= kernel / 2; got kernel [",
             o.kernel[0], ", ", o.kernel[1], "], stride [", o.stride[0], ", ", o.stride[1], "], padding [",
             o.padding[0], ", ", o.padding[1], "]");
  }
}
Pool2dOptions squareOptions(int64_t kernel, int64_t stride, int64_t padding) {
  return Pool2dOptions{.kernel = {kernel, kernel}, .stride = {stride, stride}, .padding = {padding, padding}};
}
void checkInput(const Tensor& input, const char* module) {
  DG_CHECK(input.dim() == 4, module, ": expected input [N, C, H, W], got ", tensor::shapeStr(input.shape()));
}
}  // namespace

MaxPool2d::MaxPool2d(const Pool2dOptions& options) : Module("MaxPool2d"), options_(options) {
  checkPoolOptions(options_, "MaxPool2d");
}
MaxPool2d::MaxPool2d(int64_t kernel, int64_t stride, int64_t padding)
    : MaxPool2d(squareOptions(kernel, stride, padding)) {}
Tensor MaxPool2d::forward(const Tensor& input) {
  checkInput(input, "MaxPool2d");
  return maxPool2d(input, options_);
}

AvgPool2d::AvgPool2d(const Pool2dOptions& options) : Module("AvgPool2d"), options_(options) {
  checkPoolOptions(options_, "AvgPool2d");
}
AvgPool2d::AvgPool2d(int64_t kernel, int64_t stride, int64_t padding)
    : AvgPool2d(squareOptions(kernel, stride, padding)) {}
Tensor AvgPool2d::forward(const Tensor& input) {
  checkInput(input, "AvgPool2d");
  return avgPool2d(input, options_);
}

AdaptiveAvgPool2d::AdaptiveAvgPool2d(Pair outputSize) : Module("AdaptiveAvgPool2d"), outputSize_(outputSize) {
  DG_CHECK(outputSize[0] > 0 && outputSize[1] > 0, "AdaptiveAvgPool2d: output size must be > 0, got [",
           outputSize[0], ", ", outputSize[1], "]");
}
Tensor AdaptiveAvgPool2d::forward(const Tensor& input) {
  checkInput(input, "AdaptiveAvgPool2d");
  return adaptiveAvgPool2d(input, outputSize_);
}

}  // namespace distgrad::models
