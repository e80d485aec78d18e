// Reduction differentiable ops (autograd/ops.h): sum, mean, var, max, argmax.
//
// Dims lists follow NumPy: negative dims wrap, duplicates are an error, and an empty list reduces nothing
// (use sum(a) / mean(a) to reduce everything). Backward formulas broadcast the incoming gradient back to
// the input's shape as a contiguous tensor.
#include <cmath>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "tensor/cpu/elementwise.h"
#include "tensor/cpu/reduce.h"
#include "tensor/cpu/shape_kernels.h"

namespace distgrad {
namespace kernels = tensor::kernels;
using kernels::BinaryOp;

namespace {

// Means and variances of integers would silently truncate or need a dtype policy; refuse them clearly.
void requireFloat(const Tensor& a, const char* op) {
  DG_CHECK(a.dtype() == DType::kFloat32 || a.dtype() == DType::kFloat64, op,
           ": expected a float32 or float64 tensor, got ", tensor::dtypeName(a.dtype()));
}

int64_t reducedCount(const Shape& shape, const std::vector<bool>& mask) {
  int64_t n = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (mask[d]) n *= shape[d];
  }
  return n;
}

// The incoming gradient of a reduction (shape with or without the kept dims) broadcast back to the input.
Tensor expandGrad(const Tensor& g, const Shape& inputShape, const std::vector<bool>& mask, double scale) {
  const Shape keepShape = kernels::reducedShape(inputShape, mask, true);
  Tensor gk = g.shape() == keepShape ? g : reshape(g, keepShape);
  Tensor out = kernels::broadcastTo(gk, inputShape, "sum backward");
  return scale == 1.0 ? out : kernels::mulScalar(out, scale);
}

Tensor sumMasked(const Tensor& a, const std::vector<bool>& mask, bool keepDim, const char* nodeName) {
  Tensor out = kernels::sumDims(a, mask, keepDim);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp(nodeName, {a}, out,
                            [mask, shape = a.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{expandGrad(g[0], shape, mask, 1.0)};
                            });
}

Tensor meanMasked(const Tensor& a, const std::vector<bool>& mask, bool keepDim, const char* nodeName) {
  requireFloat(a, "mean");
  const int64_t n = reducedCount(a.shape(), mask);
  // 0 reduced elements gives NaN (0/0), as in NumPy and PyTorch.
  const double scale = n == 0 ? std::nan("") : 1.0 / static_cast<double>(n);
  Tensor out = kernels::mulScalar(kernels::sumDims(a, mask, keepDim), scale);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp(nodeName, {a}, out,
                            [mask, scale, shape = a.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{expandGrad(g[0], shape, mask, scale)};
                            });
}

}  // namespace

Tensor sum(const Tensor& a) {
  kernels::requireCpuTensor(a, "sum");
  return sumMasked(a, std::vector<bool>(static_cast<size_t>(a.dim()), true), false, "SumBackward");
}

Tensor sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepDim) {
  kernels::requireCpuTensor(a, "sum");
  return sumMasked(a, kernels::reductionMask(dims, a.dim(), "sum"), keepDim, "SumBackward");
}

Tensor mean(const Tensor& a) {
  kernels::requireCpuTensor(a, "mean");
  return meanMasked(a, std::vector<bool>(static_cast<size_t>(a.dim()), true), false, "MeanBackward");
}

Tensor mean(const Tensor& a, const std::vector<int64_t>& dims, bool keepDim) {
  kernels::requireCpuTensor(a, "mean");
  return meanMasked(a, kernels::reductionMask(dims, a.dim(), "mean"), keepDim, "MeanBackward");
}

Tensor var(const Tensor& a, const std::vector<int64_t>& dims, bool unbiased, bool keepDim) {
  kernels::requireCpuTensor(a, "var");
  requireFloat(a, "var");
  const std::vector<bool> mask = kernels::reductionMask(dims, a.dim(), "var");
  const int64_t n = reducedCount(a.shape(), mask);
  const int64_t denom = n - (unbiased ? 1 : 0);
  // Two passes (mean, then squared deviations) keep the result accurate when |mean| >> stddev.
  // denom <= 0 gives NaN/inf, as in PyTorch.
  const double invN = n == 0 ? std::nan("") : 1.0 / static_cast<double>(n);
  Tensor meanK = kernels::mulScalar(kernels::sumDims(a, mask, true), invN);
  Tensor diff = kernels::binary(BinaryOp::kSub, a, meanK, "var");
  const double scale = denom <= 0 ? std::nan("") : 1.0 / static_cast<double>(denom);
  Tensor out = kernels::mulScalar(kernels::sumDims(kernels::binary(BinaryOp::kMul, diff, diff), mask, keepDim), scale);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("VarBackward", {a}, out,
                            [mask, scale, diff](const std::vector<Tensor>& g, const autograd::Node&) {
                              // d var / d a = 2 (a - mean) / denom (the mean's own gradient sums to 0).
                              Tensor gb = expandGrad(g[0], diff.shape(), mask, 2.0 * scale);
                              return std::vector<Tensor>{kernels::binary(BinaryOp::kMul, gb, diff)};
                            });
}

Tensor max(const Tensor& a) {
  kernels::requireCpuTensor(a, "max");
  DG_CHECK(a.numel() > 0, "max: cannot take the max of an empty tensor (shape ", tensor::shapeStr(a.shape()), ")");
  // One pass over a flat view gives the value and where it is, for the backward.
  Tensor flat = kernels::contiguous(a);
  flat = kernels::asStrided(flat, {a.numel()}, {1}, flat.offset());
  Tensor values, indices;
  kernels::maxDim(flat, 0, false, &values, &indices, "max");
  if (!autograd::anyRequiresGrad({a})) return values;
  return autograd::recordOp("MaxBackward", {a}, values,
                            [indices, shape = a.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
                              Tensor flatGrad = kernels::maxDimBackward(g[0], indices, {tensor::numelOf(shape)}, 0);
                              return std::vector<Tensor>{kernels::asStrided(flatGrad, shape,
                                                                             tensor::contiguousStrides(shape), 0)};
                            });
}

Tensor max(const Tensor& a, int64_t dim, bool keepDim) {
  Tensor values, indices;
  kernels::maxDim(a, dim, keepDim, &values, &indices, "max");
  const int64_t d = tensor::wrapDim(dim, a.dim(), "max");
  if (!autograd::anyRequiresGrad({a})) return values;
  return autograd::recordOp("MaxDimBackward", {a}, values,
                            [indices, d, shape = a.shape()](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{kernels::maxDimBackward(g[0], indices, shape, d)};
                            });
}

Tensor argmax(const Tensor& a, int64_t dim, bool keepDim) {
  Tensor indices;
  kernels::maxDim(a, dim, keepDim, nullptr, &indices, "argmax");
  return indices;
}

}  // namespace distgrad
