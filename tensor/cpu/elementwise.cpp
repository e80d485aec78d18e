#include "tensor/cpu/elementwise.h"

#include <cmath>
#include <numbers>

#include "tensor/cpu/elementwise_math.h"
#include "tensor/cpu/shape_kernels.h"
#include "tensor/cpu/strided.h"
#include "tensor/cuda/tensor_kernels.h"

namespace distgrad::tensor::kernels {
namespace {

// ---------------------------------------------------------------- functors
// Each functor is a stateless (or scalar-carrying) struct so the loops below inline it and vectorise.

struct AddF { template <typename T> T operator()(T a, T b) const { return a + b; } };
struct SubF { template <typename T> T operator()(T a, T b) const { return a - b; } };
struct MulF { template <typename T> T operator()(T a, T b) const { return a * b; } };
struct DivF { template <typename T> T operator()(T a, T b) const { return a / b; } };
// NaN-propagating max/min (a NaN in either operand wins), like torch.maximum.
struct MaxF {
  template <typename T> T operator()(T a, T b) const { return (a > b || a != a) ? a : b; }
};
struct MinF {
  template <typename T> T operator()(T a, T b) const { return (a < b || a != a) ? a : b; }
};
struct EqF { template <typename T> T operator()(T a, T b) const { return a == b ? T(1) : T(0); } };
struct NeF { template <typename T> T operator()(T a, T b) const { return a != b ? T(1) : T(0); } };
struct LtF { template <typename T> T operator()(T a, T b) const { return a < b ? T(1) : T(0); } };
struct LeF { template <typename T> T operator()(T a, T b) const { return a <= b ? T(1) : T(0); } };
struct GtF { template <typename T> T operator()(T a, T b) const { return a > b ? T(1) : T(0); } };
struct GeF { template <typename T> T operator()(T a, T b) const { return a >= b ? T(1) : T(0); } };

struct NegF { template <typename T> T operator()(T x) const { return -x; } };
// float32 uses the vectorisable versions (tensor/cpu/elementwise_math.h); float64 keeps libm's accuracy,
// which gradchecks rely on.
struct ExpF {
  template <typename T> T operator()(T x) const {
    if constexpr (std::is_same_v<T, float>) return vecmath::expf(x);
    else return std::exp(x);
  }
};
struct LogF { template <typename T> T operator()(T x) const { return std::log(x); } };
struct SqrtF { template <typename T> T operator()(T x) const { return std::sqrt(x); } };
struct AbsF { template <typename T> T operator()(T x) const { return x < T(0) ? -x : x; } };
struct ReluF { template <typename T> T operator()(T x) const { return x > T(0) ? x : T(0); } };
struct SignF {
  template <typename T> T operator()(T x) const { return T(x > T(0)) - T(x < T(0)); }
};
struct TanhF {
  template <typename T> T operator()(T x) const {
    if constexpr (std::is_same_v<T, float>) return vecmath::tanhf(x);
    else return std::tanh(x);
  }
};
struct SigmoidF {
  // 1 / (1 + e^-x) overflows harmlessly to 0 for very negative x (e^-x = inf).
  template <typename T> T operator()(T x) const {
    if constexpr (std::is_same_v<T, float>) return vecmath::sigmoidf(x);
    else return T(1) / (T(1) + std::exp(-x));
  }
};
struct GeluF {
  template <typename T> T operator()(T x) const {
    if constexpr (std::is_same_v<T, float>) return x * vecmath::normalCdf(x);
    else return T(0.5) * x * (T(1) + std::erf(x * T(std::numbers::sqrt2 / 2)));
  }
};

template <typename T>
struct AddScalarF {
  T s;
  T operator()(T x) const { return x + s; }
};
template <typename T>
struct MulScalarF {
  T s;
  T operator()(T x) const { return x * s; }
};
template <typename T>
struct PowF {
  T e;
  T operator()(T x) const { return std::pow(x, e); }
};
struct SquareF { template <typename T> T operator()(T x) const { return x * x; } };
struct CubeF { template <typename T> T operator()(T x) const { return x * x * x; } };
struct ReciprocalF { template <typename T> T operator()(T x) const { return T(1) / x; } };
template <typename T>
struct ClampF {
  T lo, hi;
  // NaN passes through (both comparisons are false).
  T operator()(T x) const { return x < lo ? lo : (x > hi ? hi : x); }
};

// Backward pieces: f(grad, saved).
struct ReluBackF { template <typename T> T operator()(T g, T y) const { return y > T(0) ? g : T(0); } };
struct SigmoidBackF { template <typename T> T operator()(T g, T y) const { return g * y * (T(1) - y); } };
struct TanhBackF { template <typename T> T operator()(T g, T y) const { return g * (T(1) - y * y); } };
struct SqrtBackF { template <typename T> T operator()(T g, T y) const { return g / (T(2) * y); } };
struct AbsBackF {
  template <typename T> T operator()(T g, T x) const { return x > T(0) ? g : (x < T(0) ? -g : T(0)); }
};
struct GeluBackF {
  template <typename T> T operator()(T g, T x) const {
    constexpr T kInvSqrt2Pi = T(std::numbers::inv_sqrtpi / std::numbers::sqrt2);
    if constexpr (std::is_same_v<T, float>) {
      return g * (vecmath::normalCdf(x) + x * vecmath::expf(-0.5f * x * x) * kInvSqrt2Pi);
    } else {
      const T cdf = T(0.5) * (T(1) + std::erf(x * T(std::numbers::sqrt2 / 2)));
      return g * (cdf + x * std::exp(T(-0.5) * x * x) * kInvSqrt2Pi);
    }
  }
};
template <typename T>
struct PowBackF {
  T e;
  T operator()(T g, T x) const { return g * e * std::pow(x, e - T(1)); }
};
template <typename T>
struct ClampBackF {
  T lo, hi;
  T operator()(T g, T x) const { return (x >= lo && x <= hi) ? g : T(0); }
};

// ---------------------------------------------------------------- loops

// out[i] = f(a[i*sa], b[i*sb]) with the stride patterns that matter specialised so each vectorises.
template <typename T, typename F>
inline void binaryRun(const T* a, int64_t sa, const T* b, int64_t sb, T* __restrict out, int64_t n, F f) {
  if (sa == 1 && sb == 1) {
    for (int64_t i = 0; i < n; ++i) out[i] = f(a[i], b[i]);
  } else if (sa == 1 && sb == 0) {
    const T bv = *b;
    for (int64_t i = 0; i < n; ++i) out[i] = f(a[i], bv);
  } else if (sa == 0 && sb == 1) {
    const T av = *a;
    for (int64_t i = 0; i < n; ++i) out[i] = f(av, b[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = f(a[i * sa], b[i * sb]);
  }
}

template <typename T, typename F>
inline void unaryRun(const T* a, int64_t sa, T* __restrict out, int64_t n, F f) {
  if (sa == 1) {
    for (int64_t i = 0; i < n; ++i) out[i] = f(a[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = f(a[i * sa]);
  }
}

// Strides (in elements) of `t` viewed at `outShape` under broadcasting: 0 where t has size 1 or lacks
// the dim.
Shape broadcastStrides(const Tensor& t, const Shape& outShape) {
  const size_t nd = outShape.size();
  const size_t td = t.shape().size();
  Shape strides(nd, 0);
  for (size_t i = 0; i < td; ++i) {
    const size_t o = nd - td + i;
    strides[o] = t.shape()[i] == 1 ? 0 : t.strides()[i];
  }
  return strides;
}

Shape toBytes(const Shape& elementStrides, size_t itemSize) {
  Shape out(elementStrides.size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = elementStrides[i] * static_cast<int64_t>(itemSize);
  return out;
}

// A large operand whose last dim jumps across cache lines (a transpose, a permute) would be read one cache
// line per element; a tiled contiguous copy first (kernels::contiguous) and a streaming loop after is
// several times faster.
constexpr int64_t kRelayoutMinNumel = 4096;
constexpr int64_t kRelayoutMinInnerStride = 16;

bool worthRelayout(const Tensor& t) {
  if (t.isContiguous() || t.numel() < kRelayoutMinNumel) return false;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (t.shape()[d] != 1) return t.strides()[d] >= kRelayoutMinInnerStride;
  }
  return false;
}

template <typename T, typename F>
Tensor binaryImpl(const Tensor& aIn, const Tensor& bIn, const Shape& outShape, F f) {
  const Tensor& a = worthRelayout(aIn) ? contiguous(aIn) : aIn;
  const Tensor& b = worthRelayout(bIn) ? contiguous(bIn) : bIn;
  Tensor out = Tensor::empty(outShape, a.dtype());
  const int64_t n = out.numel();
  if (n == 0) return out;
  T* o = static_cast<T*>(out.rawData());
  const T* pa = static_cast<const T*>(a.rawData());
  const T* pb = static_cast<const T*>(b.rawData());
  const bool aFull = a.shape() == outShape && a.isContiguous();
  const bool bFull = b.shape() == outShape && b.isContiguous();
  if (aFull && bFull) {
    binaryRun<T>(pa, 1, pb, 1, o, n, f);
    return out;
  }
  if (aFull && b.numel() == 1) {
    binaryRun<T>(pa, 1, pb, 0, o, n, f);
    return out;
  }
  if (bFull && a.numel() == 1) {
    binaryRun<T>(pa, 0, pb, 1, o, n, f);
    return out;
  }
  // Row and channel broadcasts ([N,C]+[C], [N,C,H,W]*[1,C,1,1]) coalesce to a short odometer whose inner
  // run is either contiguous in both operands or a scalar in one of them: binaryRun's fast cases.
  const size_t isz = sizeof(T);
  forEachStrided<3>(outShape,
                    {toBytes(contiguousStrides(outShape), isz), toBytes(broadcastStrides(a, outShape), isz),
                     toBytes(broadcastStrides(b, outShape), isz)},
                    {reinterpret_cast<char*>(o), static_cast<char*>(a.rawData()), static_cast<char*>(b.rawData())},
                    [&](const std::array<char*, 3>& p, const std::array<int64_t, 3>& s, int64_t len) {
                      DG_ASSERT(s[0] == static_cast<int64_t>(isz), "output inner stride must be contiguous");
                      binaryRun<T>(reinterpret_cast<const T*>(p[1]), s[1] / static_cast<int64_t>(isz),
                                   reinterpret_cast<const T*>(p[2]), s[2] / static_cast<int64_t>(isz),
                                   reinterpret_cast<T*>(p[0]), len, f);
                    });
  return out;
}

template <typename T, typename F>
Tensor unaryImpl(const Tensor& aIn, F f) {
  const Tensor& a = worthRelayout(aIn) ? contiguous(aIn) : aIn;
  Tensor out = Tensor::empty(a.shape(), a.dtype());
  const int64_t n = out.numel();
  if (n == 0) return out;
  T* o = static_cast<T*>(out.rawData());
  if (a.isContiguous()) {
    unaryRun<T>(static_cast<const T*>(a.rawData()), 1, o, n, f);
    return out;
  }
  const size_t isz = sizeof(T);
  forEachStrided<2>(a.shape(), {toBytes(out.strides(), isz), toBytes(a.strides(), isz)},
                    {reinterpret_cast<char*>(o), static_cast<char*>(a.rawData())},
                    [&](const std::array<char*, 2>& p, const std::array<int64_t, 2>& s, int64_t len) {
                      unaryRun<T>(reinterpret_cast<const T*>(p[1]), s[1] / static_cast<int64_t>(isz),
                                  reinterpret_cast<T*>(p[0]), len, f);
                    });
  return out;
}

void checkBinaryOperands(const Tensor& a, const Tensor& b, const char* op) {
  requireCpuTensor(a, op, "first operand");
  requireCpuTensor(b, op, "second operand");
  DG_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch: ", dtypeName(a.dtype()), " ", shapeStr(a.shape()),
           " vs ", dtypeName(b.dtype()), " ", shapeStr(b.shape()),
           " (both operands must have the same dtype; convert one with toDType)");
}

template <typename F>
Tensor binaryAny(const Tensor& a, const Tensor& b, const char* op, F f) {
  checkBinaryOperands(a, b, op);
  Shape outShape = broadcastShapes(a.shape(), b.shape(), op);
  return dispatchDType(a.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    return binaryImpl<T>(a, b, outShape, f);
  });
}

template <typename F>
Tensor binaryFloat(const Tensor& a, const Tensor& b, const char* op, F f) {
  checkBinaryOperands(a, b, op);
  Shape outShape = broadcastShapes(a.shape(), b.shape(), op);
  return dispatchFloat(a.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    return binaryImpl<T>(a, b, outShape, f);
  });
}

// Backward pieces: grad and saved must have the same shape and dtype.
template <typename MakeF>
Tensor backwardFloat(const Tensor& grad, const Tensor& saved, const char* op, MakeF makeF) {
  checkBinaryOperands(grad, saved, op);
  DG_CHECK(grad.shape() == saved.shape(), op, ": gradient shape ", shapeStr(grad.shape()),
           " does not match saved tensor shape ", shapeStr(saved.shape()));
  return dispatchFloat(grad.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    return binaryImpl<T>(grad, saved, grad.shape(), makeF(tag));
  });
}

template <typename F>
Tensor unaryAny(const Tensor& a, const char* op, F f) {
  requireCpuTensor(a, op);
  return dispatchDType(a.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    return unaryImpl<T>(a, f);
  });
}

template <typename F>
Tensor unaryFloat(const Tensor& a, const char* op, F f) {
  requireCpuTensor(a, op);
  return dispatchFloat(a.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    return unaryImpl<T>(a, f);
  });
}

// where(cond, a, b): cond's element type C, value type T.
template <typename C, typename T>
void whereLoop(const Tensor& cond, const Tensor& a, const Tensor& b, Tensor& out) {
  const Shape& shape = out.shape();
  forEachStrided<4>(shape,
                    {toBytes(out.strides(), sizeof(T)), toBytes(broadcastStrides(cond, shape), sizeof(C)),
                     toBytes(broadcastStrides(a, shape), sizeof(T)), toBytes(broadcastStrides(b, shape), sizeof(T))},
                    {static_cast<char*>(out.rawData()), static_cast<char*>(cond.rawData()),
                     static_cast<char*>(a.rawData()), static_cast<char*>(b.rawData())},
                    [&](const std::array<char*, 4>& p, const std::array<int64_t, 4>& s, int64_t len) {
                      T* o = reinterpret_cast<T*>(p[0]);
                      const int64_t sc = s[1] / static_cast<int64_t>(sizeof(C));
                      const int64_t sa = s[2] / static_cast<int64_t>(sizeof(T));
                      const int64_t sb = s[3] / static_cast<int64_t>(sizeof(T));
                      const C* c = reinterpret_cast<const C*>(p[1]);
                      const T* pa = reinterpret_cast<const T*>(p[2]);
                      const T* pb = reinterpret_cast<const T*>(p[3]);
                      if (sc == 1 && sa == 1 && sb == 1) {
                        for (int64_t i = 0; i < len; ++i) o[i] = c[i] != C(0) ? pa[i] : pb[i];
                      } else {
                        for (int64_t i = 0; i < len; ++i) o[i] = c[i * sc] != C(0) ? pa[i * sa] : pb[i * sb];
                      }
                    });
}

}  // namespace

// ---------------------------------------------------------------- public API

void requireCpuTensor(const Tensor& t, const char* op, const char* what) {
  DG_CHECK(t.defined(), op, ": ", what, " is an undefined tensor");
  DG_CHECK(t.device().isCpu(), op, ": ", what, " is on ", t.device().str(),
           "; this kernel runs on CPU tensors (move it with .to(Device::cpu()))");
}

const char* binaryOpName(BinaryOp op) {
  switch (op) {
    case BinaryOp::kAdd: return "add";
    case BinaryOp::kSub: return "sub";
    case BinaryOp::kMul: return "mul";
    case BinaryOp::kDiv: return "div";
    case BinaryOp::kMaximum: return "maximum";
    case BinaryOp::kMinimum: return "minimum";
    case BinaryOp::kEq: return "eq";
    case BinaryOp::kNe: return "ne";
    case BinaryOp::kLt: return "lt";
    case BinaryOp::kLe: return "le";
    case BinaryOp::kGt: return "gt";
    case BinaryOp::kGe: return "ge";
  }
  return "?";
}

const char* unaryOpName(UnaryOp op) {
  switch (op) {
    case UnaryOp::kNeg: return "neg";
    case UnaryOp::kExp: return "exp";
    case UnaryOp::kLog: return "log";
    case UnaryOp::kSqrt: return "sqrt";
    case UnaryOp::kAbs: return "abs";
    case UnaryOp::kRelu: return "relu";
    case UnaryOp::kGelu: return "gelu";
    case UnaryOp::kTanh: return "tanh";
    case UnaryOp::kSigmoid: return "sigmoid";
    case UnaryOp::kSign: return "sign";
  }
  return "?";
}

Shape broadcastShapes(const Shape& a, const Shape& b, const char* op) {
  if (a == b) return a;
  const size_t nd = std::max(a.size(), b.size());
  Shape out(nd);
  for (size_t i = 0; i < nd; ++i) {
    // align from the right
    const int64_t da = i < nd - a.size() ? 1 : a[i - (nd - a.size())];
    const int64_t db = i < nd - b.size() ? 1 : b[i - (nd - b.size())];
    DG_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", shapeStr(a), " and ", shapeStr(b),
             " cannot be broadcast together (dim ", static_cast<int64_t>(i) - static_cast<int64_t>(nd), ": ", da,
             " vs ", db, ")");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b, const char* opName) {
  const char* name = opName ? opName : binaryOpName(op);
  if (cuda::routeToCuda(name, a, b)) return cuda::binary(op, a, b, name);
  switch (op) {
    case BinaryOp::kAdd: return binaryAny(a, b, name, AddF{});
    case BinaryOp::kSub: return binaryAny(a, b, name, SubF{});
    case BinaryOp::kMul: return binaryAny(a, b, name, MulF{});
    // Integer division would silently truncate (and trap on zero); callers convert to float first.
    case BinaryOp::kDiv: return binaryFloat(a, b, name, DivF{});
    case BinaryOp::kMaximum: return binaryAny(a, b, name, MaxF{});
    case BinaryOp::kMinimum: return binaryAny(a, b, name, MinF{});
    case BinaryOp::kEq: return binaryAny(a, b, name, EqF{});
    case BinaryOp::kNe: return binaryAny(a, b, name, NeF{});
    case BinaryOp::kLt: return binaryAny(a, b, name, LtF{});
    case BinaryOp::kLe: return binaryAny(a, b, name, LeF{});
    case BinaryOp::kGt: return binaryAny(a, b, name, GtF{});
    case BinaryOp::kGe: return binaryAny(a, b, name, GeF{});
  }
  DG_ASSERT(false, "unknown BinaryOp");
  return Tensor();
}

Tensor unary(UnaryOp op, const Tensor& a, const char* opName) {
  const char* name = opName ? opName : unaryOpName(op);
  if (cuda::routeToCuda(name, a)) return cuda::unary(op, a, name);
  switch (op) {
    case UnaryOp::kNeg: return unaryAny(a, name, NegF{});
    case UnaryOp::kAbs: return unaryAny(a, name, AbsF{});
    case UnaryOp::kRelu: return unaryAny(a, name, ReluF{});
    case UnaryOp::kSign: return unaryAny(a, name, SignF{});
    case UnaryOp::kExp: return unaryFloat(a, name, ExpF{});
    case UnaryOp::kLog: return unaryFloat(a, name, LogF{});
    case UnaryOp::kSqrt: return unaryFloat(a, name, SqrtF{});
    case UnaryOp::kGelu: return unaryFloat(a, name, GeluF{});
    case UnaryOp::kTanh: return unaryFloat(a, name, TanhF{});
    case UnaryOp::kSigmoid: return unaryFloat(a, name, SigmoidF{});
  }
  DG_ASSERT(false, "unknown UnaryOp");
  return Tensor();
}

Tensor addScalar(const Tensor& a, double b) {
  if (cuda::routeToCuda("add", a)) return cuda::addScalar(a, b);
  requireCpuTensor(a, "add");
  return dispatchDType(a.dtype(), "add", [&](auto tag) {
    using T = decltype(tag);
    return unaryImpl<T>(a, AddScalarF<T>{static_cast<T>(b)});
  });
}

Tensor mulScalar(const Tensor& a, double b) {
  if (cuda::routeToCuda("mul", a)) return cuda::mulScalar(a, b);
  requireCpuTensor(a, "mul");
  return dispatchDType(a.dtype(), "mul", [&](auto tag) {
    using T = decltype(tag);
    return unaryImpl<T>(a, MulScalarF<T>{static_cast<T>(b)});
  });
}

Tensor powScalar(const Tensor& a, double exponent) {
  if (cuda::routeToCuda("pow", a)) return cuda::powScalar(a, exponent);
  requireCpuTensor(a, "pow");
  return dispatchFloat(a.dtype(), "pow", [&](auto tag) {
    using T = decltype(tag);
    // Common exponents avoid std::pow, which is slow and does not vectorise.
    if (exponent == 1.0) return a.cloneData();
    if (exponent == 2.0) return unaryImpl<T>(a, SquareF{});
    if (exponent == 3.0) return unaryImpl<T>(a, CubeF{});
    if (exponent == 0.5) return unaryImpl<T>(a, SqrtF{});
    if (exponent == -1.0) return unaryImpl<T>(a, ReciprocalF{});
    return unaryImpl<T>(a, PowF<T>{static_cast<T>(exponent)});
  });
}

Tensor clamp(const Tensor& a, double min, double max) {
  if (cuda::routeToCuda("clamp", a)) return cuda::clamp(a, min, max);
  requireCpuTensor(a, "clamp");
  DG_CHECK(!(min > max), "clamp: min (", min, ") must be <= max (", max, ")");
  return dispatchDType(a.dtype(), "clamp", [&](auto tag) {
    using T = decltype(tag);
    return unaryImpl<T>(a, ClampF<T>{static_cast<T>(min), static_cast<T>(max)});
  });
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  if (cuda::deviceOf("where", {{"condition", &cond}, {"first operand", &a}, {"second operand", &b}}).isCuda()) {
    return cuda::where(cond, a, b);
  }
  requireCpuTensor(cond, "where", "condition");
  checkBinaryOperands(a, b, "where");
  Shape shape = broadcastShapes(broadcastShapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  Tensor out = Tensor::empty(shape, a.dtype());
  if (out.numel() == 0) return out;
  dispatchDType(cond.dtype(), "where (condition)", [&](auto ctag) {
    using C = decltype(ctag);
    dispatchDType(a.dtype(), "where", [&](auto tag) {
      using T = decltype(tag);
      whereLoop<C, T>(cond, a, b, out);
    });
  });
  return out;
}

Tensor reluBackward(const Tensor& grad, const Tensor& output) {
  if (cuda::routeToCuda("relu backward", grad, output)) {
    return cuda::pointwiseBackward(cuda::PointwiseBackward::kRelu, grad, output, 0, 0, "relu backward");
  }
  return backwardFloat(grad, output, "relu backward", [](auto) { return ReluBackF{}; });
}
Tensor sigmoidBackward(const Tensor& grad, const Tensor& output) {
  if (cuda::routeToCuda("sigmoid backward", grad, output)) {
    return cuda::pointwiseBackward(cuda::PointwiseBackward::kSigmoid, grad, output, 0, 0, "sigmoid backward");
  }
  return backwardFloat(grad, output, "sigmoid backward", [](auto) { return SigmoidBackF{}; });
}
Tensor tanhBackward(const Tensor& grad, const Tensor& output) {
  if (cuda::routeToCuda("tanh backward", grad, output)) {
    return cuda::pointwiseBackward(cuda::PointwiseBackward::kTanh, grad, output, 0, 0, "tanh backward");
  }
  return backwardFloat(grad, output, "tanh backward", [](auto) { return TanhBackF{}; });
}
Tensor sqrtBackward(const Tensor& grad, const Tensor& output) {
  if (cuda::routeToCuda("sqrt backward", grad, output)) {
    return cuda::pointwiseBackward(cuda::PointwiseBackward::kSqrt, grad, output, 0, 0, "sqrt backward");
  }
  return backwardFloat(grad, output, "sqrt backward", [](auto) { return SqrtBackF{}; });
}
Tensor geluBackward(const Tensor& grad, const Tensor& input) {
  if (cuda::routeToCuda("gelu backward", grad, input)) {
    return cuda::pointwiseBackward(cuda::PointwiseBackward::kGelu, grad, input, 0, 0, "gelu backward");
  }
  return backwardFloat(grad, input, "gelu backward", [](auto) { return GeluBackF{}; });
}
Tensor absBackward(const Tensor& grad, const Tensor& input) {
  if (cuda::routeToCuda("abs backward", grad, input)) {
    return cuda::pointwiseBackward(cuda::PointwiseBackward::kAbs, grad, input, 0, 0, "abs backward");
  }
  return backwardFloat(grad, input, "abs backward", [](auto) { return AbsBackF{}; });
}
Tensor powBackward(const Tensor& grad, const Tensor& input, double exponent) {
  if (cuda::routeToCuda("pow backward", grad, input)) {
    return cuda::pointwiseBackward(cuda::PointwiseBackward::kPow, grad, input, exponent, 0, "pow backward");
  }
  if (exponent == 0.0) {  // d/dx x^0 = 0 everywhere (avoid 0 * inf at x = 0)
    return Tensor::zeros(grad.shape(), grad.dtype());
  }
  if (exponent == 1.0) return grad.cloneData();
  if (exponent == 2.0) {
    return backwardFloat(grad, input, "pow backward", [](auto tag) {
      using T = decltype(tag);
      return [](T g, T x) { return T(2) * g * x; };
    });
  }
  return backwardFloat(grad, input, "pow backward", [exponent](auto tag) {
    using T = decltype(tag);
    return PowBackF<T>{static_cast<T>(exponent)};
  });
}
Tensor clampBackward(const Tensor& grad, const Tensor& input, double min, double max) {
  if (cuda::routeToCuda("clamp backward", grad, input)) {
    return cuda::pointwiseBackward(cuda::PointwiseBackward::kClamp, grad, input, min, max, "clamp backward");
  }
  return backwardFloat(grad, input, "clamp backward", [min, max](auto tag) {
    using T = decltype(tag);
    return ClampBackF<T>{static_cast<T>(min), static_cast<T>(max)};
  });
}

void maxMinBackward(const Tensor& grad, const Tensor& a, const Tensor& b, bool isMax, Tensor* gradA,
                    Tensor* gradB) {
  const char* op = isMax ? "maximum backward" : "minimum backward";
  if (cuda::deviceOf(op, {{"gradient", &grad}, {"first operand", &a}, {"second operand", &b}}).isCuda()) {
    cuda::maxMinBackward(grad, a, b, isMax, gradA, gradB);
    return;
  }
  checkBinaryOperands(a, b, op);
  checkBinaryOperands(grad, a, op);
  const Shape shape = broadcastShapes(a.shape(), b.shape(), op);
  DG_CHECK(grad.shape() == shape, op, ": gradient shape ", shapeStr(grad.shape()), " expected ", shapeStr(shape));
  dispatchFloat(a.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    Tensor ga = Tensor::empty(shape, a.dtype());
    Tensor gb = Tensor::empty(shape, a.dtype());
    forEachStrided<5>(shape,
                      {toBytes(ga.strides(), sizeof(T)), toBytes(gb.strides(), sizeof(T)),
                       toBytes(broadcastStrides(grad, shape), sizeof(T)), toBytes(broadcastStrides(a, shape), sizeof(T)),
                       toBytes(broadcastStrides(b, shape), sizeof(T))},
                      {static_cast<char*>(ga.rawData()), static_cast<char*>(gb.rawData()),
                       static_cast<char*>(grad.rawData()), static_cast<char*>(a.rawData()),
                       static_cast<char*>(b.rawData())},
                      [&](const std::array<char*, 5>& p, const std::array<int64_t, 5>& s, int64_t len) {
                        T* oa = reinterpret_cast<T*>(p[0]);
                        T* ob = reinterpret_cast<T*>(p[1]);
                        const T* g = reinterpret_cast<const T*>(p[2]);
                        const T* x = reinterpret_cast<const T*>(p[3]);
                        const T* y = reinterpret_cast<const T*>(p[4]);
                        const int64_t sg = s[2] / static_cast<int64_t>(sizeof(T));
                        const int64_t sx = s[3] / static_cast<int64_t>(sizeof(T));
                        const int64_t sy = s[4] / static_cast<int64_t>(sizeof(T));
                        for (int64_t i = 0; i < len; ++i) {
                          const T gv = g[i * sg];
                          const T xv = x[i * sx];
                          const T yv = y[i * sy];
                          const bool aWins = isMax ? xv > yv : xv < yv;
                          const T wa = aWins ? T(1) : (xv == yv ? T(0.5) : T(0));
                          oa[i] = gv * wa;
                          ob[i] = gv * (T(1) - wa);
                        }
                      });
    if (gradA) *gradA = ga;
    if (gradB) *gradB = gb;
  });
}

}  // namespace distgrad::tensor::kernels
