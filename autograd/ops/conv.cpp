// conv2d (autograd/ops.h) and its backward formula. The math is in tensor/cpu/conv.h: oneDNN primitives for
// float32, reference loops for float64. Backward runs as one kernel call so the gradient is reordered once
// for both the backward-data and backward-weights passes, and the bias gradient comes out of the latter.
#include "autograd/node.h"
#include "autograd/ops.h"
#include "tensor/cpu/conv.h"

namespace distgrad {
namespace kernels = tensor::kernels;

namespace {
kernels::Conv2dParams paramsOf(const Conv2dOptions& o) {
  kernels::Conv2dParams p;
  p.stride = o.stride;
  p.padding = o.padding;
  p.dilation = o.dilation;
  p.groups = o.groups;
  return p;
}
}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dOptions& options) {
  const kernels::Conv2dParams params = paramsOf(options);
  Tensor out = kernels::conv2d(x, weight, bias, params);  // validates shapes, options and dtypes
  if (!autograd::anyRequiresGrad({x, weight, bias})) return out;  // no closure to build
  return autograd::recordOp(
      "Conv2dBackward", {x, weight, bias}, out,
      [sx = x.detach(), sw = weight.detach(), params, hasBias = bias.defined()](const std::vector<Tensor>& grads,
                                                                              const autograd::Node& self) {
        kernels::Conv2dGrads g = kernels::conv2dBackward(grads[0], sx, sw, params, self.needsInputGrad(0),
                                                         self.needsInputGrad(1), hasBias && self.needsInputGrad(2));
        return std::vector<Tensor>{g.input, g.weight, g.bias};
      });
}

}  // namespace distgrad
