#include "models/optim/optimizer.h"

#include <cmath>
#include <unordered_set>

#include "autograd/grad_mode.h"

namespace distgrad::models::optim {

Optimizer::Optimizer(std::vector<Tensor> parameters, double learningRate, std::string name)
    : parameters_(std::move(parameters)), learningRate_(learningRate), name_(std::move(name)) {
  DG_CHECK(std::isfinite(learningRate) && learningRate >= 0, name_, ": learning rate must be >= 0, got ", learningRate);
  DG_CHECK(!parameters_.empty(), name_, ": got an empty parameter list");
  std::unordered_set<const tensor::TensorImpl*> seen;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const Tensor& p = parameters_[i];
    DG_CHECK(p.defined(), name_, ": parameter ", i, " is undefined");
    DG_CHECK(p.isLeaf(), name_, ": parameter ", i, " is not a leaf tensor (it was produced by an op)");
    DG_CHECK(p.dtype() == DType::kFloat32 || p.dtype() == DType::kFloat64, name_, ": parameter ", i,
             " must be float32 or float64, got ", tensor::dtypeName(p.dtype()));
    DG_CHECK(p.device().isCpu(), name_, ": parameter ", i, " is on ", p.device().str(), "; only CPU is supported");
    DG_CHECK(p.isContiguous(), name_, ": parameter ", i, " of shape ", tensor::shapeStr(p.shape()),
             " is not contiguous");
    DG_CHECK(seen.insert(p.implPtr().get()).second, name_, ": parameter ", i, " appears twice in the list");
  }
}

void Optimizer::setLearningRate(double learningRate) {
  DG_CHECK(std::isfinite(learningRate) && learningRate >= 0, name_, ": learning rate must be >= 0, got ", learningRate);
  learningRate_ = learningRate;
}

void Optimizer::step() {
  std::vector<Tensor> grads;
  grads.reserve(parameters_.size());
  for (const auto& p : parameters_) grads.push_back(p.grad());
  step(grads);
}

void Optimizer::step(const std::vector<Tensor>& grads) {
  DG_CHECK(grads.size() == parameters_.size(), name_, "::step: got ", grads.size(), " gradients for ",
           parameters_.size(), " parameters");
  // Validate all before touching anything, so a bad gradient never leaves a half-applied step.
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined()) continue;
    const Tensor& p = parameters_[i];
    DG_CHECK(g.shape() == p.shape(), name_, "::step: gradient ", i, " has shape ", tensor::shapeStr(g.shape()),
             ", parameter has ", tensor::shapeStr(p.shape()));
    DG_CHECK(g.dtype() == p.dtype(), name_, "::step: gradient ", i, " is ", tensor::dtypeName(g.dtype()),
             ", parameter is ", tensor::dtypeName(p.dtype()));
    DG_CHECK(g.device().isCpu(), name_, "::step: gradient ", i, " is on ", g.device().str());
  }
  autograd::NoGradGuard noGrad;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    const Tensor grad = grads[i].isContiguous() ? grads[i] : grads[i].cloneData();
    update(i, parameters_[i], grad);
  }
  ++stepCount_;
}

void Optimizer::zeroGrad() {
  for (auto& p : parameters_) {
    if (p.grad().defined()) p.setGrad(Tensor());
  }
}

}  // namespace distgrad::models::optim
