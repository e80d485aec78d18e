#include "models/optim/clip_grad.h"

#include <cmath>
#include <utility>
#include <vector>

#include "autograd/grad_mode.h"
#include "models/cuda_kernels.h"

namespace distgrad::models::optim {
namespace {
void checkGrad(const Tensor& g, const char* op) {
  DG_CHECK(g.dtype() == DType::kFloat32 || g.dtype() == DType::kFloat64, op, ": gradients must be float32 or float64, got ",
           tensor::dtypeName(g.dtype()));
  DG_CHECK(g.device().isCpu() || g.isContiguous(), op, ": a gradient on ", g.device().str(),
           " is not contiguous (the CUDA kernels need contiguous gradients)");
}

// Sums of squares of the CUDA gradients, one device double per device: every kernel adds into its device's
// accumulator on the current stream and the host reads each accumulator once (one stream sync per device
// per call, not one per gradient).
class DeviceSums {
 public:
  void add(const Tensor& g) {
    const int device = g.device().index;
    Tensor* acc = nullptr;
    for (auto& [d, t] : sums_) {
      if (d == device) acc = &t;
    }
    if (acc == nullptr) {
      Tensor t = Tensor::empty({1}, DType::kFloat64, g.device());
      detail::zeroBytesCuda(device, t.rawData(), t.nbytes());
      sums_.emplace_back(device, std::move(t));
      acc = &sums_.back().second;
    }
    tensor::dispatchFloat(g.dtype(), "gradNorm", [&](auto zero) {
      using T = decltype(zero);
      detail::addSumOfSquaresCuda<T>(device, g.data<T>(), g.numel(), acc->data<double>());
    });
  }
  double total() const {
    double s = 0;
    for (const auto& [device, t] : sums_) s += detail::readDeviceDouble(device, t.data<double>());
    return s;
  }

 private:
  std::vector<std::pair<int, Tensor>> sums_;
};

}  // namespace

double gradNorm(const std::vector<Tensor>& grads) {
  double total = 0;
  DeviceSums deviceSums;
  for (const auto& g0 : grads) {
    if (!g0.defined()) continue;
    checkGrad(g0, "gradNorm");
  }
  for (const auto& g0 : grads) {
    if (!g0.defined()) continue;
    if (g0.device().isCuda()) {
      deviceSums.add(g0);
      continue;
    }
    const Tensor g = g0.isContiguous() ? g0 : g0.cloneData();
    tensor::dispatchFloat(g.dtype(), "gradNorm", [&](auto zero) {
      using T = decltype(zero);
      const T* p = g.data<T>();
      double s = 0;
      for (int64_t i = 0, n = g.numel(); i < n; ++i) s += static_cast<double>(p[i]) * static_cast<double>(p[i]);
      total += s;
    });
  }
  return std::sqrt(total + deviceSums.total());
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
      if (g.device().isCuda()) {
        detail::scaleCuda<T>(g.device().index, g.data<T>(), g.numel(), coefficient);
        return;
      }
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
