// Elementwise differentiable ops (autograd/ops.h): forward via tensor/cpu/elementwise.h, backward
// formulas next to each op. Binary ops broadcast; their backward reduces each gradient back to its
// operand's shape with sumToShape.
#include <cmath>

#include "autograd/node.h"
#include "autograd/ops.h"
#include "tensor/cpu/elementwise.h"
#include "tensor/cpu/reduce.h"
#include "tensor/cpu/shape_kernels.h"

namespace distgrad {
namespace kernels = tensor::kernels;
using kernels::BinaryOp;
using kernels::UnaryOp;

namespace {

// Runs a unary kernel and records a backward that maps (grad, saved) -> input gradient.
template <typename Backward>
Tensor unaryOp(const char* nodeName, const Tensor& a, Tensor out, const Tensor& saved, Backward backward) {
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp(nodeName, {a}, out,
                            [saved = saved.detach(), backward](const std::vector<Tensor>& g, const autograd::Node&) {
                              return std::vector<Tensor>{backward(g[0], saved)};
                            });
}

Tensor gradFor(const autograd::Node& self, size_t i, const std::function<Tensor()>& compute) {
  return self.needsInputGrad(i) ? compute() : Tensor();
}

}  // namespace

Shape broadcastShapes(const Shape& a, const Shape& b, const char* op) { return kernels::broadcastShapes(a, b, op); }

Tensor sumToShape(const Tensor& grad, const Shape& shape) {
  if (grad.shape() == shape) return grad;
  const int64_t nd = grad.dim();
  const int64_t target = static_cast<int64_t>(shape.size());
  DG_CHECK(target <= nd, "sumToShape: cannot reduce ", tensor::shapeStr(grad.shape()), " to ",
           tensor::shapeStr(shape), " (target has more dims)");
  std::vector<int64_t> dims;
  const int64_t lead = nd - target;
  for (int64_t d = 0; d < nd; ++d) {
    if (d < lead) {
      dims.push_back(d);
      continue;
    }
    const int64_t want = shape[d - lead];
    DG_CHECK(want == grad.shape()[d] || want == 1, "sumToShape: cannot reduce ", tensor::shapeStr(grad.shape()),
             " to ", tensor::shapeStr(shape), " (dim ", d, ")");
    if (want == 1 && grad.shape()[d] != 1) dims.push_back(d);
  }
  // keepDim keeps the broadcast size-1 dims in place; dropping the leading dims is then a free view.
  Tensor summed = sum(grad, dims, /*keepDim=*/true);
  return reshape(summed, shape);
}

// ---------------------------------------------------------------- binary arithmetic

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = kernels::binary(BinaryOp::kAdd, a, b);
  if (!autograd::anyRequiresGrad({a, b})) return out;
  return autograd::recordOp("AddBackward", {a, b}, out,
                            [sa = a.shape(), sb = b.shape()](const std::vector<Tensor>& g, const autograd::Node& self) {
                              return std::vector<Tensor>{
                                  gradFor(self, 0, [&] { return sumToShape(g[0], sa); }),
                                  gradFor(self, 1, [&] { return sumToShape(g[0], sb); })};
                            });
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = kernels::binary(BinaryOp::kSub, a, b);
  if (!autograd::anyRequiresGrad({a, b})) return out;
  return autograd::recordOp("SubBackward", {a, b}, out,
                            [sa = a.shape(), sb = b.shape()](const std::vector<Tensor>& g, const autograd::Node& self) {
                              return std::vector<Tensor>{
                                  gradFor(self, 0, [&] { return sumToShape(g[0], sa); }),
                                  gradFor(self, 1, [&] { return kernels::unary(UnaryOp::kNeg, sumToShape(g[0], sb)); })};
                            });
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = kernels::binary(BinaryOp::kMul, a, b);
  // Save only what each gradient needs: d/da needs b, d/db needs a.
  Tensor savedA = b.requiresGrad() ? a.detach() : Tensor();
  Tensor savedB = a.requiresGrad() ? b.detach() : Tensor();
  if (!autograd::anyRequiresGrad({a, b})) return out;
  return autograd::recordOp("MulBackward", {a, b}, out,
      [savedA, savedB, sa = a.shape(), sb = b.shape()](const std::vector<Tensor>& g, const autograd::Node& self) {
        return std::vector<Tensor>{
            gradFor(self, 0, [&] { return sumToShape(kernels::binary(BinaryOp::kMul, g[0], savedB), sa); }),
            gradFor(self, 1, [&] { return sumToShape(kernels::binary(BinaryOp::kMul, g[0], savedA), sb); })};
      });
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = kernels::binary(BinaryOp::kDiv, a, b);
  if (!autograd::anyRequiresGrad({a, b})) return out;
  // d(a/b)/db = -a / b^2 = -(g/b) * out: saving the (detached) quotient avoids recomputing it.
  Tensor quotient = b.requiresGrad() ? out.detach() : Tensor();
  return autograd::recordOp("DivBackward", {a, b}, out,
      [quotient, b = b.detach(), sa = a.shape()](const std::vector<Tensor>& g, const autograd::Node& self) {
        Tensor gOverB = kernels::binary(BinaryOp::kDiv, g[0], b);
        return std::vector<Tensor>{
            gradFor(self, 0, [&] { return sumToShape(gOverB, sa); }),
            gradFor(self, 1, [&] {
              Tensor t = kernels::binary(BinaryOp::kMul, gOverB, quotient);
              return kernels::unary(UnaryOp::kNeg, sumToShape(t, b.shape()));
            })};
      });
}

Tensor add(const Tensor& a, double b) {
  Tensor out = kernels::addScalar(a, b);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("AddScalarBackward", {a}, out,
                            [](const std::vector<Tensor>& g, const autograd::Node&) { return std::vector<Tensor>{g[0]}; });
}

Tensor mul(const Tensor& a, double b) {
  Tensor out = kernels::mulScalar(a, b);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("MulScalarBackward", {a}, out, [b](const std::vector<Tensor>& g, const autograd::Node&) {
    return std::vector<Tensor>{kernels::mulScalar(g[0], b)};
  });
}

// ---------------------------------------------------------------- unary

Tensor neg(const Tensor& a) {
  Tensor out = kernels::unary(UnaryOp::kNeg, a);
  if (!autograd::anyRequiresGrad({a})) return out;
  return autograd::recordOp("NegBackward", {a}, out, [](const std::vector<Tensor>& g, const autograd::Node&) {
    return std::vector<Tensor>{kernels::unary(UnaryOp::kNeg, g[0])};
  });
}

Tensor pow(const Tensor& a, double exponent) {
  Tensor out = kernels::powScalar(a, exponent);
  return unaryOp("PowBackward", a, out, a,
                 [exponent](const Tensor& g, const Tensor& x) { return kernels::powBackward(g, x, exponent); });
}

Tensor exp(const Tensor& a) {
  Tensor out = kernels::unary(UnaryOp::kExp, a);
  return unaryOp("ExpBackward", a, out, out,
                 [](const Tensor& g, const Tensor& y) { return kernels::binary(BinaryOp::kMul, g, y); });
}

Tensor log(const Tensor& a) {
  Tensor out = kernels::unary(UnaryOp::kLog, a);
  return unaryOp("LogBackward", a, out, a,
                 [](const Tensor& g, const Tensor& x) { return kernels::binary(BinaryOp::kDiv, g, x); });
}

Tensor sqrt(const Tensor& a) {
  Tensor out = kernels::unary(UnaryOp::kSqrt, a);
  return unaryOp("SqrtBackward", a, out, out, [](const Tensor& g, const Tensor& y) { return kernels::sqrtBackward(g, y); });
}

Tensor abs(const Tensor& a) {
  Tensor out = kernels::unary(UnaryOp::kAbs, a);
  return unaryOp("AbsBackward", a, out, a, [](const Tensor& g, const Tensor& x) { return kernels::absBackward(g, x); });
}

Tensor relu(const Tensor& a) {
  Tensor out = kernels::unary(UnaryOp::kRelu, a);
  return unaryOp("ReluBackward", a, out, out, [](const Tensor& g, const Tensor& y) { return kernels::reluBackward(g, y); });
}

Tensor gelu(const Tensor& a) {
  Tensor out = kernels::unary(UnaryOp::kGelu, a);
  return unaryOp("GeluBackward", a, out, a, [](const Tensor& g, const Tensor& x) { return kernels::geluBackward(g, x); });
}

Tensor tanh(const Tensor& a) {
  Tensor out = kernels::unary(UnaryOp::kTanh, a);
  return unaryOp("TanhBackward", a, out, out, [](const Tensor& g, const Tensor& y) { return kernels::tanhBackward(g, y); });
}

Tensor sigmoid(const Tensor& a) {
  Tensor out = kernels::unary(UnaryOp::kSigmoid, a);
  return unaryOp("SigmoidBackward", a, out, out,
                 [](const Tensor& g, const Tensor& y) { return kernels::sigmoidBackward(g, y); });
}

Tensor clamp(const Tensor& a, double min, double max) {
  Tensor out = kernels::clamp(a, min, max);
  return unaryOp("ClampBackward", a, out, a,
                 [min, max](const Tensor& g, const Tensor& x) { return kernels::clampBackward(g, x, min, max); });
}

// ---------------------------------------------------------------- maximum / minimum / where

namespace {
Tensor maxMin(const Tensor& a, const Tensor& b, bool isMax) {
  Tensor out = kernels::binary(isMax ? BinaryOp::kMaximum : BinaryOp::kMinimum, a, b);
  if (!autograd::anyRequiresGrad({a, b})) return out;
  return autograd::recordOp(isMax ? "MaximumBackward" : "MinimumBackward", {a, b}, out,
                            [a = a.detach(), b = b.detach(), isMax](const std::vector<Tensor>& g, const autograd::Node& self) {
                              Tensor ga, gb;
                              kernels::maxMinBackward(g[0], a, b, isMax, self.needsInputGrad(0) ? &ga : nullptr,
                                                      self.needsInputGrad(1) ? &gb : nullptr);
                              return std::vector<Tensor>{ga.defined() ? sumToShape(ga, a.shape()) : Tensor(),
                                                         gb.defined() ? sumToShape(gb, b.shape()) : Tensor()};
                            });
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) { return maxMin(a, b, true); }
Tensor minimum(const Tensor& a, const Tensor& b) { return maxMin(a, b, false); }

Tensor eq(const Tensor& a, const Tensor& b) { return kernels::binary(BinaryOp::kEq, a, b); }
Tensor ne(const Tensor& a, const Tensor& b) { return kernels::binary(BinaryOp::kNe, a, b); }
Tensor lt(const Tensor& a, const Tensor& b) { return kernels::binary(BinaryOp::kLt, a, b); }
Tensor le(const Tensor& a, const Tensor& b) { return kernels::binary(BinaryOp::kLe, a, b); }
Tensor gt(const Tensor& a, const Tensor& b) { return kernels::binary(BinaryOp::kGt, a, b); }
Tensor ge(const Tensor& a, const Tensor& b) { return kernels::binary(BinaryOp::kGe, a, b); }

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  Tensor out = kernels::where(cond, a, b);
  if (!autograd::anyRequiresGrad({a, b})) return out;
  return autograd::recordOp("WhereBackward", {a, b}, out,
      [cond = cond.detach(), sa = a.shape(), sb = b.shape()](const std::vector<Tensor>& g, const autograd::Node& self) {
        Tensor zero = Tensor::zeros({}, g[0].dtype(), g[0].device());
        return std::vector<Tensor>{
            gradFor(self, 0, [&] { return sumToShape(kernels::where(cond, g[0], zero), sa); }),
            gradFor(self, 1, [&] { return sumToShape(kernels::where(cond, zero, g[0]), sb); })};
      });
}

}  // namespace distgrad
