// Raw elementwise CPU kernels: broadcasting binary ops, unary maps and the pointwise pieces of their
// backward formulas. Not differentiable (autograd/ops/elementwise.cpp records the graph).
//
// Every kernel returns a fresh contiguous tensor. Binary kernels broadcast like NumPy and require both
// operands to share a dtype; they take fast paths for same-shape contiguous operands, a one-element
// operand, and broadcasts that collapse to "row" patterns ([N,C] + [C], [N,C,H,W] * [1,C,1,1]); anything
// else goes through forEachStrided. Loops are written so the compiler vectorises them (-mavx2 -mfma).
// Computational dtypes are float32, float64 and int64 (transcendental ops: float32/float64 only).
// Thread-safety: stateless; safe to call concurrently.
#pragma once

#include "tensor/tensor.h"

namespace distgrad::tensor::kernels {

enum class BinaryOp {
  kAdd,
  kSub,
  kMul,
  kDiv,
  kMaximum,  // NaN-propagating
  kMinimum,  // NaN-propagating
  kEq,       // comparisons give 0/1 in the operands' dtype
  kNe,
  kLt,
  kLe,
  kGt,
  kGe,
};

enum class UnaryOp { kNeg, kExp, kLog, kSqrt, kAbs, kRelu, kGelu, kTanh, kSigmoid, kSign };

const char* binaryOpName(BinaryOp op);
const char* unaryOpName(UnaryOp op);

// The NumPy broadcast of two shapes; throws ValueError naming `op` and both shapes when incompatible.
Shape broadcastShapes(const Shape& a, const Shape& b, const char* op);

// a (op) b with broadcasting. `opName` is used in error messages (defaults to the op's own name).
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b, const char* opName = nullptr);
Tensor unary(UnaryOp op, const Tensor& a, const char* opName = nullptr);

// Scalar forms (the scalar is converted to a's dtype).
Tensor addScalar(const Tensor& a, double b);
Tensor mulScalar(const Tensor& a, double b);
// a ** exponent (float only).
Tensor powScalar(const Tensor& a, double exponent);
Tensor clamp(const Tensor& a, double min, double max);
// cond != 0 ? a : b, all three broadcast together; cond may have any computational dtype.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

// ---- pointwise backward pieces; `grad` and the saved tensor have the same shape ----
Tensor reluBackward(const Tensor& grad, const Tensor& output);        // grad * (output > 0)
Tensor sigmoidBackward(const Tensor& grad, const Tensor& output);     // grad * y * (1 - y)
Tensor tanhBackward(const Tensor& grad, const Tensor& output);        // grad * (1 - y^2)
Tensor sqrtBackward(const Tensor& grad, const Tensor& output);        // grad / (2 y)
Tensor geluBackward(const Tensor& grad, const Tensor& input);         // grad * (Phi(x) + x phi(x))
Tensor absBackward(const Tensor& grad, const Tensor& input);          // grad * sign(x)
Tensor powBackward(const Tensor& grad, const Tensor& input, double exponent);  // grad * e x^(e-1)
Tensor clampBackward(const Tensor& grad, const Tensor& input, double min, double max);  // grad * (min<=x<=max)
// Gradients of maximum/minimum w.r.t. a and b (broadcast shape; callers reduce with sumToShape). Ties
// split the gradient evenly, as PyTorch does.
void maxMinBackward(const Tensor& grad, const Tensor& a, const Tensor& b, bool isMax, Tensor* gradA,
                    Tensor* gradB);

// Throws naming `op` unless t is a defined CPU tensor.
void requireCpuTensor(const Tensor& t, const char* op, const char* what = "input");

}  // namespace distgrad::tensor::kernels
