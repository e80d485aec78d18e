#include "models/optim/clip_grad.h"

#include <cmath>

#include "autograd/grad_mode.h"

namespace distgrad::models::optim {
namespace {
void checkGrad(const Tensor& g, const char* op) {
  DG_CHECK(g.dtype() == DType::kFloat32 || g.dtype() == DType::kFloat64, op, ": gradients must be float32 or float64, got ",
           tensor::dtypeName(g.dtype()));
  DG_CHECK(g.device().isCpu(), op, ": gradients must be on the CPU, got ", g.device().str());
}
}  // namespace

double gradNorm(const std::vector<Tensor>& grads) {
  double total = 0;
  for (const auto& g0 : grads) {
    if (!g0.defined()) continue;
    checkGrad(g0, "gradNorm");
    const Tensor g = g0.isContiguous() ? g0 : g0.cloneData();
    tensor::dispatchFloat(g.dtype(), "gradNorm", [&](auto zero) {
      using T = decltype(zero);
      const T* p = g.data<T>();
      double s = 0;
      for (int64_t i = 0, n = g.numel(); i < n; ++i) s += static_cast<double>(p[i]) * static_cast<double>(p[i]);
      total += s;
    });
  }
  return std::sqrt(total);
}

double clipGradients(const std::vector<Tensor>& grads, double maxNorm) {
  DG_CHECK(maxNorm > 0, "clipGradients: maxNorm must be > 0, got ", maxNorm);
  for (const auto& g : grads) {  // validate all before scaling any: never leave a half-applied clip
    DG_CHECK(!g.defined() || g.isContiguous(), "clipGradients: cannot scale a non-contiguous gradient in place");
  }
  const double norm = gradNorm(grads);
  const double coefficient = maxNorm / (norm + 1e-6);
  if (coefficient >= 1.0) return norm;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    tensor::dispatchFloat(g.dtype(), "clipGradients", [&](auto zero) {
      using T = decltype(zero);
      T* p = g.data<T>();
      const T c = static_cast<T>(coefficient);
      for (int64_t i = 0, n = g.numel(); i < n; ++i) p[i] *= c;
    });
  }
  return norm;
}

double clipGradNorm(const std::vector<Tensor>& parameters, double maxNorm) {
  std::vector<Tensor> grads;
  grads.reserve(parameters.size());
  for (const auto& p : parameters) grads.push_back(p.grad());
  return clipGradients(grads, maxNorm);
}

}  // namespace distgrad::models::optim
