#include "models/optim/sgd.h"

#include <cmath>

#include "models/cuda_kernels.h"

namespace distgrad::models::optim {
namespace {

// One fused pass per parameter (the update is memory-bound: every extra pass costs a full re-read). The
// branches are template parameters so each variant is a straight loop the compiler vectorises.
template <typename T, bool kMomentum, bool kFirstStep, bool kNesterov>
void sgdLoop(T* __restrict p, const T* __restrict g, T* __restrict buf, int64_t n, T lr, T wd, T mom, T keep) {
  for (int64_t i = 0; i < n; ++i) {
    const T d = g[i] + wd * p[i];
    if constexpr (!kMomentum) {
      p[i] -= lr * d;
    } else {
      // The buffer starts as the (decayed) gradient itself, without dampening (PyTorch).
      const T b = kFirstStep ? d : mom * buf[i] + keep * d;
      buf[i] = b;
      p[i] -= lr * (kNesterov ? d + mom * b : b);
    }
  }
}

template <typename T>
void sgdUpdate(T* p, const T* g, T* buf, int64_t n, bool firstStep, const SgdOptions& o, double learningRate) {
  const T lr = static_cast<T>(learningRate);
  const T wd = static_cast<T>(o.weightDecay);
  const T mom = static_cast<T>(o.momentum);
  const T keep = static_cast<T>(1.0 - o.dampening);
  if (buf == nullptr) return sgdLoop<T, false, false, false>(p, g, buf, n, lr, wd, mom, keep);
  if (firstStep) {
    return o.nesterov ? sgdLoop<T, true, true, true>(p, g, buf, n, lr, wd, mom, keep)
                      : sgdLoop<T, true, true, false>(p, g, buf, n, lr, wd, mom, keep);
  }
  return o.nesterov ? sgdLoop<T, true, false, true>(p, g, buf, n, lr, wd, mom, keep)
                    : sgdLoop<T, true, false, false>(p, g, buf, n, lr, wd, mom, keep);
}

}  // namespace

SGD::SGD(std::vector<Tensor> parameters, const SgdOptions& options)
    : Optimizer(std::move(parameters), options.learningRate, "SGD"), options_(options) {
  DG_CHECK(std::isfinite(options.momentum) && options.momentum >= 0, "SGD: momentum must be >= 0, got ", options.momentum);
  DG_CHECK(std::isfinite(options.weightDecay) && options.weightDecay >= 0, "SGD: weightDecay must be >= 0, got ",
           options.weightDecay);
  DG_CHECK(options.dampening >= 0 && options.dampening <= 1, "SGD: dampening must be in [0, 1], got ", options.dampening);
  DG_CHECK(!options.nesterov || (options.momentum > 0 && options.dampening == 0),
           "SGD: nesterov momentum requires momentum > 0 and dampening == 0, got momentum ", options.momentum,
           " and dampening ", options.dampening);
  momentumBuffers_.resize(this->parameters().size());
}

void SGD::update(size_t index, const Tensor& param, const Tensor& grad) {
  const int64_t n = param.numel();
  Tensor& buf = momentumBuffers_[index];
  const bool useMomentum = options_.momentum != 0;
  const bool firstStep = useMomentum && !buf.defined();
  if (firstStep) buf = newState(param, /*zeroed=*/false);
  // Note the order: the decayed gradient uses p before this step's update, as in PyTorch.
  tensor::dispatchFloat(param.dtype(), "SGD::step", [&](auto zero) {
    using T = decltype(zero);
    if (param.device().isCuda()) {
      detail::SgdStepArgs args;
      args.learningRate = learningRate();
      args.weightDecay = options_.weightDecay;
      args.momentum = options_.momentum;
      args.dampening = options_.dampening;
      args.nesterov = options_.nesterov;
      args.firstStep = firstStep;
      detail::sgdStepCuda<T>(param.device().index, param.data<T>(), grad.data<T>(),
                             useMomentum ? buf.data<T>() : nullptr, n, args);
      return;
    }
    sgdUpdate<T>(param.data<T>(), grad.data<T>(), useMomentum ? buf.data<T>() : nullptr, n, firstStep, options_,
                 learningRate());
  });
}

std::vector<Optimizer::StateField> SGD::stateFields() const {
  if (options_.momentum == 0) return {};
  return {{"momentum_buffer", false}};
}

Tensor SGD::getState(size_t index, const std::string& field) const {
  DG_ASSERT(field == "momentum_buffer", "unknown SGD state field ", field);
  return momentumBuffers_[index];
}

void SGD::setState(size_t index, const std::string& field, const Tensor& value) {
  DG_ASSERT(field == "momentum_buffer", "unknown SGD state field ", field);
  momentumBuffers_[index] = value;
}

}  // namespace distgrad::models::optim
