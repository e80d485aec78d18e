#include "models/nn/module.h"

#include <sstream>
#include <unordered_set>

#include "tensor/cuda/runtime.h"

namespace distgrad::models {

template <typename F>
void Module::visitSlots(const std::string& prefix, bool params, bool buffers, F&& f) const {
  if (params) {
    for (const auto& slot : parameters_) f(prefix + slot.name, *slot.tensor);
  }
  if (buffers) {
    for (const auto& slot : buffers_) f(prefix + slot.name, *slot.tensor);
  }
  for (const auto& [name, child] : children_) child->visitSlots(prefix + name + ".", params, buffers, f);
}

std::vector<std::pair<std::string, Tensor>> Module::namedParameters() const {
  // A module shared by two parents (or a tensor registered twice) is listed once, like PyTorch, so an
  // optimizer never updates the same parameter twice per step.
  std::unordered_set<const tensor::TensorImpl*> seen;
  std::vector<std::pair<std::string, Tensor>> out;
  visitSlots("", true, false, [&](const std::string& name, Tensor& t) {
    if (seen.insert(t.implPtr().get()).second) out.emplace_back(name, t);
  });
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [name, t] : namedParameters()) out.push_back(std::move(t));
  return out;
}

std::vector<std::pair<std::string, Tensor>> Module::namedBuffers() const {
  std::unordered_set<const tensor::TensorImpl*> seen;
  std::vector<std::pair<std::string, Tensor>> out;
  visitSlots("", false, true, [&](const std::string& name, Tensor& t) {
    if (seen.insert(t.implPtr().get()).second) out.emplace_back(name, t);
  });
  return out;
}

std::vector<Tensor> Module::buffers() const {
  std::vector<Tensor> out;
  for (auto& [name, t] : namedBuffers()) out.push_back(std::move(t));
  return out;
}

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::namedChildren() const { return children_; }

std::vector<std::pair<std::string, std::shared_ptr<Module>>> Module::namedModules() const {
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> out;
  for (const auto& [name, child] : children_) {
    out.emplace_back(name, child);
    for (auto& [sub, module] : child->namedModules()) out.emplace_back(name + "." + sub, std::move(module));
  }
  return out;
}

std::vector<std::shared_ptr<Module>> Module::children() const {
  std::vector<std::shared_ptr<Module>> out;
  out.reserve(children_.size());
  for (const auto& [name, child] : children_) out.push_back(child);
  return out;
}

int64_t Module::numParameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

void Module::train(bool enabled) {
  training_ = enabled;
  for (auto& [name, child] : children_) child->train(enabled);
}

void Module::zeroGrad() {
  visitSlots("", true, false, [](const std::string&, Tensor& t) {
    if (t.grad().defined()) t.setGrad(Tensor());
  });
}

void Module::toDType(DType dtype) {
  DG_CHECK(tensor::isFloatingPoint(dtype) && (dtype == DType::kFloat32 || dtype == DType::kFloat64),
           typeName_, "::toDType: expected float32 or float64, got ", tensor::dtypeName(dtype));
  // A tensor registered in two places must stay one tensor after conversion.
  std::vector<std::pair<const tensor::TensorImpl*, Tensor>> converted;
  visitSlots("", true, true, [&](const std::string&, Tensor& t) {
    if (!tensor::isFloatingPoint(t.dtype()) || t.dtype() == dtype) return;
    const tensor::TensorImpl* key = t.implPtr().get();
    for (const auto& [old, replacement] : converted) {
      if (old == key) {
        t = replacement;
        return;
      }
    }
    Tensor next = t.toDType(dtype);
    if (t.requiresGrad()) next.setRequiresGrad(true);
    converted.emplace_back(key, next);
    t = next;
  });
}

Module& Module::to(Device device) {
  if (device.isCuda()) tensor::cuda::requireDevice(device.index, (typeName_ + "::to(" + device.str() + ")").c_str());
  std::unordered_set<const tensor::TensorImpl*> moved;
  // Copy everything first, then swap: a failed copy (out of device memory) leaves the module as it was.
  std::vector<std::pair<tensor::TensorImpl*, Tensor>> replacements;
  std::vector<std::pair<Tensor, Tensor>> grads;
  visitSlots("", true, true, [&](const std::string& name, Tensor& t) {
    if (t.device() == device || !moved.insert(t.implPtr().get()).second) return;
    // Through a contiguous copy: Tensor::to keeps the view's shape, the copy owns a fresh storage.
    Tensor copy = t.to(device);
    replacements.emplace_back(t.implPtr().get(), std::move(copy));
    const Tensor g = t.grad();
    if (g.defined()) grads.emplace_back(t, g.device() == device ? g : g.to(device));
  });
  for (auto& [impl, copy] : replacements) {
    // The swap PyTorch's Module._apply does with param.data: the impl (the tensor's identity, with its
    // autograd slot) stays, its view now points at the new storage.
    impl->storage = copy.storage();
    impl->strides = copy.strides();
    impl->offset = copy.offset();
  }
  for (auto& [t, g] : grads) t.setGrad(g);
  return *this;
}

Device Module::device() const {
  Device found = Device::cpu();
  bool any = false;
  visitSlots("", true, true, [&](const std::string&, Tensor& t) {
    if (!any) found = t.device();
    any = true;
  });
  return found;
}

StateDict Module::stateDict() const {
  StateDict state;
  visitSlots("", true, true, [&](const std::string& name, Tensor& t) { state.insert(name, t.detach()); });
  return state;
}

void Module::loadStateDict(const StateDict& state, bool strict) {
  std::vector<std::pair<std::string, Tensor*>> targets;
  visitSlots("", true, true, [&](const std::string& name, Tensor& t) { targets.emplace_back(name, &t); });

  std::vector<std::string> missing, unexpected, mismatched;
  std::vector<std::pair<Tensor*, const Tensor*>> copies;
  std::unordered_set<std::string> known;
  for (const auto& [name, target] : targets) {
    known.insert(name);
    const Tensor* src = state.find(name);
    if (src == nullptr) {
      missing.push_back(name);
      continue;
    }
    if (src->shape() != target->shape()) {
      mismatched.push_back("'" + name + "': checkpoint shape " + tensor::shapeStr(src->shape()) +
                           ", module shape " + tensor::shapeStr(target->shape()));
      continue;
    }
    if (src->dtype() != target->dtype()) {
      mismatched.push_back("'" + name + "': checkpoint dtype " + tensor::dtypeName(src->dtype()) +
                           ", module dtype " + tensor::dtypeName(target->dtype()));
      continue;
    }
    copies.emplace_back(target, src);
  }
  for (const auto& [name, value] : state) {
    if (!known.count(name)) unexpected.push_back(name);
  }

  const bool failed = !mismatched.empty() || (strict && (!missing.empty() || !unexpected.empty()));
  if (failed) {
    std::ostringstream msg;
    msg << typeName_ << "::loadStateDict: state does not fit the module";
    auto list = [&](const char* what, const std::vector<std::string>& names, bool quote) {
      if (names.empty()) return;
      msg << "; " << what << ": ";
      for (size_t i = 0; i < names.size(); ++i) {
        if (i) msg << ", ";
        if (quote) msg << "'" << names[i] << "'";
        else msg << names[i];
      }
    };
    if (strict) {
      list("missing keys", missing, true);
      list("unexpected keys", unexpected, true);
    }
    list("mismatched entries", mismatched, false);
    throw ValueError(msg.str());
  }
  // Everything validated: copy. Copy in place so optimizers and other holders of the handles see the values.
  for (auto& [target, src] : copies) target->copyFrom(*src);
}

void Module::checkNewName(const std::string& name, const char* what) const {
  DG_CHECK(!name.empty(), typeName_, ": ", what, " name must not be empty");
  DG_CHECK(name.find('.') == std::string::npos, typeName_, ": ", what, " name '", name,
           "' must not contain '.' (dots separate nesting levels)");
  for (const auto& s : parameters_) DG_CHECK(s.name != name, typeName_, ": name '", name, "' is already a parameter");
  for (const auto& s : buffers_) DG_CHECK(s.name != name, typeName_, ": name '", name, "' is already a buffer");
  for (const auto& c : children_) DG_CHECK(c.first != name, typeName_, ": name '", name, "' is already a submodule");
}

Tensor& Module::registerParameter(const std::string& name, Tensor& slot) {
  checkNewName(name, "parameter");
  DG_CHECK(slot.defined(), typeName_, ": parameter '", name, "' is undefined");
  DG_CHECK(tensor::isFloatingPoint(slot.dtype()), typeName_, ": parameter '", name,
           "' must be floating point, got ", tensor::dtypeName(slot.dtype()));
  if (!slot.isLeaf()) slot = slot.detach();
  slot.setRequiresGrad(true);
  parameters_.push_back({name, &slot});
  return slot;
}

Tensor& Module::registerBuffer(const std::string& name, Tensor& slot) {
  checkNewName(name, "buffer");
  DG_CHECK(slot.defined(), typeName_, ": buffer '", name, "' is undefined");
  buffers_.push_back({name, &slot});
  return slot;
}

void Module::addChild(const std::string& name, std::shared_ptr<Module> module) {
  checkNewName(name, "submodule");
  DG_CHECK(module != nullptr, typeName_, ": submodule '", name, "' is null");
  DG_CHECK(module.get() != this, typeName_, ": a module cannot be its own child");
  // A cycle (A -> B -> A) would make every recursive walk loop forever and leak through shared_ptrs.
  std::vector<const Module*> pending{module.get()};
  while (!pending.empty()) {
    const Module* m = pending.back();
    pending.pop_back();
    for (const auto& [childName, child] : m->children_) {
      DG_CHECK(child.get() != this, typeName_, ": adding submodule '", name, "' would create a cycle (it contains ",
               typeName_, " itself)");
      pending.push_back(child.get());
    }
  }
  module->train(training_);
  children_.emplace_back(name, std::move(module));
}

}  // namespace distgrad::models
