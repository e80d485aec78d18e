#include "autograd/gradcheck.h"

#include <cmath>
#include <sstream>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/ops.h"
#include "tensor/random.h"

namespace distgrad::autograd {
namespace {
// <y, v> in float64, computed without recording.
double projected(const Tensor& y, const Tensor& v) {
  auto yv = y.toVector<double>();
  auto vv = v.toVector<double>();
  double s = 0;
  for (size_t i = 0; i < yv.size(); ++i) s += yv[i] * vv[i];
  return s;
}

// Writes one element (row-major index) of a possibly strided float64/float32 tensor in place.
double* elementPtr(const Tensor& t, int64_t flat) {
  int64_t off = 0;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    off += (flat % t.shape()[d]) * t.strides()[d];
    flat /= t.shape()[d];
  }
  return static_cast<double*>(t.rawData()) + off;
}
}  // namespace

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& options) {
  GradcheckResult result;
  std::vector<Tensor> diffInputs;
  for (const auto& in : inputs) {
    if (in.defined() && in.requiresGrad()) {
      DG_CHECK(in.dtype() == DType::kFloat64, "gradcheck: inputs that require grad must be float64, got ",
               dtypeName(in.dtype()));
      // Perturbing one element of an expanded (stride-0) input would move several logical elements at once.
      for (int64_t d = 0; d < in.dim(); ++d) {
        DG_CHECK(in.stride(d) != 0 || in.size(d) <= 1, "gradcheck: input with shape ", tensor::shapeStr(in.shape()),
                 " has overlapping memory (stride 0 in dim ", d, "); pass a contiguous copy");
      }
      diffInputs.push_back(in);
    }
  }
  DG_CHECK(!diffInputs.empty(), "gradcheck: no input requires grad");

  Tensor y = fn(inputs);
  DG_CHECK(y.requiresGrad(), "gradcheck: the function's output does not require grad");
  tensor::Generator gen(options.seed);
  Tensor v = tensor::normal(y.shape(), 0.0, 1.0, gen, y.dtype());
  std::vector<Tensor> analytic = grad({y}, diffInputs, {v});

  NoGradGuard noGrad;
  for (size_t k = 0; k < diffInputs.size(); ++k) {
    const Tensor& x = diffInputs[k];
    std::vector<double> a = analytic[k].defined() ? analytic[k].toVector<double>()
                                                  : std::vector<double>(static_cast<size_t>(x.numel()), 0.0);
    for (int64_t i = 0; i < x.numel(); ++i) {
      double* p = elementPtr(x, i);
      const double orig = *p;
      *p = orig + options.eps;
      double plus = projected(fn(inputs), v);
      *p = orig - options.eps;
      double minus = projected(fn(inputs), v);
      *p = orig;
      double numeric = (plus - minus) / (2 * options.eps);
      if (std::abs(numeric - a[i]) > options.atol + options.rtol * std::abs(numeric)) {
        std::ostringstream msg;
        msg << "gradient mismatch for input " << k << " (shape " << tensor::shapeStr(x.shape()) << ") element "
            << i << ": analytic " << a[i] << ", numeric " << numeric;
        result.ok = false;
        result.message = msg.str();
        return result;
      }
    }
  }
  return result;
}

}  // namespace distgrad::autograd
