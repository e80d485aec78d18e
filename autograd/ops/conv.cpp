// conv2d (autograd/ops.h) and its backward formula. The math is in tensor/cpu/conv.h: oneDNN primitives for
// float32, reference loops for float64. The weight and bias gradients come from one backward-weights pass.
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
  return autograd::recordOp(
      "Conv2dBackward", {x, weight, bias}, out,
      [sx = x.detach(), sw = weight.detach(), params, hasBias = bias.defined()](const std::vector<Tensor>& grads,
                                                                              const autograd::Node& self) {
        Tensor dx, dw, db;
        if (self.needsInputGrad(0)) dx = kernels::conv2dBackwardInput(grads[0], sw, sx.shape(), params);
        const bool wantBias = hasBias && self.needsInputGrad(2);
        if (self.needsInputGrad(1)) {
          auto [gw, gb] = kernels::conv2dBackwardWeight(grads[0], sx, sw.shape(), params, wantBias);
          dw = gw;
          db = gb;
        } else if (wantBias) {
          db = kernels::conv2dBackwardBias(grads[0]);
        }
        return std::vector<Tensor>{dx, dw, db};
      });
}

}  // namespace distgrad
