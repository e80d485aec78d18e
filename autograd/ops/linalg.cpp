// matmul, bmm and linear (autograd/ops.h) with their backward formulas. The math is in
// tensor/cpu/linalg.h; gradients are products with one operand transposed (a strided view, never a copy),
// and gradients of broadcast batch dims are reduced inside the GEMM (kernels::batchedMatmul) rather than
// materialised per batch and summed afterwards.
#include <algorithm>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "tensor/cpu/linalg.h"

namespace distgrad {
namespace kernels = tensor::kernels;

namespace {

Tensor viewWith(const Tensor& t, const Shape& shape, const Shape& strides) {
  return Tensor::fromStorage(t.storage(), shape, strides, t.offset(), t.dtype());
}

// The rank-`nd` matrix form matmul computes with: a 1-D left operand becomes a row [1, k], a 1-D right
// operand a column [k, 1], and missing batch dims become leading size-1 dims (all views).
Tensor promoteOperand(const Tensor& t, bool isLeft, int64_t nd) {
  Shape shape = t.shape(), strides = t.strides();
  if (t.dim() == 1) {
    if (isLeft) {
      shape.insert(shape.begin(), 1);
      strides.insert(strides.begin(), 0);
    } else {
      shape.push_back(1);
      strides.push_back(0);
    }
  }
  while (static_cast<int64_t>(shape.size()) < nd) {
    shape.insert(shape.begin(), 1);
    strides.insert(strides.begin(), 0);
  }
  return viewWith(t, shape, strides);
}

// The gradient of matmul's result in the same matrix form: size-1 dims reinserted where a 1-D operand's
// dim was dropped.
Tensor promoteGrad(const Tensor& g, bool leftWasVector, bool rightWasVector) {
  Shape shape = g.shape(), strides = g.strides();
  if (leftWasVector) {
    shape.insert(shape.end() - (rightWasVector ? 0 : 1), 1);
    strides.insert(strides.end() - (rightWasVector ? 0 : 1), 0);
  }
  if (rightWasVector) {
    shape.push_back(1);
    strides.push_back(0);
  }
  return viewWith(g, shape, strides);
}

Shape batchOf(const Tensor& t) { return Shape(t.shape().begin(), t.shape().end() - 2); }

// The gradient computed in matrix form, viewed back as the operand's own (contiguous) shape.
Tensor asShape(const Tensor& grad, const Shape& shape) {
  return viewWith(grad, shape, tensor::contiguousStrides(shape));
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) {
  Tensor out = kernels::matmul(a, b);  // validates ranks, inner dims, batch broadcast and dtypes
  if (!autograd::anyRequiresGrad({a, b})) return out;  // no closure to build
  return autograd::recordOp(
      "MatmulBackward", {a, b}, out,
      [sa = a.detach(), sb = b.detach()](const std::vector<Tensor>& grads, const autograd::Node& self) {
        const int64_t nd = std::max<int64_t>({sa.dim(), sb.dim(), 2});
        const Tensor a2 = promoteOperand(sa, true, nd);
        const Tensor b2 = promoteOperand(sb, false, nd);
        const Tensor g2 = promoteGrad(grads[0], sa.dim() == 1, sb.dim() == 1);
        Tensor da, db;
        // dA = dC * B^T and dB = A^T * dC, summed over the batch dims the operand was broadcast along.
        if (self.needsInputGrad(0)) da = asShape(kernels::batchedMatmul(g2, false, b2, true, batchOf(a2)), sa.shape());
        if (self.needsInputGrad(1)) db = asShape(kernels::batchedMatmul(a2, true, g2, false, batchOf(b2)), sb.shape());
        return std::vector<Tensor>{da, db};
      });
}

Tensor bmm(const Tensor& a, const Tensor& b) {
  DG_CHECK(a.dim() == 3 && b.dim() == 3, "bmm: expected 3-D tensors [B, n, k] and [B, k, m], got shapes ",
           tensor::shapeStr(a.shape()), " and ", tensor::shapeStr(b.shape()));
  DG_CHECK(a.shape()[0] == b.shape()[0], "bmm: batch sizes differ: shapes ", tensor::shapeStr(a.shape()), " and ",
           tensor::shapeStr(b.shape()));
  DG_CHECK(a.shape()[2] == b.shape()[1], "bmm: shapes ", tensor::shapeStr(a.shape()), " and ",
           tensor::shapeStr(b.shape()), " cannot be multiplied (", a.shape()[2], " != ", b.shape()[1],
           " in the contracted dimension)");
  DG_CHECK(a.dtype() == b.dtype(), "bmm: dtype mismatch: ", dtypeName(a.dtype()), " ", tensor::shapeStr(a.shape()),
           " vs ", dtypeName(b.dtype()), " ", tensor::shapeStr(b.shape()));
  const Shape batch{a.shape()[0]};
  Tensor out = kernels::batchedMatmul(a, false, b, false, batch);
  if (!autograd::anyRequiresGrad({a, b})) return out;  // no closure to build
  return autograd::recordOp(
      "BmmBackward", {a, b}, out,
      [sa = a.detach(), sb = b.detach(), batch](const std::vector<Tensor>& grads, const autograd::Node& self) {
        Tensor da, db;
        if (self.needsInputGrad(0)) da = kernels::batchedMatmul(grads[0], false, sb, true, batch);
        if (self.needsInputGrad(1)) db = kernels::batchedMatmul(sa, true, grads[0], false, batch);
        return std::vector<Tensor>{da, db};
      });
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  Tensor out = kernels::linear(x, weight, bias);  // validates shapes and dtypes
  if (!autograd::anyRequiresGrad({x, weight, bias})) return out;  // no closure to build
  return autograd::recordOp(
      "LinearBackward", {x, weight, bias}, out,
      [sx = x.detach(), sw = weight.detach()](const std::vector<Tensor>& grads, const autograd::Node& self) {
        Tensor dx, dw, db;
        if (self.needsInputGrad(0)) dx = kernels::linearBackwardInput(grads[0], sw, sx.shape());
        if (self.needsInputGrad(1)) dw = kernels::linearBackwardWeight(grads[0], sx);
        if (self.needsInputGrad(2)) db = kernels::linearBackwardBias(grads[0]);
        return std::vector<Tensor>{dx, dw, db};
      });
}

}  // namespace distgrad
