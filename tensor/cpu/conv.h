// Raw (non-differentiable) 2-D convolution kernels: forward, and the gradients for input, weight and bias.
//
// Tensors are plain NCHW (input/output) and OIHW (weight, [O, C/groups, kH, kW]). float32 runs on oneDNN's
// convolution primitives (forward_training / backward_data / backward_weights, convolution_direct);
// float64 runs on reference loops (im2col + a simple GEMM), which back the float64 gradchecks and are the
// reference the float32 path is tested against.
//
// Memory layout (float32): by default the primitives are created with format_tag::any, so oneDNN picks its
// blocked layouts (nChw16c and friends on AVX-512) and we reorder our plain tensors into and out of them;
// bench/tensor_ops.cpp measures this against running on the plain layout directly and against channels-last
// (see kDefaultConvLayout for the figures). Primitives, their reorders and their scratchpad sizes are cached
// per thread, keyed by shapes and parameters, so a training loop creates them once; scratchpads and
// blocked-layout buffers come from per-thread buffers that grow to the largest layer and are reused.
// Thread-safety: all functions are reentrant (the caches and buffers are thread_local; primitives run with
// user-managed scratchpads so none is shared between threads).
#pragma once

#include <array>
#include <cstdint>
#include <utility>

#include "tensor/tensor.h"

namespace distgrad::tensor::kernels {

struct Conv2dParams {
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> padding{0, 0};  // symmetric, per spatial dim
  std::array<int64_t, 2> dilation{1, 1};
  int64_t groups = 1;
};

// How float32 convolutions lay out their operands inside oneDNN.
enum class ConvLayout {
  kBlocked,       // format_tag::any: oneDNN's preferred (blocked) layouts, reorders in and out
  kPlain,         // the primitives run directly on NCHW / OIHW (no reorders)
  kChannelsLast,  // NHWC activations (reordered), weights in oneDNN's preferred layout
};

// Chosen by bench/tensor_ops.cpp on ResNet-18 CIFAR shapes (N=32, 3x3, pad 1; 64ch 8x8 and 128ch 4x4),
// one thread, forward + backward-data + backward-weights. See conv.cpp for the measured figures.
inline constexpr ConvLayout kDefaultConvLayout = ConvLayout::kBlocked;

// Validates x [N,C,H,W], weight [O, C/groups, kH, kW] and the parameters (throwing ValueError naming `op`,
// the shapes and what was expected) and returns the output shape [N, O, OH, OW] with
// OH = (H + 2*padding - dilation*(kH-1) - 1) / stride + 1.
Shape conv2dOutputShape(const Shape& x, const Shape& weight, const Conv2dParams& params, const char* op = "conv2d");

// y = conv(x, weight) + bias (bias [O] or undefined). float32 or float64, all operands the same dtype.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dParams& params,
              ConvLayout layout = kDefaultConvLayout);
// dL/dx for dL/dy = gradOut.
Tensor conv2dBackwardInput(const Tensor& gradOut, const Tensor& weight, const Shape& inputShape,
                           const Conv2dParams& params, ConvLayout layout = kDefaultConvLayout);
// dL/dweight, and dL/dbias when withBias (else the second tensor is undefined); computed in one pass.
std::pair<Tensor, Tensor> conv2dBackwardWeight(const Tensor& gradOut, const Tensor& x, const Shape& weightShape,
                                               const Conv2dParams& params, bool withBias,
                                               ConvLayout layout = kDefaultConvLayout);
// dL/dbias alone: gradOut summed over N, H, W.
Tensor conv2dBackwardBias(const Tensor& gradOut);

}  // namespace distgrad::tensor::kernels
