// CUDA elementwise kernels: the device side of tensor/cpu/elementwise.h (Note [CUDA pointwise indexing]).
// Each op is one kernel per dtype with the op selected by a switch inside (uniform across a warp, so it
// costs a few instructions per element, not divergence) rather than a template per op, to keep nvcc time
// and binary size in check. TODO(perf): templated fast paths for the hottest ops (add, mul, relu).
// Math follows the CPU kernels' formulas; CUDA's device libm (expf, tanhf, normcdff) differs from our
// vectorised CPU float32 versions by a few ulp.
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "tensor/cuda/kernel_utils.cuh"
#include "tensor/cuda/tensor_kernels.h"

namespace distgrad::tensor::cuda {
namespace {

using kernels::BinaryOp;
using kernels::UnaryOp;

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;

template <typename T>
__device__ __forceinline__ T dExp(T x) {
  if constexpr (std::is_same_v<T, float>) return expf(x);
  else return exp(x);
}
template <typename T>
__device__ __forceinline__ T dLog(T x) {
  if constexpr (std::is_same_v<T, float>) return logf(x);
  else return log(x);
}
template <typename T>
__device__ __forceinline__ T dSqrt(T x) {
  if constexpr (std::is_same_v<T, float>) return sqrtf(x);
  else return sqrt(x);
}
template <typename T>
__device__ __forceinline__ T dTanh(T x) {
  if constexpr (std::is_same_v<T, float>) return tanhf(x);
  else return tanh(x);
}
template <typename T>
__device__ __forceinline__ T dPow(T x, T e) {
  if constexpr (std::is_same_v<T, float>) return powf(x, e);
  else return pow(x, e);
}
// Phi(x) = 0.5 erfc(-x / sqrt 2): accurate in the lower tail, like the CPU's normalCdf.
template <typename T>
__device__ __forceinline__ T dNormalCdf(T x) {
  if constexpr (std::is_same_v<T, float>) return normcdff(x);
  else return 0.5 * erfc(-x * kInvSqrt2);
}

template <typename T>
__device__ __forceinline__ T applyBinary(BinaryOp op, T a, T b) {
  switch (op) {
    case BinaryOp::kAdd: return a + b;
    case BinaryOp::kSub: return a - b;
    case BinaryOp::kMul: return a * b;
    case BinaryOp::kDiv:
      if constexpr (std::is_floating_point_v<T>) return a / b;
      else return T(0);  // integer division is rejected on the host
    case BinaryOp::kMaximum: return (a > b || a != a) ? a : b;  // NaN-propagating, like the CPU
    case BinaryOp::kMinimum: return (a < b || a != a) ? a : b;
    case BinaryOp::kEq: return a == b ? T(1) : T(0);
    case BinaryOp::kNe: return a != b ? T(1) : T(0);
    case BinaryOp::kLt: return a < b ? T(1) : T(0);
    case BinaryOp::kLe: return a <= b ? T(1) : T(0);
    case BinaryOp::kGt: return a > b ? T(1) : T(0);
    case BinaryOp::kGe: return a >= b ? T(1) : T(0);
  }
  return T(0);
}

template <typename T>
__device__ __forceinline__ T applyUnary(UnaryOp op, T x) {
  switch (op) {
    case UnaryOp::kNeg: return -x;
    case UnaryOp::kAbs: return x < T(0) ? -x : x;
    case UnaryOp::kRelu: return x > T(0) ? x : T(0);
    case UnaryOp::kSign: return T(x > T(0)) - T(x < T(0));
    default: break;
  }
  if constexpr (std::is_floating_point_v<T>) {  // the host rejects these ops on int64
    switch (op) {
      case UnaryOp::kExp: return dExp(x);
      case UnaryOp::kLog: return dLog(x);
      case UnaryOp::kSqrt: return dSqrt(x);
      case UnaryOp::kTanh: return dTanh(x);
      case UnaryOp::kSigmoid: return T(1) / (T(1) + dExp(-x));
      case UnaryOp::kGelu: return x * dNormalCdf(x);
      default: break;
    }
  }
  return x;
}

enum class ScalarOp { kAdd, kMul, kPow, kSquare, kCube, kSqrt, kReciprocal, kClamp };

template <typename T>
__device__ __forceinline__ T applyScalar(ScalarOp op, T x, T s0, T s1) {
  switch (op) {
    case ScalarOp::kAdd: return x + s0;
    case ScalarOp::kMul: return x * s0;
    case ScalarOp::kSquare: return x * x;
    case ScalarOp::kCube: return x * x * x;
    case ScalarOp::kClamp: return x < s0 ? s0 : (x > s1 ? s1 : x);  // NaN passes through
    default: break;
  }
  if constexpr (std::is_floating_point_v<T>) {
    switch (op) {
      case ScalarOp::kPow: return dPow(x, s0);
      case ScalarOp::kSqrt: return dSqrt(x);
      case ScalarOp::kReciprocal: return T(1) / x;
      default: break;
    }
  }
  return x;
}

template <typename T>
__device__ __forceinline__ T applyBackward(PointwiseBackward kind, T g, T v, T p0, T p1) {
  if constexpr (std::is_floating_point_v<T>) {
    switch (kind) {
      case PointwiseBackward::kRelu: return v > T(0) ? g : T(0);
      case PointwiseBackward::kSigmoid: return g * v * (T(1) - v);
      case PointwiseBackward::kTanh: return g * (T(1) - v * v);
      case PointwiseBackward::kSqrt: return g / (T(2) * v);
      case PointwiseBackward::kAbs: return v > T(0) ? g : (v < T(0) ? -g : T(0));
      case PointwiseBackward::kGelu:
        return g * (dNormalCdf(v) + v * dExp(T(-0.5) * v * v) * T(kInvSqrt2Pi));
      case PointwiseBackward::kPow:
        // p1 != 0 marks the exponent-2 fast path the CPU takes (2 g x, no pow call).
        return p1 != T(0) ? T(2) * g * v : g * p0 * dPow(v, p0 - T(1));
      case PointwiseBackward::kClamp: return (v >= p0 && v <= p1) ? g : T(0);
    }
  }
  return T(0);
}

template <typename T>
struct BinaryFn {
  BinaryOp op;
  T* out;
  const T* a;
  const T* b;
  __device__ void operator()(const int64_t (&o)[3]) const { out[o[0]] = applyBinary(op, a[o[1]], b[o[2]]); }
};

template <typename T>
struct UnaryFn {
  UnaryOp op;
  T* out;
  const T* a;
  __device__ void operator()(const int64_t (&o)[2]) const { out[o[0]] = applyUnary(op, a[o[1]]); }
};

template <typename T>
struct ScalarFn {
  ScalarOp op;
  T s0, s1;
  T* out;
  const T* a;
  __device__ void operator()(const int64_t (&o)[2]) const { out[o[0]] = applyScalar(op, a[o[1]], s0, s1); }
};

template <typename T>
struct BackwardFn {
  PointwiseBackward kind;
  T p0, p1;
  T* out;
  const T* g;
  const T* v;
  __device__ void operator()(const int64_t (&o)[3]) const { out[o[0]] = applyBackward(kind, g[o[1]], v[o[2]], p0, p1); }
};

template <typename C, typename T>
struct WhereFn {
  T* out;
  const C* cond;
  const T* a;
  const T* b;
  __device__ void operator()(const int64_t (&o)[4]) const { out[o[0]] = cond[o[1]] != C(0) ? a[o[2]] : b[o[3]]; }
};

template <typename T>
struct MaxMinBackwardFn {
  bool isMax;
  T* ga;
  T* gb;
  const T* g;
  const T* a;
  const T* b;
  __device__ void operator()(const int64_t (&o)[5]) const {
    const T gv = g[o[2]];
    const T xv = a[o[3]];
    const T yv = b[o[4]];
    const bool aWins = isMax ? xv > yv : xv < yv;
    const T wa = aWins ? T(1) : (xv == yv ? T(0.5) : T(0));  // ties split evenly, as on the CPU
    ga[o[0]] = gv * wa;
    gb[o[1]] = gv * (T(1) - wa);
  }
};

void checkOperands(const Tensor& a, const Tensor& b, const char* op) {
  DG_CHECK(a.defined(), op, ": first operand is an undefined tensor");
  DG_CHECK(b.defined(), op, ": second operand is an undefined tensor");
  DG_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch: ", dtypeName(a.dtype()), " ", shapeStr(a.shape()), " vs ",
           dtypeName(b.dtype()), " ", shapeStr(b.shape()),
           " (both operands must have the same dtype; convert one with toDType)");
}

bool floatOnly(UnaryOp op) {
  return !(op == UnaryOp::kNeg || op == UnaryOp::kAbs || op == UnaryOp::kRelu || op == UnaryOp::kSign);
}

template <typename T>
Tensor scalarOp(const Tensor& a, ScalarOp op, double s0, double s1) {
  Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
  launchPointwise<2>("CUDA scalar op", a.device(), a.shape(), {out.strides(), a.strides()},
                     ScalarFn<T>{op, static_cast<T>(s0), static_cast<T>(s1), typed<T>(out), typed<T>(a)});
  return out;
}

}  // namespace

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b, const char* name) {
  checkOperands(a, b, name);
  const Shape shape = kernels::broadcastShapes(a.shape(), b.shape(), name);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Tensor out = Tensor::empty(shape, a.dtype(), a.device());
    launchPointwise<3>(name, a.device(), shape,
                       {out.strides(), broadcastStridesOf(a, shape), broadcastStridesOf(b, shape)},
                       BinaryFn<T>{op, typed<T>(out), typed<T>(a), typed<T>(b)});
    return out;
  };
  // Integer division would silently truncate (and trap on zero); callers convert to float first.
  if (op == BinaryOp::kDiv) return dispatchFloat(a.dtype(), name, run);
  return dispatchDType(a.dtype(), name, run);
}

Tensor unary(UnaryOp op, const Tensor& a, const char* name) {
  DG_CHECK(a.defined(), name, ": input is an undefined tensor");
  auto run = [&](auto tag) {
    using T = decltype(tag);
    Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
    launchPointwise<2>(name, a.device(), a.shape(), {out.strides(), a.strides()},
                       UnaryFn<T>{op, typed<T>(out), typed<T>(a)});
    return out;
  };
  if (floatOnly(op)) return dispatchFloat(a.dtype(), name, run);
  return dispatchDType(a.dtype(), name, run);
}

Tensor addScalar(const Tensor& a, double b) {
  return dispatchDType(a.dtype(), "add", [&](auto tag) { return scalarOp<decltype(tag)>(a, ScalarOp::kAdd, b, 0); });
}

Tensor mulScalar(const Tensor& a, double b) {
  return dispatchDType(a.dtype(), "mul", [&](auto tag) { return scalarOp<decltype(tag)>(a, ScalarOp::kMul, b, 0); });
}

Tensor powScalar(const Tensor& a, double exponent) {
  return dispatchFloat(a.dtype(), "pow", [&](auto tag) {
    using T = decltype(tag);
    // The CPU's special cases, so both devices agree on e.g. pow(x, 2) for negative x.
    if (exponent == 1.0) return a.cloneData();
    if (exponent == 2.0) return scalarOp<T>(a, ScalarOp::kSquare, 0, 0);
    if (exponent == 3.0) return scalarOp<T>(a, ScalarOp::kCube, 0, 0);
    if (exponent == 0.5) return scalarOp<T>(a, ScalarOp::kSqrt, 0, 0);
    if (exponent == -1.0) return scalarOp<T>(a, ScalarOp::kReciprocal, 0, 0);
    return scalarOp<T>(a, ScalarOp::kPow, exponent, 0);
  });
}

Tensor clamp(const Tensor& a, double min, double max) {
  DG_CHECK(!(min > max), "clamp: min (", min, ") must be <= max (", max, ")");
  return dispatchDType(a.dtype(), "clamp",
                       [&](auto tag) { return scalarOp<decltype(tag)>(a, ScalarOp::kClamp, min, max); });
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  DG_CHECK(cond.defined(), "where: condition is an undefined tensor");
  checkOperands(a, b, "where");
  const Shape shape = kernels::broadcastShapes(kernels::broadcastShapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  Tensor out = Tensor::empty(shape, a.dtype(), a.device());
  dispatchDType(cond.dtype(), "where (condition)", [&](auto ctag) {
    using C = decltype(ctag);
    dispatchDType(a.dtype(), "where", [&](auto tag) {
      using T = decltype(tag);
      launchPointwise<4>("where", a.device(), shape,
                         {out.strides(), broadcastStridesOf(cond, shape), broadcastStridesOf(a, shape),
                          broadcastStridesOf(b, shape)},
                         WhereFn<C, T>{typed<T>(out), typed<C>(cond), typed<T>(a), typed<T>(b)});
    });
  });
  return out;
}

Tensor pointwiseBackward(PointwiseBackward kind, const Tensor& grad, const Tensor& saved, double p0, double p1,
                         const char* name) {
  checkOperands(grad, saved, name);
  DG_CHECK(grad.shape() == saved.shape(), name, ": gradient shape ", shapeStr(grad.shape()),
           " does not match saved tensor shape ", shapeStr(saved.shape()));
  if (kind == PointwiseBackward::kPow) {
    // The CPU's special cases (powBackward in tensor/cpu/elementwise.cpp).
    if (p0 == 0.0) return Tensor::zeros(grad.shape(), grad.dtype(), grad.device());
    if (p0 == 1.0) return grad.cloneData();
    p1 = p0 == 2.0 ? 1.0 : 0.0;
  }
  return dispatchFloat(grad.dtype(), name, [&](auto tag) {
    using T = decltype(tag);
    Tensor out = Tensor::empty(grad.shape(), grad.dtype(), grad.device());
    launchPointwise<3>(name, grad.device(), grad.shape(), {out.strides(), grad.strides(), saved.strides()},
                       BackwardFn<T>{kind, static_cast<T>(p0), static_cast<T>(p1), typed<T>(out), typed<T>(grad),
                                     typed<T>(saved)});
    return out;
  });
}

void maxMinBackward(const Tensor& grad, const Tensor& a, const Tensor& b, bool isMax, Tensor* gradA,
                    Tensor* gradB) {
  const char* op = isMax ? "maximum backward" : "minimum backward";
  checkOperands(a, b, op);
  checkOperands(grad, a, op);
  const Shape shape = kernels::broadcastShapes(a.shape(), b.shape(), op);
  DG_CHECK(grad.shape() == shape, op, ": gradient shape ", shapeStr(grad.shape()), " expected ", shapeStr(shape));
  dispatchFloat(a.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    Tensor ga = Tensor::empty(shape, a.dtype(), a.device());
    Tensor gb = Tensor::empty(shape, a.dtype(), a.device());
    launchPointwise<5>(op, a.device(), shape,
                       {ga.strides(), gb.strides(), broadcastStridesOf(grad, shape), broadcastStridesOf(a, shape),
                        broadcastStridesOf(b, shape)},
                       MaxMinBackwardFn<T>{isMax, typed<T>(ga), typed<T>(gb), typed<T>(grad), typed<T>(a), typed<T>(b)});
    if (gradA) *gradA = ga;
    if (gradB) *gradB = gb;
  });
}

}  // namespace distgrad::tensor::cuda
