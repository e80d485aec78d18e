#include "models/optim/optimizer.h"

#include <cmath>
#include <sstream>
#include <unordered_set>

#include "autograd/grad_mode.h"
#include "models/cuda_kernels.h"

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
    DG_CHECK(g.device() == p.device(), name_, "::step: gradient ", i, " is on ", g.device().str(), " but parameter ", i,
             " is on ", p.device().str(), " (gradient and parameter must share a device)");
    DG_CHECK(p.device().isCpu() || g.isContiguous(), name_, "::step: gradient ", i, " on ", g.device().str(),
             " is not contiguous (the CUDA update kernels need contiguous gradients)");
    checkStateDevice(i);
  }
  autograd::NoGradGuard noGrad;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    const Tensor grad = grads[i].isContiguous() ? grads[i] : grads[i].cloneData();
    update(i, parameters_[i], grad);
  }
  ++stepCount_;
}

void Optimizer::checkStateDevice(size_t index) const {
  const Tensor& p = parameters_[index];
  for (const auto& f : stateFields()) {
    if (f.isStepCounter) continue;
    const Tensor value = getState(index, f.name);
    if (!value.defined()) return;  // no state yet: it is created on the parameter's device
    DG_CHECK(value.device() == p.device(), name_, "::step: the '", f.name, "' state of parameter ", index, " is on ",
             value.device().str(), " but the parameter is now on ", p.device().str(),
             " (the module was moved after this optimizer stepped: build the optimizer after Module::to, or "
             "save its stateDict and load it into a new optimizer over the moved parameters)");
  }
}

Tensor Optimizer::newState(const Tensor& param, bool zeroed) const {
  Tensor state = Tensor::empty(param.shape(), param.dtype(), param.device());
  if (!zeroed) return state;
  if (param.device().isCpu())
    state.fill(0.0);
  else
    detail::zeroBytesCuda(param.device().index, state.rawData(), state.nbytes());
  return state;
}

void Optimizer::zeroGrad() {
  for (auto& p : parameters_) {
    if (p.grad().defined()) p.setGrad(Tensor());
  }
}

StateDict Optimizer::stateDict() const {
  StateDict out;
  out.insert("learning_rate", Tensor::scalar(learningRate_, DType::kFloat64));
  out.insert("step_count", Tensor::scalar(static_cast<double>(stepCount_), DType::kInt64));
  const auto fields = stateFields();
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (fields.empty() || !getState(i, fields.front().name).defined()) continue;
    for (const auto& f : fields) {
      Tensor value = getState(i, f.name);
      DG_ASSERT(value.defined(), name_, ": parameter ", i, " has state but no '", f.name, "'");
      out.insert(std::to_string(i) + "." + f.name, value.cloneData());
    }
  }
  return out;
}

void Optimizer::loadStateDict(const StateDict& state) {
  auto fail = [&](const std::string& why) { throw ValueError(name_ + "::loadStateDict: " + why); };
  const Tensor* lr = state.find("learning_rate");
  const Tensor* steps = state.find("step_count");
  if (lr == nullptr || steps == nullptr) fail("missing 'learning_rate' or 'step_count' (not an optimizer state?)");
  if (lr->numel() != 1 || lr->dtype() != DType::kFloat64 || steps->numel() != 1 || steps->dtype() != DType::kInt64) {
    fail("'learning_rate' must be a float64 scalar and 'step_count' an int64 scalar");
  }
  const double newLr = lr->item();
  if (!std::isfinite(newLr) || newLr < 0) fail("invalid learning rate " + std::to_string(newLr));

  const auto fields = stateFields();
  std::unordered_set<std::string> expected{"learning_rate", "step_count"};
  std::vector<bool> hasState(parameters_.size(), false);
  for (size_t i = 0; i < parameters_.size(); ++i) {
    size_t present = 0;
    for (const auto& f : fields) {
      const std::string key = std::to_string(i) + "." + f.name;
      expected.insert(key);
      const Tensor* t = state.find(key);
      if (t == nullptr) continue;
      ++present;
      const Tensor& p = parameters_[i];
      if (f.isStepCounter) {
        if (t->numel() != 1 || t->dtype() != DType::kInt64 || t->item() < 1) {
          fail("'" + key + "' must be an int64 scalar >= 1");
        }
      } else if (t->shape() != p.shape() || t->dtype() != p.dtype()) {
        fail("'" + key + "' is " + tensor::dtypeName(t->dtype()) + " " + tensor::shapeStr(t->shape()) +
             " but parameter " + std::to_string(i) + " is " + tensor::dtypeName(p.dtype()) + " " +
             tensor::shapeStr(p.shape()));
      }
    }
    if (present != 0 && present != fields.size()) {
      fail("parameter " + std::to_string(i) + " has only part of its state (" + std::to_string(present) + " of " +
           std::to_string(fields.size()) + " fields)");
    }
    hasState[i] = present != 0;
  }
  std::ostringstream unexpected;
  for (const auto& [key, value] : state) {
    if (!expected.count(key)) unexpected << (unexpected.tellp() > 0 ? ", '" : "'") << key << "'";
  }
  if (unexpected.tellp() > 0) {
    fail("unexpected keys " + unexpected.str() + " (state of a different optimizer or parameter list?)");
  }

  // Everything validated: install. Tensor state goes to its parameter's device (a checkpoint read from a file
  // is on the CPU; a CUDA optimizer's stateDict stays on its device), always as a private copy.
  for (size_t i = 0; i < parameters_.size(); ++i) {
    resetState(i);
    if (!hasState[i]) continue;
    const Device device = parameters_[i].device();
    for (const auto& f : fields) {
      const Tensor& value = state.at(std::to_string(i) + "." + f.name);
      const bool copyHere = f.isStepCounter || value.device() == device;
      setState(i, f.name, copyHere ? value.cloneData() : value.to(device));
    }
  }
  learningRate_ = newLr;
  stepCount_ = static_cast<int64_t>(steps->item());
}

}  // namespace distgrad::models::optim
