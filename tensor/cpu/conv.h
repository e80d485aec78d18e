// Raw (non-differentiable) 2-D convolution kernels: forward, and the gradients for input, weight and bias.
//
// Tensors are plain NCHW (input/output) and OIHW (weight, [O, C/groups, kH, kW]). float32 runs on oneDNN's
// convolution primitives (forward_training / backward_data / backward_weights, convolution_direct);
// float64 runs on reference loops (im2col + a simple GEMM), which back the float64 gradchecks and are the
// reference the float32 path is tested against.
//
// Memory layout (float32): our tensors are plain, but oneDNN's fast kernels mostly want blocked or
// channels-last layouts, so the primitives may run on reordered copies (format_tag::any or nhwc, with
// reorders in and out). The layout is chosen per shape from measurements (chooseConvLayout);
// bench/tensor_ops.cpp measures every option, and our ops against direct oneDNN calls.
// Primitives, their reorders and their scratchpad sizes are cached per thread, keyed by shapes and
// parameters, so a training loop creates them once; scratchpads and reordered operands live in per-thread
// buffers that grow to the largest layer and are reused.
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
  kAuto,          // per shape, from measurements (see chooseConvLayout)
  kBlocked,       // format_tag::any: oneDNN's preferred (blocked, e.g. nChw16c) layouts, reorders in and out
  kPlain,         // the primitives run directly on NCHW / OIHW (no reorders)
  kChannelsLast,  // NHWC activations (reordered), weights in oneDNN's preferred layout
};

inline constexpr ConvLayout kDefaultConvLayout = ConvLayout::kAuto;

// The layout kAuto uses for this convolution. Chosen from bench/tensor_ops.cpp's sweep over every
// ResNet-18 convolution for 32x32 inputs at N=32, one thread, forward + backward-data + backward-weights
// (AVX-512 Xeon, oneDNN 2.6; thread CPU ms, blocked / plain / channels-last):
//   stem 3->64 32x32 7x7/2     17.0 / 14.5 / 17.6   -> plain (oneDNN's first-layer kernels read NCHW)
//   64 8x8 3x3                  6.5 / 11.3 /  5.7   -> channels-last
//   128 4x4 3x3                 6.3 / 11.7 /  5.5   -> channels-last
//   64->128 8x8 3x3/2           4.3 /  6.7 /  4.3   -> blocked (tie)
//   64->128 8x8 1x1/2          0.72 / 0.96 / 0.99   -> blocked
//   128->256 4x4 3x3/2          6.2 / 17.6 /  6.3   -> blocked
//   256 2x2 3x3                 9.7 / 36.6 / 11.1   -> blocked
//   256->512 2x2 3x3/2         13.5 / 27.4 / 14.2   -> blocked
//   512 1x1 3x3                14.9 / 82.0 / 14.9   -> blocked
// Plain wins only with few input channels (the stem) and is up to 5x behind elsewhere; channels-last wins
// for stride-1 spatial kernels on maps of at least 4x4 (~15%); blocked is as good or better elsewhere.
// Differences under ~5% are within run-to-run noise on the (shared) measuring machine. Grouped convolutions
// were not measured and use blocked, oneDNN's own preference.
ConvLayout chooseConvLayout(const Shape& x, const Shape& weight, const Conv2dParams& params);

// Validates x [N,C,H,W], weight [O, C/groups, kH, kW] and the parameters (throwing ValueError naming `op`,
// the shapes and what was expected) and returns the output shape [N, O, OH, OW] with
// OH = (H + 2*padding - dilation*(kH-1) - 1) / stride + 1.
Shape conv2dOutputShape(const Shape& x, const Shape& weight, const Conv2dParams& params, const char* op = "conv2d");

// y = conv(x, weight) + bias (bias [O] or undefined). float32 or float64, all operands the same dtype.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv2dParams& params,
              ConvLayout layout = kDefaultConvLayout);
// The gradients conv2d's backward needs, in one call: reorders gradOut once for both the backward-data and
// backward-weights passes when they want the same layout. Unrequested gradients are left undefined;
// the bias gradient comes out of the backward-weights pass when the weight gradient is requested too.
struct Conv2dGrads {
  Tensor input, weight, bias;
};
Conv2dGrads conv2dBackward(const Tensor& gradOut, const Tensor& x, const Tensor& weight, const Conv2dParams& params,
                           bool needInput, bool needWeight, bool needBias, ConvLayout layout = kDefaultConvLayout);
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
