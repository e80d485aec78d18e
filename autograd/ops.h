// The differentiable tensor ops users call (namespace distgrad).
//
// Every op validates its arguments (a bad shape or dtype throws distgrad::ValueError naming the op, the
// shapes and what was expected), computes its result with the raw kernels in tensor/cpu/, and, when grad
// mode is on and an input requires grad, records a node whose backward formula lives next to the op.
// Binary ops broadcast like NumPy and require both operands to have the same dtype. Comparisons return
// 0/1 in the operands' dtype and are not differentiable.
// Thread-safety: ops are thread-safe for distinct outputs; graph recording is per tensor.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "tensor/random.h"
#include "tensor/tensor.h"

namespace distgrad {

// ---------------------------------------------------------------- elementwise (autograd/ops/elementwise.cpp)
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor neg(const Tensor& a);
Tensor pow(const Tensor& a, double exponent);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor abs(const Tensor& a);
Tensor relu(const Tensor& a);
Tensor gelu(const Tensor& a);  // exact (erf) form
Tensor tanh(const Tensor& a);
Tensor sigmoid(const Tensor& a);
Tensor clamp(const Tensor& a, double min, double max);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
// cond != 0 ? a : b (broadcasting); differentiable in a and b.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }
inline Tensor operator+(const Tensor& a, double b) { return add(a, b); }
inline Tensor operator+(double a, const Tensor& b) { return add(b, a); }
inline Tensor operator-(const Tensor& a, double b) { return add(a, -b); }
inline Tensor operator-(double a, const Tensor& b) { return add(neg(b), a); }
inline Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
inline Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
inline Tensor operator/(const Tensor& a, double b) { return mul(a, 1.0 / b); }

// The shape two shapes broadcast to; throws naming `op` when they are incompatible.
Shape broadcastShapes(const Shape& a, const Shape& b, const char* op);
// Sums `grad` down to `shape` (the reverse of broadcasting), used by backward formulas.
Tensor sumToShape(const Tensor& grad, const Shape& shape);

// ---------------------------------------------------------------- reductions (autograd/ops/reduction.cpp)
Tensor sum(const Tensor& a);                                                  // all elements -> scalar
Tensor sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepDim = false);
Tensor mean(const Tensor& a);
Tensor mean(const Tensor& a, const std::vector<int64_t>& dims, bool keepDim = false);
// Variance over dims (unbiased = Bessel's correction).
Tensor var(const Tensor& a, const std::vector<int64_t>& dims, bool unbiased = true, bool keepDim = false);
Tensor max(const Tensor& a);                                                  // all elements -> scalar
Tensor max(const Tensor& a, int64_t dim, bool keepDim = false);               // values (differentiable)
Tensor argmax(const Tensor& a, int64_t dim, bool keepDim = false);            // int64 indices

// ---------------------------------------------------------------- views and joins (autograd/ops/shape.cpp)
// Views share storage with their input; a shape may hold one -1 (inferred).
Tensor reshape(const Tensor& a, const Shape& shape);  // a view when strides allow, else a copy
Tensor view(const Tensor& a, const Shape& shape);     // always a view; error if strides do not allow it
Tensor transpose(const Tensor& a, int64_t dim0, int64_t dim1);
Tensor permute(const Tensor& a, const std::vector<int64_t>& dims);
Tensor narrow(const Tensor& a, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& a, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor select(const Tensor& a, int64_t dim, int64_t index);
Tensor expand(const Tensor& a, const Shape& shape);  // -1 keeps a dim; size-1 dims broadcast
Tensor squeeze(const Tensor& a);                     // all size-1 dims
Tensor squeeze(const Tensor& a, int64_t dim);
Tensor unsqueeze(const Tensor& a, int64_t dim);
Tensor flatten(const Tensor& a, int64_t startDim = 0, int64_t endDim = -1);
Tensor contiguous(const Tensor& a);  // `a` itself when already contiguous
Tensor clone(const Tensor& a);       // differentiable copy
// Differentiable copy to `device` (`a` itself when already there); the gradient goes back to a's device.
// The way a graph crosses devices: a stage moving its input to its GPU, a model split over two GPUs.
Tensor toDevice(const Tensor& a, Device device);
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim);
std::vector<Tensor> split(const Tensor& a, int64_t splitSize, int64_t dim);  // last piece may be smaller
std::vector<Tensor> chunk(const Tensor& a, int64_t chunks, int64_t dim);

// ---------------------------------------------------------------- linear algebra (autograd/ops/linalg.cpp)
// 1-D/2-D/batched matmul with broadcasting of batch dims, like numpy.matmul.
Tensor matmul(const Tensor& a, const Tensor& b);
Tensor bmm(const Tensor& a, const Tensor& b);  // [B,n,k] x [B,k,m]
// x[..., in] * weight[out, in]^T + bias[out]
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());

// ---------------------------------------------------------------- neural-network ops (autograd/ops/nn.cpp)
using Pair = std::array<int64_t, 2>;

struct Conv2dOptions {
  Pair stride{1, 1};
  Pair padding{0, 0};
  Pair dilation{1, 1};
  int64_t groups = 1;
};
// x [N,C,H,W], weight [O, C/groups, kH, kW], bias [O] or undefined.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), const Conv2dOptions& options = {});

struct Pool2dOptions {
  Pair kernel{2, 2};
  Pair stride{0, 0};  // 0 = same as kernel
  Pair padding{0, 0};
  bool ceilMode = false;
};
Tensor maxPool2d(const Tensor& x, const Pool2dOptions& options);
// Average pooling; padded cells are counted in the divisor (count_include_pad = true, PyTorch's default).
Tensor avgPool2d(const Tensor& x, const Pool2dOptions& options);
Tensor adaptiveAvgPool2d(const Tensor& x, Pair outputSize);

// Batch norm over N,H,W of x [N,C,H,W] (or N of x [N,C]). In training, uses batch statistics and updates
// runningMean/runningVar in place (if defined) with `momentum`; in eval, uses the running statistics.
Tensor batchNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& runningMean,
                 const Tensor& runningVar, bool training, double momentum = 0.1, double eps = 1e-5);

Tensor softmax(const Tensor& x, int64_t dim);
Tensor logSoftmax(const Tensor& x, int64_t dim);

enum class Reduction { kNone, kMean, kSum };
// logits [N,C], targets int64 [N] with values in [0,C).
Tensor crossEntropy(const Tensor& logits, const Tensor& targets, Reduction reduction = Reduction::kMean);
Tensor nllLoss(const Tensor& logProbs, const Tensor& targets, Reduction reduction = Reduction::kMean);
Tensor mseLoss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::kMean);

// Inverted dropout: zeroes with probability p and scales survivors by 1/(1-p); identity when !training.
Tensor dropout(const Tensor& x, double p, bool training, tensor::Generator& gen);
// Rows of weight [V, D] picked by int64 indices of any shape -> [..., D].
Tensor embedding(const Tensor& weight, const Tensor& indices);

}  // namespace distgrad
