// 2-D pooling kernels over NCHW tensors: max, average (padded cells counted in the divisor, PyTorch's
// count_include_pad) and adaptive average, forward and backward.
//
// float32 max/avg pooling runs on oneDNN (plain NCHW memory, no reorders; its jit kernels measured 5-12x
// faster forward than our loops single-threaded, e.g. 3x3/2 max pooling of [32,64,32,32]: 2.2 ms vs 26 ms,
// and 1.5-6x faster for average-pooling backward; only max-pooling backward is a little slower than the
// argmax-scatter loop, 2.5 vs 1.9 ms, but that loop needs the slow loop forward). float64 and the cases
// oneDNN cannot express exactly (average pooling whose ceil-mode windows overhang the padding, where PyTorch
// shrinks the divisor) run on straightforward loops, which also serve as the test reference. Inputs are made
// contiguous first; results are fresh contiguous tensors. Callers (autograd/ops/nn.cpp) validate shapes.
// Thread-safety: reentrant; max pooling's saved state is immutable once returned and may be shared.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <memory>

#include "tensor/cpu/cpu_impl.h"
#include "tensor/tensor.h"

namespace distgrad::tensor::kernels {

struct Pool2dParams {
  int64_t kernelH = 2, kernelW = 2;
  int64_t strideH = 2, strideW = 2;
  int64_t padH = 0, padW = 0;
  bool ceilMode = false;
};

// Length of one pooled dimension, PyTorch's rule: floor (or ceil) of (in + 2*pad - kernel) / stride, plus
// one; in ceil mode the last window must still start inside the input or its left padding.
int64_t pooledLength(int64_t in, int64_t kernel, int64_t stride, int64_t pad, bool ceilMode);

// What max pooling's backward needs: argmax positions (loops) or oneDNN's workspace and forward descriptor.
struct MaxPool2dSaved {
  Shape inputShape;
  Pool2dParams params;
  DType dtype = DType::kFloat32;
  Tensor argmax;  // loops: int64 [N,C,oH,oW], offset of the winner inside its input plane (H*W)
  dnnl::pooling_forward::primitive_desc forwardPd;  // oneDNN: the forward it was produced by
  dnnl::memory workspace;                           // oneDNN: owns the workspace bytes
  bool usesOneDnn() const { return static_cast<bool>(workspace); }
};

struct MaxPool2dResult {
  Tensor output;
  std::shared_ptr<const MaxPool2dSaved> saved;  // null when !forBackward
};

// x [N,C,H,W] float32/float64. Padded cells never win (they are -inf); NaN propagates like PyTorch.
MaxPool2dResult maxPool2d(const Tensor& x, const Pool2dParams& params, bool forBackward,
                          CpuImpl impl = CpuImpl::kAuto);
// Routes each output gradient to its window's maximum (summing where windows overlap).
Tensor maxPool2dBackward(const Tensor& gradOutput, const MaxPool2dSaved& saved);

Tensor avgPool2d(const Tensor& x, const Pool2dParams& params, CpuImpl impl = CpuImpl::kAuto);
Tensor avgPool2dBackward(const Tensor& gradOutput, const Shape& inputShape, const Pool2dParams& params,
                         CpuImpl impl = CpuImpl::kAuto);

// Output cell i of a dim covers input [floor(i*in/out), ceil((i+1)*in/out)), as in PyTorch.
Tensor adaptiveAvgPool2d(const Tensor& x, int64_t outH, int64_t outW);
Tensor adaptiveAvgPool2dBackward(const Tensor& gradOutput, const Shape& inputShape);

}  // namespace distgrad::tensor::kernels
