#include "models/optim/adam.h"

#include <algorithm>
#include <cmath>

#include "models/cuda_kernels.h"

namespace distgrad::models::optim {
namespace {

struct AdamScalars {
  double lr, beta1, beta2, eps, weightDecay;
  double stepSize;       // lr / (1 - beta1^t)
  double biasCorrection2Sqrt;  // sqrt(1 - beta2^t)
  bool decoupled;
};

template <typename T>
void adamUpdate(T* __restrict p, const T* __restrict g, T* __restrict m, T* __restrict v, T* __restrict vmax,
                int64_t n, const AdamScalars& s) {
  const T b1 = static_cast<T>(s.beta1);
  const T b2 = static_cast<T>(s.beta2);
  const T oneMinusB1 = static_cast<T>(1.0 - s.beta1);
  const T oneMinusB2 = static_cast<T>(1.0 - s.beta2);
  const T eps = static_cast<T>(s.eps);
  const T stepSize = static_cast<T>(s.stepSize);
  const T invBc2Sqrt = static_cast<T>(1.0 / s.biasCorrection2Sqrt);
  const T l2 = s.decoupled ? T(0) : static_cast<T>(s.weightDecay);
  const T decay = s.decoupled ? static_cast<T>(1.0 - s.lr * s.weightDecay) : T(1);
  if (vmax == nullptr) {
    for (int64_t i = 0; i < n; ++i) {
      const T pi = p[i] * decay;
      const T gi = g[i] + l2 * p[i];
      const T mi = b1 * m[i] + oneMinusB1 * gi;
      const T vi = b2 * v[i] + oneMinusB2 * gi * gi;
      m[i] = mi;
      v[i] = vi;
      p[i] = pi - stepSize * mi / (std::sqrt(vi) * invBc2Sqrt + eps);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const T pi = p[i] * decay;
      const T gi = g[i] + l2 * p[i];
      const T mi = b1 * m[i] + oneMinusB1 * gi;
      const T vi = b2 * v[i] + oneMinusB2 * gi * gi;
      const T vm = std::max(vmax[i], vi);
      m[i] = mi;
      v[i] = vi;
      vmax[i] = vm;
      p[i] = pi - stepSize * mi / (std::sqrt(vm) * invBc2Sqrt + eps);
    }
  }
}

void checkAdamOptions(const AdamOptions& o, const char* name) {
  DG_CHECK(o.beta1 >= 0 && o.beta1 < 1, name, ": beta1 must be in [0, 1), got ", o.beta1);
  DG_CHECK(o.beta2 >= 0 && o.beta2 < 1, name, ": beta2 must be in [0, 1), got ", o.beta2);
  DG_CHECK(o.eps >= 0, name, ": eps must be >= 0, got ", o.eps);
  DG_CHECK(std::isfinite(o.weightDecay) && o.weightDecay >= 0, name, ": weightDecay must be >= 0, got ", o.weightDecay);
}

AdamOptions fromAdamW(const AdamWOptions& o) {
  return AdamOptions{o.learningRate, o.beta1, o.beta2, o.eps, o.weightDecay, o.amsgrad};
}

}  // namespace

Adam::Adam(std::vector<Tensor> parameters, const AdamOptions& options) : Adam(std::move(parameters), options, false, "Adam") {}

Adam::Adam(std::vector<Tensor> parameters, const AdamOptions& options, bool decoupledWeightDecay, std::string name)
    : Optimizer(std::move(parameters), options.learningRate, name), options_(options),
      decoupledWeightDecay_(decoupledWeightDecay) {
  checkAdamOptions(options, this->name().c_str());
  state_.resize(this->parameters().size());
}

void Adam::update(size_t index, const Tensor& param, const Tensor& grad) {
  State& st = state_[index];
  if (st.step == 0) {
    st.expAvg = newState(param, /*zeroed=*/true);
    st.expAvgSq = newState(param, /*zeroed=*/true);
    if (options_.amsgrad) st.maxExpAvgSq = newState(param, /*zeroed=*/true);
  }
  ++st.step;
  const double t = static_cast<double>(st.step);
  AdamScalars s{};
  s.lr = learningRate();
  s.beta1 = options_.beta1;
  s.beta2 = options_.beta2;
  s.eps = options_.eps;
  s.weightDecay = options_.weightDecay;
  s.stepSize = s.lr / (1.0 - std::pow(options_.beta1, t));
  s.biasCorrection2Sqrt = std::sqrt(1.0 - std::pow(options_.beta2, t));
  s.decoupled = decoupledWeightDecay_;
  tensor::dispatchFloat(param.dtype(), "Adam::step", [&](auto zero) {
    using T = decltype(zero);
    if (param.device().isCuda()) {
      detail::AdamStepArgs args;
      args.beta1 = s.beta1;
      args.beta2 = s.beta2;
      args.eps = s.eps;
      args.l2 = s.decoupled ? 0.0 : s.weightDecay;
      args.decay = s.decoupled ? 1.0 - s.lr * s.weightDecay : 1.0;
      args.stepSize = s.stepSize;
      args.invBiasCorrection2Sqrt = 1.0 / s.biasCorrection2Sqrt;
      detail::adamStepCuda<T>(param.device().index, param.data<T>(), grad.data<T>(), st.expAvg.data<T>(),
                              st.expAvgSq.data<T>(), options_.amsgrad ? st.maxExpAvgSq.data<T>() : nullptr,
                              param.numel(), args);
      return;
    }
    adamUpdate<T>(param.data<T>(), grad.data<T>(), st.expAvg.data<T>(), st.expAvgSq.data<T>(),
                  options_.amsgrad ? st.maxExpAvgSq.data<T>() : nullptr, param.numel(), s);
  });
}

std::vector<Optimizer::StateField> Adam::stateFields() const {
  std::vector<StateField> fields{{"step", true}, {"exp_avg", false}, {"exp_avg_sq", false}};
  if (options_.amsgrad) fields.push_back({"max_exp_avg_sq", false});
  return fields;
}

Tensor Adam::getState(size_t index, const std::string& field) const {
  const State& st = state_[index];
  if (st.step == 0) return Tensor();
  if (field == "step") return Tensor::scalar(static_cast<double>(st.step), DType::kInt64);
  if (field == "exp_avg") return st.expAvg;
  if (field == "exp_avg_sq") return st.expAvgSq;
  DG_ASSERT(field == "max_exp_avg_sq", "unknown Adam state field ", field);
  return st.maxExpAvgSq;
}

void Adam::setState(size_t index, const std::string& field, const Tensor& value) {
  State& st = state_[index];
  if (field == "step") st.step = static_cast<int64_t>(value.item());
  else if (field == "exp_avg") st.expAvg = value;
  else if (field == "exp_avg_sq") st.expAvgSq = value;
  else if (field == "max_exp_avg_sq") st.maxExpAvgSq = value;
  else DG_ASSERT(false, "unknown Adam state field ", field);
}

AdamW::AdamW(std::vector<Tensor> parameters, const AdamWOptions& options)
    : Adam(std::move(parameters), fromAdamW(options), true, "AdamW") {}

}  // namespace distgrad::models::optim
